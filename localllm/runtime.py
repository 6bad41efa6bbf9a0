"""One opened model on one backend: the weights in the backend's layout and the steps run on them.

`load.load_model` picks the backend once (backends.runtime_class) and returns its Runtime; generation,
speculative decoding, benchmarks and evaluation call only these methods, never ask for the device.

Runtime itself is the portable torch backend: the reference forward of model.py with TORCH_OPS, which
MPS runs (tests/test_portable_ops.py checks its op list) and which the CPU runs where its C++ decoder
does not apply. Backends subclass it and override the steps they run faster (backends/cpu.py,
backends/cuda.py); each override computes what the portable step computes (their tests compare them).

Shapes: B sequences of the cache, T tokens per step, V vocabulary; logits are fp32.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .cache import KVCache, make_cache
from .model import TORCH_OPS, Ops, Transformer
from .settings import DEFAULT_SERVE
from . import slots as slot_steps
from .slots import Slots


class Runtime:
    ops: Ops = TORCH_OPS  # the model's ops on this backend (load builds the Transformer with them)
    # How a GGUF file's quantized tensors are kept (load.place_quantized): "blocks" = the file's blocks
    # (BlockQWeight; rows decoded by torch, by C++ kernels on the CPU), "qweight" = QWeight for the
    # Triton kernels, "dense" = decoded to float.
    quantized: str = "blocks"
    # dtype of the dense tensors beside "blocks" weights (None: the dtype asked for)
    blocks_dtype: torch.dtype | None = None
    # With "blocks": F32/F16/BF16 linear weights and embeddings (GGUF files' and safetensors folders') kept
    # as rows of their stored type too (BlockQWeight), for products that read them as they are (the CPU's).
    dense_blocks: bool = False
    # Prompts cost in proportion to their ids even when several share a pass (compute-bound products):
    # `serve` then prefills fewer ids per engine step (settings.ServeSettings.prefill_tokens_compute_bound).
    prompts_compute_bound: bool = False
    # warm_up_slots prepares something (CUDA: graphs, kernel compilation): `serve` says so while it runs
    warms_up: bool = False
    # A process's first tokens wait for kernel compilations and graph captures (CUDA: seconds on a fresh
    # machine): `complete` and `chat` show a spinner over that wait (commands/cli_output.first_tokens_shown)
    first_tokens_compile: bool = False
    # decode_slots returns before its step has run (CUDA: a graph replay on the stream): serve's engine
    # then launches the next step before handing out a step's events (engine.py, "running ahead")
    steps_async: bool = False

    def __init__(self, model: Transformer):
        self.model = model
        self.cfg = model.cfg
        emb = model.token_embd.weight
        self.device: torch.device = emb.device
        self.dtype: torch.dtype = emb.dtype  # activations and KV cache

    @staticmethod
    def prepare(model: Transformer) -> None:
        """Once at load, after the weights are assigned: a backend's re-layout (CUDA fuses q|k|v and
        gate/up). Nothing for the portable backend."""

    def release(self, slots: Sequence[Slots] = ()) -> None:
        """Drop what the runtime captured for its calls (CUDA graphs: its own, and those kept in the
        tables of these slots), before a tensor-parallel process closes its process group: NCCL's
        communicator teardown waits for every graph that captured one of its collectives to be
        destroyed (pytorch/pytorch#115388): with the graphs alive, the process never exits. Later calls
        capture again."""
        for s in slots:
            s.tables.clear()

    @staticmethod
    def block_weight(blocks: torch.Tensor, qtype, dtype: torch.dtype):
        """A "blocks" tensor (raw GGUF blocks (N, row bytes) on the device) as the BlockQWeight this
        backend's products read."""
        from .kernels.cpu import BlockQWeight

        return BlockQWeight.from_blocks(blocks, qtype, dtype)

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        return make_cache(self.cfg, capacity, batch, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache, start: int, last_only: bool = False) -> torch.Tensor:
        """tokens (B, T) at positions [start, start + T) -> logits (B, T, V) ((B, 1, V) with last_only)."""
        return self.model(tokens, cache, start, last_only)

    def prefill(self, cache: KVCache, rows: list[list[int]], start: int = 0) -> torch.Tensor:
        """One prompt per sequence of the cache (equal lengths) at positions [start, start + len) in one
        pass -> logits of each last position (B, V)."""
        tokens = torch.tensor(rows, dtype=torch.long, device=self.device)
        return self.forward(tokens, cache, start, last_only=True)[:, -1]

    def decode(self, cache: KVCache, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B,): one id per sequence, all at position cache.length -> logits (B, V). The returned
        tensor may be a buffer the next step overwrites."""
        b = tokens.numel()
        return self.forward(tokens.view(b, 1), cache, cache.length)[:, -1]

    def greedy_step(self, cache: KVCache, tokens: torch.Tensor) -> torch.Tensor:
        """decode(), then each row's argmax -> ids (B,) (a backend may return its own input buffer,
        overwritten by the next step: pass it back as is)."""
        return self.decode(cache, tokens).argmax(-1)

    def verify(self, cache: KVCache, ids: list[int]) -> torch.Tensor:
        """Batch 1: T ids at positions cache.length.. in one pass -> logits (T, V) (speculative decoding's
        check of the drafts; each row as plain decoding would compute it, up to rounding here)."""
        tokens = torch.tensor([ids], dtype=torch.long, device=self.device)
        return self.forward(tokens, cache, cache.length)[0]

    def most_drafts(self, cache: KVCache) -> int | None:
        """The most drafts one verify pass takes (None: no limit)."""
        return None

    def warm_verify(self, cache: KVCache) -> None:
        """Prepare now whatever verify passes of every size would prepare on first use (CUDA graphs)."""

    # ---- many sequences, each at its own position (slots.py; `serve`'s continuous batching)

    def new_slots(self, n: int, capacity: int) -> Slots:
        """n empty slots of capacity positions each, in one cache of batch n."""
        return slot_steps.new_slots(self.new_cache(capacity, n))

    def prefill_slot(self, slots: Slots, slot: int, ids: list[int], start: int) -> torch.Tensor:
        """ids at positions [start, start + len(ids)) of one slot (its rows [0, start) kept: a prefix
        already there) -> logits (V,) fp32 of the last id; writes that slot's rows only; its length is
        then start + len(ids)."""
        slot_steps.check_prefill(slots, slot, ids, start)
        logits = self.prefill(slot_steps.slot_view(slots.cache, slot, start), [ids], start)[0]
        slots.lengths[slot] = start + len(ids)
        return logits.float()

    def prefill_slots(self, slots: Slots, which: list[int], prompts: list[list[int]],
                      starts: list[int]) -> torch.Tensor:
        """prefill_slot for several slots in one forward: prompts[i] at positions [starts[i], starts[i] +
        len) of slot which[i] (distinct, any order; ragged lengths) -> logits (N, V) fp32 of each
        prompt's last id, each as prefill_slot alone computes it (up to the products' rounding for
        another row count: slots.prefill_slots); lengths[s] = start + len."""
        return slot_steps.prefill_slots(self.model, slots, which, prompts, starts)

    def decode_slots(self, slots: Slots, which: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """tokens (N,) long, one per slot of `which` (distinct, any order), each at its slot's position
        lengths[s] -> logits (N, V) fp32, each row the same bits whatever the other rows; then
        lengths[s] += 1 for each. One batched forward (slots.decode_slots)."""
        return slot_steps.decode_slots(self.model, slots, which, tokens)

    def verify_slots(self, slots: Slots, which: list[int], rows: list[list[int]]) -> torch.Tensor:
        """rows[i] (one or more ids) at positions lengths[s].. of slot s = which[i] (distinct) in one
        batched pass -> logits (sum(len), V) fp32, the slots' rows in the order of `which`; lengths[s] +=
        len(rows[i]) (`serve`'s speculative decoding: each slot's last id and drafts; slots.verify_slots)."""
        return slot_steps.verify_slots(self.model, slots, which, rows)

    def warm_up_slots(self, slots: Slots, prefill_tokens: int = DEFAULT_SERVE.prefill_tokens) -> int:
        """Prepare now what the slots' first steps and prompts (passes of up to prefill_tokens ids) would
        prepare on first use (`serve`'s start-up, before it listens), every slot left empty -> the graphs
        captured. Portable backend: nothing to prepare."""
        return 0

    def copy_prefix(self, slots: Slots, src: int, dst: int, n: int) -> None:
        """Rows [0, n) of slot src into slot dst; dst then holds n positions."""
        slot_steps.copy_prefix(slots, src, dst, n)

    def sync(self) -> None:
        """Wait until the device has finished the work queued so far (for timing)."""
