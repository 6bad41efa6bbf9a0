"""The decode step's Triton kernels compiled for Hopper (sm_90) with the argument types and constexprs
the decode step passes (bf16 activations, bf16 dense weights, int64 fixed-point accumulators), checked
to fit the SM's shared memory. Triton's compiler with a GPUTarget: nothing runs, so no GPU is needed,
only Triton's CUDA backend (its ptxas). tests/test_compile_sm90.py runs this module as a script in a
process of its own: the interpreter (TRITON_INTERPRET, which the Triton test modules set) turns the
kernels into interpreted functions that cannot be compiled.

    python tests/compile_sm90.py    -> one JSON line per case: {"case", "error"} (error null: compiled)
"""

from __future__ import annotations

import inspect
import json

SHARED_MAX = 232448  # bytes of shared memory one block may use on sm_90 (227 KiB)


def case(fn, types: dict, const: dict, warps: int = 4, odd: tuple[str, ...] = ("M",)):
    """fn's signature (the named pointer / float types, *i32 for other `*_ptr` arguments, i32 for the
    rest, the constexprs), its constexpr values (const, else the kernel's own defaults: a constexpr added
    to a kernel later, such as the slot rows' ROWS, is compiled as the decode step passes it by default),
    warps and the integer arguments not divisible by 16."""
    params = inspect.signature(fn.fn).parameters
    const = {**{a: p.default for a, p in params.items() if "constexpr" in str(p.annotation)
                and p.default is not inspect.Parameter.empty}, **const}
    missing = [a for a, p in params.items() if "constexpr" in str(p.annotation) and a not in const]
    assert not missing, f"{fn.__name__}: constexprs without a value: {missing}"
    sig = {a: types.get(a, "*i32" if a.endswith("_ptr") else "i32") for a in fn.arg_names}
    sig.update({a: "constexpr" for a in const})
    return fn, sig, const, warps, odd


