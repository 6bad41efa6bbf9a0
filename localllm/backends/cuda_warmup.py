"""`serve`'s prompt warm-up on CUDA (issue 22; CudaRuntime.warm_up_slots): before the server listens,
one pass of every kernel variant a request's prompt can reach, so that no request waits for a Triton
compilation (the decode graphs: backends/cuda_slots.warm_up).

Triton compiles a kernel once per specialization (triton/runtime/jit.py): its constexpr values and
argument dtypes, and for each int argument whether it is 1 (then a constant) or a multiple of 16, for
each pointer whether it is 16-byte aligned. What a request's shape changes, by path (T: the pass's
rows, start: its first position):
  prefill_slot (one prompt: the forward with CUDA_OPS, eager: a slot view is a new cache each call;
    CudaRuntime replays backends/cuda_prompt.py's graphs instead where a bucket takes the prompt):
    products (kernels/linear.qlinear) of T rows: T <= GEMV_MAX_ROWS the integer-dot / gemv kernels with
      ROWS = T (triton_epilogue.rows_per_program), one variant per T; more rows a Triton dequantize
      (per weight, whatever T) and cuBLAS; the head 1 row (last_only);
    rope_cache (kernels/triton_prefill.py): T and start, each 1 / a multiple of 16 / other;
    silu_mul: T ffn elements, a multiple of 16 or not.
  prefill_slots / verify_slots (several prompts; a draft model catching up; verify passes of each
    slot's last id and drafts: slots.prefill_slots' forward, rope and cache writes by torch):
    products of T rows as above, the head of one row a prompt (verify: every row), silu_mul.
  both: a mixture of experts' MLP (backends/cuda_moe_prefill.py) by its T k slots over E experts: the
    decode kernels up to GEMV_SLOTS_PER_EXPERT E slots, past that the grouped GEMM of tile BM =
    triton_moe_gemm.block_m (moe_rows).
The largest pass of each path (prefill_tokens rows, or what the context holds) is also their matmul
products' pass; it loads its cuBLAS and attention kernels and allocates its activations before a request.
tests/test_cuda_warmup.py checks that these tables cover every class above (from the dispatch's own
constants); tests/gpu/test_gpu_warmup_compiles.py that requests then compile nothing.
"""

from __future__ import annotations

from localllm.config import ModelConfig
from localllm.kernels.triton_moe_gemm import block_m

from ..runtime import Runtime
from ..slots import Slots
from .cuda_moe_prefill import GEMV_SLOTS_PER_EXPERT

# prefill_slot into slot 0, in order: (start, ids, why); each start <= the slot's length by then. The
# fewest ids and positions of each class (start 2, T 2: "other"), so that an entry is skipped (start + ids
# >= the context) only where no request reaches its classes either
ONE_PROMPT = (
    (0, 1, "ROWS 1 (M == 1); rope T 1, start 0 (a multiple of 16)"),
    (1, 1, "rope T 1, start 1: a prompt sharing only its first id (BOS) with the slot's rows"),
    (1, 2, "ROWS 2; rope T other, start 1"),
    (2, 1, "rope T 1, start other: a repeated prompt (all but its last id cached)"),
    (2, 2, "rope T other, start other"),
    (0, 3, "ROWS 3; rope T other, start 0"),
    (0, 4, "ROWS 4 (GEMV_MAX_ROWS; more rows: a matmul, here the largest pass)"),
    (0, 16, "rope T and start multiples of 16; silu_mul T ffn a multiple of 16"),
    (1, 16, "rope T a multiple of 16, start 1"),
    (2, 16, "rope T a multiple of 16, start other (a long prompt's later part)"),
)
# prefill_slots (verify False) / verify_slots (True) from empty slots: (rows, prompts, verify, why); the
# head's rows: one a prompt, every row for verify
SEVERAL = (
    (1, 1, True, "1 row (a draft model catching up by one id): products and head ROWS 1"),
    (2, 2, True, "2 rows: products and head ROWS 2"),
    (3, 2, True, "3 rows: ROWS 3"),
    (4, 2, True, "4 rows: ROWS 4"),
    (5, 2, True, "5 rows, odd: matmul products and head; silu_mul T ffn odd"),
    (16, 2, False, "16 rows: silu_mul T ffn a multiple of 16; head ROWS 2"),
)


def moe_regime(cfg: ModelConfig, rows: int):
    """The MoE prompt path of `rows` token rows (cuda_moe_prefill.moe_prefill): 'few' (the decode
    kernels) or the grouped GEMM's BM."""
    slots = rows * cfg.n_experts_used
    return "few" if slots <= GEMV_SLOTS_PER_EXPERT * cfg.n_experts else block_m(slots, cfg.n_experts)


def moe_rows(cfg: ModelConfig, most: int) -> list[int]:
    """The fewest rows of each MoE path a pass of up to `most` rows takes ([] for a dense MLP)."""
    if not cfg.n_experts:
        return []
    first: dict = {}
    for t in range(1, most + 1):
        first.setdefault(moe_regime(cfg, t), t)
    return sorted(first.values())


def spread(rows: int, n: int, capacity: int) -> list[int]:
    """`rows` ids over as few of n slots as hold them (each at most capacity - 1: check_fits' rule)."""
    per = capacity - 1
    rows = min(rows, n * per)
    return [min(per, rows - i * per) for i in range(-(-rows // per))]


def split(rows: int, prompts: int, n: int, capacity: int) -> list[int] | None:
    """rows ids as `prompts` prompts (at most n, as even as may be), over more slots where one would not
    fit its slot; None where n slots cannot hold them."""
    k = min(prompts, n)
    lengths = [rows // k + (i < rows % k) for i in range(k)]
    if max(lengths) >= capacity:
        lengths = spread(rows, n, capacity)
    return lengths if sum(lengths) == rows else None


def run_several(rt: Runtime, slots: Slots, lengths: list[int], verify: bool) -> None:
    slots.lengths[:] = [0] * slots.n
    which = list(range(len(lengths)))
    prompts = [[1] * t for t in lengths]
    if verify:
        rt.verify_slots(slots, which, prompts)
    else:
        rt.prefill_slots(slots, which, prompts, [0] * len(lengths))


def warm_up_prompts(rt: Runtime, slots: Slots, most: int, one=None) -> None:
    """Run ONE_PROMPT, SEVERAL, the largest passes (most: the engine's prefill_tokens) and moe_rows'
    passes; every slot left empty (the rows written are overwritten by the first prompts). one: the
    one-prompt pass to warm (default rt.prefill_slot; CudaRuntime's eager one, its graphs captured apart)."""
    n, cap = slots.n, slots.capacity
    slots.lengths[:] = [0] * n
    one = one or rt.prefill_slot
    for start, t, _ in ONE_PROMPT:
        if start + t < cap:
            one(slots, 0, [1] * t, start)
    one(slots, 0, [1] * min(most, cap - 1), 0)  # a long prompt's largest part
    for rows, prompts, verify, _ in SEVERAL:
        lengths = split(rows, prompts, n, cap)
        if lengths is not None:
            run_several(rt, slots, lengths, verify)
    for rows in [most, *moe_rows(rt.model.cfg, most)]:  # the largest pass, then each MoE path
        run_several(rt, slots, spread(rows, n, cap), False)
    slots.lengths[:] = [0] * n
