"""A safetensors folder against the GGUF file of the same weights on the CPU (issue 20): pp / tg in tokens
per CPU second, with the prompt's CPU time split into linear products, SDPA and the rest, and into user
and system (page-fault) seconds.

    python bench/folder_vs_file.py FOLDER FILE [-r 3] [-p 256] [-n 64] [--same-process]

bench/hf_folder.py writes FOLDER from FILE's source. Rounds interleave the two (folder, file, then file,
folder, ...); each model runs one warm-up prompt and decode, then 3 timed prompts and 3 timed decodes
(median). Default: each model in its own process per round (python -c of this file's measure());
--same-process: both loaded once in this process, interleaved on the loaded runtimes. -t 1 always:
CPU seconds of one thread are the work done, on a machine other jobs share. Prints every round and the
median of the per-round ratios folder / file.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def _cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def load(path: str):
    from localllm.load import load_model

    torch.set_num_threads(1)
    return load_model(path, "cpu").runtime


def measure(rt, p: int, n: int, reps: int = 3) -> dict:
    """Median pp / tg (tokens per CPU second) of reps runs after one warm-up, and the prompt's split
    (seconds of its median run): linear (kernels.linear.cpu_qlinear), sdpa, rest; user, sys."""
    import localllm.kernels.linear as L

    acc = {"lin": 0.0, "sdpa": 0.0}
    qlinear, sdpa = L.cpu_qlinear, F.scaled_dot_product_attention

    def t_lin(x, w, b=None):
        t = time.process_time()
        y = qlinear(x, w, b)
        acc["lin"] += time.process_time() - t
        return y

    def t_sdpa(*a, **k):
        t = time.process_time()
        y = sdpa(*a, **k)
        acc["sdpa"] += time.process_time() - t
        return y

    prompt = torch.randint(100, rt.cfg.vocab_size - 100, (1, p), generator=torch.Generator().manual_seed(0))
    cache = rt.new_cache(p + n + 8)

    @torch.inference_mode()
    def pp() -> dict:
        acc.update(lin=0.0, sdpa=0.0)
        L.cpu_qlinear, F.scaled_dot_product_attention = t_lin, t_sdpa
        try:
            (u0, s0), t = _cpu(), time.process_time()
            rt.forward(prompt, cache, 0, last_only=True)
            tot, (u1, s1) = time.process_time() - t, _cpu()
        finally:
            L.cpu_qlinear, F.scaled_dot_product_attention = qlinear, sdpa
        return dict(s=tot, lin=acc["lin"], sdpa=acc["sdpa"], rest=tot - acc["lin"] - acc["sdpa"],
                    user=u1 - u0, sys=s1 - s0)

    @torch.inference_mode()
    def tg() -> float:
        token, cache.length = prompt[0, :1], 0
        t = time.process_time()
        for _ in range(n):
            token = rt.decode(cache, token).argmax(-1)
        return time.process_time() - t

    pp(), tg()  # warm-up
    pps = sorted((pp() for _ in range(reps)), key=lambda d: d["s"])
    mid = pps[len(pps) // 2]
    return dict(pp=p / mid["s"], tg=n / statistics.median(tg() for _ in range(reps)), split=mid)


def in_subprocess(path: str, p: int, n: int) -> dict:
    here = Path(__file__).resolve().parent
    code = (f"import sys, json; sys.path.insert(0, {str(here)!r}); import folder_vs_file as b; "
            f"print(json.dumps(b.measure(b.load({path!r}), {p}, {n})))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("file")
    ap.add_argument("-r", "--rounds", type=int, default=3)
    ap.add_argument("-p", "--prompt", type=int, default=256)
    ap.add_argument("-n", "--gen", type=int, default=64)
    ap.add_argument("--same-process", action="store_true")
    a = ap.parse_args()
    rts = {m: load(m) for m in (a.folder, a.file)} if a.same_process else {}
    ratios = {"pp": [], "tg": []}
    for r in range(a.rounds):
        got = {}
        for m in ((a.folder, a.file) if r % 2 == 0 else (a.file, a.folder)):
            got[m] = measure(rts[m], a.prompt, a.gen) if a.same_process else in_subprocess(m, a.prompt, a.gen)
            s = got[m]["split"]
            print(f"round {r + 1} {Path(m).name:>16}: pp{a.prompt} {got[m]['pp']:6.1f} tg{a.gen} {got[m]['tg']:5.1f}"
                  f"  (prompt {s['s']:.3f} s: linear {s['lin']:.3f} sdpa {s['sdpa']:.3f} rest {s['rest']:.3f};"
                  f" user {s['user']:.3f} sys {s['sys']:.3f})", flush=True)
        for k in ratios:
            ratios[k].append(got[a.folder][k] / got[a.file][k])
    for k, v in ratios.items():
        print(f"folder / file {k}: {' '.join(f'{x:.2f}' for x in v)}  median {statistics.median(v):.2f}")


if __name__ == "__main__":
    main()