def compile_sm90(fn, sig: dict, const: dict, warps: int, odd: tuple[str, ...]):
    """Compiles as the launcher specialises at real shapes: pointers and every integer argument except
    `odd` (and floats) divisible by 16 (without this Triton cannot prove 16-byte alignment and does not
    pipeline the loads)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from localllm.kernels.triton_base import FUSION  # (the launches' own option)

    idx = {a: (fn.arg_names.index(a),) for a in fn.arg_names}
    div = [a for a in fn.arg_names if a not in const and a not in odd and sig[a] != "fp32"]
    src = ASTSource(fn, sig, constexprs={idx[k]: v for k, v in const.items()},
                    attrs={idx[a]: [["tt.divisibility", 16]] for a in div})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "launch_pdl": True, **FUSION})


def dense(fixed: bool):
    """_dense_kernel: bf16 x and weight, into an int64 accumulator (split K) or fp32 logits."""
    from localllm.kernels import triton_dense

    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*i64" if fixed else "*fp32", "bias_ptr": "*bf16",
             "res_ptr": "*i64" if fixed else "*fp32", "act_ptr": "*bf16"}
    bn, bk, stages, warps = triton_dense.CONFIG
    const = {"BN": bn, "BK": bk, "STAGES": stages, "SPLIT": 2 if fixed else 1, "GLU": False, "HAS_BIAS": fixed,
             "HAS_RES": False, "ROUND": True, "IEEE": False, "PDL": True}
    return case(triton_dense._dense_kernel, types, const, warps)


def glu_rows():
    from localllm.kernels import triton_decode

    return case(triton_decode._glu_rows_kernel, {"acc_ptr": "*i64", "out_ptr": "*bf16"}, {"BLOCK": 1024, "PDL": True})


def greedy_ids():
    from localllm.kernels import triton_decode

    types = {"logits_ptr": "*fp32", "out_ptr": "*i64", "best_ptr": "*i64", "cnt_ptr": "*i32", "pos_ptr": "*i32"}
    return case(triton_decode._greedy_kernel, types, {"BLOCK": triton_decode.ARGMAX_BLOCK, "PDL": True}, 8,
                odd=("V", "advance"))


def rope_store():
    from localllm.kernels import triton_attention

    types = {"qkv_ptr": "*i64", "q_ptr": "*fp32", "k_ptr": "*bf16", "v_ptr": "*bf16", "pos_ptr": "*i32",
             "inv_freq_ptr": "*fp32"}
    return case(triton_attention._rope_store_kernel, types, {"D": 128, "CLEAR": True, "PDL": True}, 1,
                odd=("T", "H", "HKV"))


def attention(rope: bool, one: bool):
    """The GQA attention partials, rope applied inside (rope) or before, one token or several."""
    from localllm.kernels import triton_attention

    types = {"q_ptr": "*i64" if rope else "*fp32", "k_ptr": "*bf16", "v_ptr": "*bf16", "ws_ptr": "*fp32",
             "pos_ptr": "*i32", "inv_freq_ptr": "*fp32", "scale": "fp32"}
    const = {"GROUP": 4, "GP": 16, "D": 128, "BLOCK_S": 64, "CHUNK": 64, "IEEE": False, "ROPE": rope, "ONE": one,
             "PDL": True}
    return case(triton_attention._attn_partial_gqa_kernel, types, const, odd=("T", "NSPLIT"))


def rmsnorm_rows():
    from localllm.kernels import triton_prefill

    types = {"x_ptr": "*i64", "w_ptr": "*bf16", "out_ptr": "*bf16", "eps": "fp32"}
    return case(triton_prefill._rmsnorm_rows_kernel, types, {"BLOCK": 4096, "PDL": True}, 16)


def quant_act():
    from localllm.kernels import triton_quant_act

    types = {"x_ptr": "*i64", "nw_ptr": "*bf16", "act_ptr": "*fp32", "q_ptr": "*i8", "d_ptr": "*fp32",
             "s_ptr": "*i32", "eps": "fp32"}
    const = {"NORM": True, "GLU": False, "BLOCKS": 128, "RSTD_BLOCK": 4096, "WHOLE": True, "PDL": True}
    return case(triton_quant_act._quant_act_kernel, types, const, 8)


def q8_product(fmt: int, chain: int):
    """_q8_gemv_kernel (weight format fmt: triton_units.FMT) into an int64 accumulator, K split."""
    from localllm.kernels import triton_q8, triton_units

    # the fields' pointer types (weight_args: word fields as int32, the others as stored)
    fields = {2: ("*fp16", "*fp16", "*u8", "*u8"), 4: ("*u8", "*i32", "*i8", "*u8"),
              6: ("*fp16", "*u8", "*u8", "*u8")}.get(fmt, ("*fp16", "*i32", "*i8", "*u8"))
    types = {"xq_ptr": "*i32", "xd_ptr": "*fp32", "xs_ptr": "*i32", "out_ptr": "*i64", "bias_ptr": "*i64",
             "res_ptr": "*i64", "act_ptr": "*bf16", "ws_ptr": "*i64", "cnt_ptr": "*i32", "P0": "*i32",
             **dict(zip(("P1", "P2", "P3", "P4"), fields))}
    qtype = list(triton_units.FMT)[fmt]
    bn, bk, warps = triton_q8.CONFIGS[qtype]
    const = {"FMT": fmt, "UNIT": triton_units.UNIT[qtype], "BN": bn, "BK": bk, "GLU": False, "HAS_BIAS": False,
             "HAS_RES": False, "ROUND": True, "SPLIT": 4, "ROWS": 1, "ASM": True, "EVEN": True, "CHAIN": chain,
             "PRELOAD": triton_q8.PRELOAD[qtype], "PDL": True}
    return case(triton_q8._q8_gemv_kernel, types, const, warps, odd=("M", "step"))


def mma_product(qtype_name: str, rows: int):
    """_mma_kernel (triton_mma: batched decode's int8 tensor-core product) with CONFIGS' entry for `rows`,
    into an int64 accumulator, K split over programs."""
    import torch

    from localllm.kernels import triton_mma, triton_q8
    from localllm.kernels.qweight import Q, QWeight
    from localllm.quantize.formats import FORMATS

    qtype = Q[qtype_name]
    bm, bn, warps, stages, trans, _, _ = triton_mma.config_for(qtype, rows)
    # the fields' pointer types as the launch passes them: a block-major weight's own (gemv_mma's field_args)
    fmt = FORMATS[qtype]
    w = QWeight.from_raw(torch.zeros(64, 256 // fmt.block * fmt.nbytes, dtype=torch.uint8), qtype).to_blocks()
    names = {torch.uint8: "*u8", torch.int8: "*i8", torch.float16: "*fp16", torch.int32: "*i32"}
    types = {"xq_ptr": "*i8", "xd_ptr": "*fp32", "xs2_ptr": "*i64", "xd2_ptr": "*i64", "out_ptr": "*i64",
             "bias_ptr": "*i64", "res_ptr": "*i64", "act_ptr": "*bf16",
             **{f"P{i}": names[p.dtype] for i, p in enumerate(triton_mma.field_args(w)[0])}}
    bk = triton_q8.CONFIGS[qtype][1]  # the dp4a plan's units a step, which gemv_q8 hands gemv_mma
    const = {"FMT": triton_mma.MMA_FMT[qtype], "UNIT": triton_mma.UNIT[qtype], "BM": bm, "BN": bn, "BK": bk,
             "TRANS": bool(trans), "EVEN": True, "HAS_BIAS": False, "HAS_RES": False, "ROUND": True,
             "STAGES": stages, "ASM": True}
    return case(triton_mma._mma_kernel, types, const, warps, odd=("M", "N", "per_split", "split", "parts"))


def reduce_push(ll: bool):
    """_reduce_push_kernel: int64 accumulators, int64 addresses and epochs (the TP decode's all-reduce)."""
    from localllm.kernels import triton_tp

    types = {a: "*i64" for a in ("x_ptr", "acc_ptr", "peers_ptr", "ctr_ptr")}
    const = {"ASSIGN": False, "PUSH": True, "SUM": True, "BLOCK": triton_tp.PUSH_BLOCK, "SLOTS": triton_tp.PUSH_SLOTS,
             "LL": ll, "PDL": True}
    return case(triton_tp._reduce_push_kernel, types, const, 4, odd=("rank", "world", "n", "spins"))


CASES = {
    "dense fixed": lambda: dense(True),
    "dense logits": lambda: dense(False),
    "glu_rows": glu_rows,
    "greedy_ids": greedy_ids,
    "rope_store": rope_store,
    "attention rope=False one=True": lambda: attention(False, True),
    "attention rope=True one=True": lambda: attention(True, True),
    "attention rope=True one=False": lambda: attention(True, False),
    "rmsnorm_rows int64": rmsnorm_rows,
    "quant_act int64 norm": quant_act,
    **{f"q8 product fmt {f} chain {c}": (lambda f=f, c=c: q8_product(f, c)) for f, c in ((0, 0), (1, 0), (2, 1), (3, 2), (4, 0), (5, 0), (6, 1))},
    **{f"reduce_push ll={ll}": (lambda ll=ll: reduce_push(ll)) for ll in (False, True)},
    **{f"mma {t} rows {r}": (lambda t=t, r=r: mma_product(t, r)) for t in ("Q8_0", "Q4_0", "Q4_K", "Q6_K") for r in (16, 64)},
}


def check(name: str) -> str | None:
    """None if case `name` compiles as required, else what went wrong."""
    fn, sig, const, warps, odd = CASES[name]()
    try:
        k = compile_sm90(fn, sig, const, warps, odd)
    except Exception as e:  # noqa: BLE001 -- reported per case
        return f"{type(e).__name__}: {e}"
    if not k.asm["ptx"]:
        return "no PTX"
    if k.metadata.shared > SHARED_MAX:
        return f"{k.metadata.shared} B of shared memory"
    ptx = k.asm["ptx"]
    if name.startswith("dense") and not (ptx.count("wgmma.mma_async") and ptx.count("cp.async")):
        return "the tensor-core product must pipeline its loads (cp.async) and use wgmma"
    if name.startswith("mma") and "mma.sync" not in ptx and "wgmma" not in ptx:
        return "the batched-decode product must use the tensor cores"
    return None


if __name__ == "__main__":
    for case_name in CASES:
        print(json.dumps({"case": case_name, "error": check(case_name)}), flush=True)
