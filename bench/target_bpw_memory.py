"""Peak GPU memory and phase times of `quantize --target-bpw` in one process (issue 20: 8B on one H100).

    python bench/target_bpw_memory.py BASE.gguf [--target-bpw 4.5] [--device cuda]

BASE: e.g. bench/quantize_speed.py --synthetic llama-3.1-8b's WORK/llama-3.1-8b-F16.gguf. Prints each
phase's wall seconds (QuantizeResult.phases, the CLI's `time:` line), the peak of torch's allocated
and reserved CUDA memory over the run, and the peak after the plan (the write: should be ~0, the model
freed and every candidate type encoded by the C++ encoders on the CPU).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    import torch

    from localllm.commands import quantize_cmd
    from localllm.commands.quantize_cmd import quantize_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base")
    ap.add_argument("--target-bpw", type=float, default=4.5)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    gib = 2**30
    cuda = args.device == "cuda"
    peaks = {}
    write_source = quantize_cmd.write_source

    def writing(*a, **k):  # the plan's peak, then the write's alone
        if cuda:
            peaks["plan"] = torch.cuda.max_memory_allocated() / gib
            torch.cuda.reset_peak_memory_stats()
            peaks["at write start"] = torch.cuda.memory_allocated() / gib
        return write_source(*a, **k)
    quantize_cmd.write_source = writing
    with tempfile.TemporaryDirectory(dir=Path(args.base).parent) as folder:
        start = time.perf_counter()
        result = quantize_model(args.base, Path(folder) / "out.gguf", None, target_bpw=args.target_bpw,
                                device=args.device, progress=False)
        total = time.perf_counter() - start
    print(f"--target-bpw {args.target_bpw} on {args.device}: {total:.1f} s ({quantize_cmd.phase_line(result.phases)})")
    if cuda:
        print(f"GPU peak allocated: plan (load, fisher+imatrix, errors) {peaks['plan']:.2f} GiB; at the write's start "
              f"{peaks['at write start']:.2f} GiB; write {torch.cuda.max_memory_allocated() / gib:.2f} GiB; reserved at "
              f"the end {torch.cuda.memory_reserved() / gib:.2f} GiB of {torch.cuda.get_device_properties(0).total_memory / gib:.1f}")


if __name__ == "__main__":
    main()
