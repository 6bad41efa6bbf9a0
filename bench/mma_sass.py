"""kernels/triton_mma.py compiled for Hopper (sm_90a) on a machine without a GPU: whether a config
compiles, ptxas's registers and spills, and the instruction mix of each loop of the SASS (Triton
bundles ptxas and cuobjdump). How the tensor-core products were diagnosed without a device: the
first version's loop converted each block sum with I2F and ran a part's int64 conversions every
step (docs/PERFORMANCE.md, h25-mma).

    PYTHONPATH=. python bench/mma_sass.py Q4_K 64,64,8,2,1,0 [--sass FILE]

The config is a triton_mma.CONFIGS entry without its programs per SM (a runtime value); the
arguments are specialised as the 8B shapes' launches are (16-byte aligned pointers, sizes and
strides multiples of 16, 1-element fields' row stride 1, whole tiles, an int64 accumulator with
the residual, bf16 rounding).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
from pathlib import Path

import gguf
import torch
import triton
from mma_sweep import random_weight
from triton import knobs
from triton.backends.compiler import GPUTarget

from localllm.kernels import triton_mma

Q = gguf.GGMLQuantizationType
TYPES = {torch.uint8: "*u8", torch.int8: "*i8", torch.float16: "*fp16", torch.float32: "*fp32", torch.int64: "*i64"}
BK = {Q.Q8_0: 2, Q.Q4_0: 2, Q.Q4_K: 2, Q.Q6_K: 1}  # triton_q8.CONFIGS' units a step on CUDA


def source(qtype, bm: int, bn: int, stages: int, trans: int):
    """The kernel's ASTSource for a config, specialised as the decode step launches it."""
    fn = triton_mma._mma_kernel
    names = fn.arg_names
    ps, _, rs = triton_mma.field_args(random_weight(qtype, 64, 256, "cpu"))
    sig = {"xq_ptr": "*i8", "xd_ptr": "*fp32", "xs2_ptr": "*i64", "xd2_ptr": "*i64", "out_ptr": "*i64",
           "bias_ptr": "*i64", "res_ptr": "*i64", "act_ptr": "*bf16"}
    sig.update({f"P{i}": TYPES[p.dtype] for i, p in enumerate(ps)})
    sig.update({f"U{i}": "i32" for i in range(5)})
    sig.update({f"R{i}": "i32" for i in range(5)})
    sig.update({k: "i32" for k in ("M", "N", "K", "out_stride", "per_split", "split", "parts")})
    aligned = [k for k in sig if k.endswith("_ptr") or k[0] in "PU" or k in ("K", "out_stride")]
    const = {f"R{i}": 1 for i, r in enumerate(rs) if r == 1}
    aligned += [f"R{i}" for i, r in enumerate(rs) if r != 1]
    const.update(FMT=triton_mma.MMA_FMT[qtype], UNIT=triton_mma.UNIT[qtype], BM=bm, BN=bn, BK=BK[qtype],
                 TRANS=bool(trans), EVEN=True, HAS_BIAS=False, HAS_RES=True, ROUND=True, STAGES=stages, ASM=True)
    sig.update({k: "constexpr" for k in const})
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in aligned if k not in const}
    return triton.compiler.ASTSource(fn=fn, signature={k: sig[k] for k in names}, constexprs=const, attrs=attrs)


def loops(sass: str) -> list[tuple[int, collections.Counter]]:
    """Each backward branch's span of the SASS listing -> (instructions, opcode counts), innermost first."""
    ins = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]+);", sass)]
    spans = []
    for i, text in enumerate(ins):
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) // 16 < i:
            a = int(m.group(1), 16) // 16
            ops = (re.sub(r"^@!?U?P[T0-9]+\s+", "", t).split()[0].split(".")[0] for t in ins[a:i])
            spans.append((i - a, collections.Counter(ops)))
    return sorted(spans, key=lambda s: s[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("type", choices=[t.name for t in triton_mma.MMA_TYPES])
    ap.add_argument("config", help="BM,BN,warps,stages,TRANS,registers (0: ptxas's choice)")
    ap.add_argument("--sass", type=Path, help="write the SASS listing here")
    args = ap.parse_args()
    bm, bn, warps, stages, trans, regs = (int(v) for v in args.config.split(","))
    qtype = Q[args.type]
    knobs.nvidia.dump_ptxas_log = True  # registers and spills
    target = GPUTarget("cuda", 90, 32)
    opts = triton.compiler.make_backend(target).parse_options(
        {"num_warps": warps, "num_stages": stages, **({"maxnreg": regs} if regs else {})})
    kernel = triton.compile(source(qtype, bm, bn, stages, trans), target=target, options=opts.__dict__)
    print(f"shared memory {kernel.metadata.shared} bytes")
    cubin = Path(f"/tmp/mma_{args.type}_{args.config.replace(',', '_')}.cubin")
    cubin.write_bytes(kernel.asm["cubin"])
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    sass = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    if args.sass:
        args.sass.write_text(sass)
    for n, ops in loops(sass):
        print(f"loop of {n} instructions: " + " ".join(f"{op} {c}" for op, c in ops.most_common(16)))


if __name__ == "__main__":
    main()
