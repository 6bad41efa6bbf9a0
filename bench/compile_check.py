"""Compile the decode step's Triton kernels for Hopper (sm_90) on a machine without a GPU, to catch
compile errors (and read register counts, spills and shared memory) before spending device time.

    python bench/compile_check.py            # every case below; prints registers / spills / smem

Uses Triton's own compiler with a GPUTarget; nothing runs. The signatures name the argument types
the decode step passes (bf16 activations, bf16 dense weights).
"""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from localllm.kernels import triton_attention, triton_decode, triton_dense, triton_prefill, triton_q8

TARGET = GPUTarget("cuda", 90, 32)


def dense_case(fixed: bool):
    """_dense_kernel's signature and constexprs: bf16 x and weight, into an int64 accumulator (split
    K) or fp32 logits."""
    fn = triton_dense._dense_kernel
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*i64" if fixed else "*fp32", "bias_ptr": "*bf16",
             "res_ptr": "*i64" if fixed else "*fp32", "act_ptr": "*bf16"}
    bn, bk, stages, warps = triton_dense.CONFIG
    const = {"BN": bn, "BK": bk, "STAGES": stages, "SPLIT": 2 if fixed else 1, "GLU": False, "HAS_BIAS": fixed,
             "HAS_RES": False, "ROUND": True, "IEEE": False, "PDL": True}
    return case(fn, types, const, warps)


def case(fn, types: dict, const: dict, warps: int = 4):
    """fn's signature (the named pointer / float types, i32 for the other arguments, the constexprs),
    its constexpr values and warps: compile_one's arguments."""
    sig = {a: types.get(a, "i32") for a in fn.arg_names}
    sig.update({a: "constexpr" for a in const})
    return fn, sig, const, warps


def compile_one(name: str, fn, sig: dict, const: dict, warps: int, odd: tuple[str, ...] = ("M",)) -> None:
    """Compiles as the launcher specialises at real shapes: pointers and every integer argument except
    `odd` (and eps) divisible by 16 (without this Triton cannot prove 16-byte alignment and does not
    pipeline the loads). Prints shared memory and how many async copies / wgmma the kernel has."""
    idx = {a: (fn.arg_names.index(a),) for a in fn.arg_names}
    div = [a for a in fn.arg_names if a not in const and a not in odd and sig[a] != "fp32"]
    src = ASTSource(fn, sig, constexprs={idx[k]: v for k, v in const.items()},
                    attrs={idx[a]: [["tt.divisibility", 16]] for a in div})
    k = triton.compile(src, target=TARGET, options={"num_warps": warps, "launch_pdl": True})
    ptx = k.asm["ptx"]
    print(f"{name}: shared {k.metadata.shared} B; ptx: cp.async {ptx.count('cp.async.cg')}, "
          f"ld.global {ptx.count('ld.global')}, wgmma {ptx.count('wgmma.mma_async')}, bar.sync {ptx.count('bar.sync')}")


def main() -> None:
    for fixed in (True, False):
        compile_one(f"dense fixed={fixed}", *dense_case(fixed))
    compile_one("glu_rows", *case(triton_decode._glu_rows_kernel, {"acc_ptr": "*i64", "out_ptr": "*bf16"},
                                         {"BLOCK": 1024, "PDL": True}))
    compile_one("greedy_ids", *case(triton_decode._greedy_kernel, {"logits_ptr": "*fp32", "out_ptr": "*i64",
                                                                  "best_ptr": "*i64", "cnt_ptr": "*i32",
                                                                  "pos_ptr": "*i32"},
                                    {"BLOCK": triton_decode.ARGMAX_BLOCK, "PDL": True}, 8), odd=("V", "advance"))
    compile_one("rope_store", *case(
        triton_attention._rope_store_kernel, {"qkv_ptr": "*i64", "q_ptr": "*fp32", "k_ptr": "*bf16", "v_ptr": "*bf16",
                                           "pos_ptr": "*i32", "inv_freq_ptr": "*fp32"},
        {"D": 128, "CLEAR": True, "PDL": True}, 1), odd=("T", "H", "HKV"))
    for rope, one in ((False, True), (True, True), (True, False)):
        compile_one(f"attention partial (GQA) rope={rope} one={one}", *case(
            triton_attention._attn_partial_gqa_kernel,
            {"q_ptr": "*i64" if rope else "*fp32", "k_ptr": "*bf16", "v_ptr": "*bf16", "ws_ptr": "*fp32",
             "pos_ptr": "*i32", "inv_freq_ptr": "*fp32", "scale": "fp32"},
            {"GROUP": 4, "GP": 16, "D": 128, "BLOCK_S": 64, "CHUNK": 64, "IEEE": False, "ROPE": rope, "ONE": one,
             "PDL": True}),
            odd=("T", "NSPLIT"))
    compile_one("rmsnorm_rows int64", *case(triton_prefill._rmsnorm_rows_kernel,
                                                   {"x_ptr": "*i64", "w_ptr": "*bf16", "out_ptr": "*bf16",
                                                    "eps": "fp32"}, {"BLOCK": 4096, "PDL": True}, 16))
    compile_one("quant_act int64 norm", *case(
        triton_q8._quant_act_kernel, {"x_ptr": "*i64", "nw_ptr": "*bf16", "act_ptr": "*fp32", "q_ptr": "*i8",
                                      "d_ptr": "*fp32", "s_ptr": "*i32", "eps": "fp32"},
        {"NORM": True, "GLU": False, "BLOCKS": 128, "RSTD_BLOCK": 4096, "WHOLE": True, "PDL": True}, 8))

    for fmt, chain in ((0, 0), (1, 0), (2, 1), (3, 2)):
        compile_one(f"q8 product fmt {fmt} chain {chain}", *q8_case(fmt, chain), odd=("M", "step"))


def q8_case(fmt: int, chain: int):
    """_q8_gemv_kernel (weight format fmt: triton_q8.FMT) into an int64 accumulator, K split."""
    types = {"xq_ptr": "*i32", "xd_ptr": "*fp32", "xs_ptr": "*i32", "out_ptr": "*i64", "bias_ptr": "*i64",
             "res_ptr": "*i64", "act_ptr": "*bf16", "ws_ptr": "*i64", "cnt_ptr": "*i32", "P0": "*i32",
             "P1": "*fp16", "P2": "*fp16" if fmt == 2 else "*i32", "P3": "*u8" if fmt == 2 else "*i8",
             "P4": "*u8"}
    qtype = list(triton_q8.FMT)[fmt]
    bn, bk, warps = triton_q8.CONFIGS[qtype]
    const = {"FMT": fmt, "UNIT": (32, 32, 64, 128)[fmt], "BN": bn, "BK": bk, "GLU": False, "HAS_BIAS": False,
             "HAS_RES": False, "ROUND": True, "SPLIT": 4, "ROWS": 1, "ASM": True, "EVEN": True, "CHAIN": chain,
             "PRELOAD": triton_q8.PRELOAD[qtype], "PDL": True}
    return case(triton_q8._q8_gemv_kernel, types, const, warps)


if __name__ == "__main__":
    main()
