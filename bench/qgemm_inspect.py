"""The fused quantized GEMM (kernels/triton_qgemm.py) compiled for an H100 (sm_90) on a machine without a GPU,
and read: shared memory, registers, spills, which loads are pipelined (cp.async) and which wait in the loop,
whether the decoded tiles go through shared memory (local_alloc in the K loop: the decode did not stay in
wgmma's register layout), and how many programs fit a multiprocessor. What made the kernel fast or slow
before any GPU run (the module docstring's three rules were found this way).

    python bench/qgemm_inspect.py [--types Q8_0,Q4_0,Q4_K,Q6_K] [--sweep] [--dump DIR]

Specializes the arguments as Triton's launcher would for the 8B qkv product (M 512), so the IR is the
one a launch compiles. Uses the installed Triton's ptxas and cuobjdump (pip's triton wheel ships both);
compile with the Triton the GPU machine runs (3.6 there in 2026-11: a wheel unpacked on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import gguf
import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource

from localllm.kernels import triton_qgemm
from localllm.kernels.qweight import QWeight
from localllm.quantize.formats import FORMATS
from qgemm_sweep import SWEEP, name

Q = gguf.GGMLQuantizationType
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "u8", torch.int8: "i8", torch.float32: "fp32"}
SMEM_PER_SM, REGS_PER_SM = 233472, 65536  # H100: bytes a multiprocessor shares (227 KB a block at most)


def compile_for_h100(qtype, cfg, n: int = 6144, k: int = 4096, m: int = 512):
    """The kernel Triton would build for this launch: CPU tensors stand in for the device ones."""
    fmt = FORMATS[qtype]
    w = QWeight.from_raw(torch.zeros((n, k // fmt.block * fmt.nbytes), dtype=torch.uint8), qtype).to_blocks()
    x, out = torch.zeros(m, k, dtype=torch.bfloat16), torch.zeros(m, n, dtype=torch.bfloat16)
    fn, _, args, options = triton_qgemm.launch(x, w, None, out, cfg)
    sig, attrs, consts = {}, {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            sig[p.name], consts[p.name] = "constexpr", options[p.name]
            continue
        a = args[i]
        if isinstance(a, torch.Tensor):
            sig[p.name], key = "*" + TYPES[a.dtype], "D" if a.data_ptr() % 16 == 0 else ""
        elif p.do_not_specialize:
            sig[p.name], key = "i32", ""
        else:
            sig[p.name], key = native_specialize_impl(BaseBackend, a, False, True, True)
            if sig[p.name] == "constexpr":
                consts[p.name] = a
        if key == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=options["num_warps"], num_stages=options["num_stages"]))


def read(kernel, warps: int) -> dict:
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([f"{tools}/cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout
    regs, stack = map(int, re.search(r"REG:(\d+).*?STACK:(\d+)", usage).groups())
    ir = kernel.asm["ttgir"]
    loop = ir[ir.index("scf.for"):]
    smem = kernel.metadata.shared
    return dict(smem=smem, regs=regs, spill_bytes=stack, cp_async=ir.count("async_copy_global_to_local"),
                loop_loads=loop.count("tt.load"), decode_via_smem=loop.count("local_alloc"),
                programs_per_sm=min(SMEM_PER_SM // (smem + 1024), REGS_PER_SM // (regs * 32 * warps)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q8_0,Q4_0,Q4_K,Q6_K")
    ap.add_argument("--sweep", action="store_true", help="every config of bench/qgemm_sweep.py (default: CONFIGS)")
    ap.add_argument("--dump", help="write each kernel's TTGIR and PTX here")
    a = ap.parse_args()
    print(f"triton {triton.__version__}, sm_90")
    for t in a.types.split(","):
        for cfg in SWEEP if a.sweep else [triton_qgemm.CONFIGS[t]]:
            try:
                kernel = compile_for_h100(Q[t], cfg)
            except Exception as e:  # noqa: BLE001 (ptxas out of registers, say)
                print(f"{t} {name(cfg)}: {type(e).__name__} {str(e).splitlines()[0][:100]}")
                continue
            print(f"{t} {name(cfg)}: " + " ".join(f"{k}={v}" for k, v in read(kernel, cfg.warps).items()))
            if a.dump:
                stem = os.path.join(a.dump, f"{t}_{name(cfg).replace(' ', '_')}")
                for ext in ("ttgir", "ptx"):
                    with open(f"{stem}.{ext}", "w") as f:
                        f.write(kernel.asm[ext])


if __name__ == "__main__":
    main()
