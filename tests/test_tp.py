"""Tensor parallelism (issue 23): the sharding arithmetic (pure functions), each rank's shard as read
from GGUF files and safetensors folders (equal to the slices of the whole model's tensors: the oracle is
the TP=1 reader), and TP=2 forwards (2 processes, gloo on the CPU) against TP=1 on the same file: logits
within fp32 rounding of the sums' order, and the same 16 greedy ids."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import tiny_models as tm
from tiny_gguf import gguf_tensors, write_gguf
from tiny_hf import hf_config, write_hf_folder
from tiny_raw import random_tensor_data
from tiny_spec import TinySpec
from tp_worker import slot_logits
from localllm.backends.cpu import CpuEagerRuntime, CpuRuntime
from localllm.errors import LocalLLMError
from localllm.gguf_file import open_gguf
from localllm.load import load_model
from localllm.parallel import TensorParallel
from localllm.tp_load import gguf_shard, hf_shard
from localllm.tp_shard import (COLS, RANK0, ROWS, WHOLE, byte_range, check_supported, local_config, shard_tensor,
                               split_of, vocab_part)
from localllm.validate import check_gguf, check_hf_folder
from localllm.weights import QuantizedTensor, gguf_state_dict, hf_state_dict
from ports import free_port

Q = gguf.GGMLQuantizationType
WORKER = Path(__file__).with_name("tp_worker.py")
PROMPT, STEPS = [1, 40, 41, 42, 100, 7, 300, 5], 16

# (name, spec, GGUF type or "hf"): llama's permuted q/k (F32), qwen3's q/k norms (Q8_0), a K-quant whose
# column parts are whole 256-value super-blocks (q_dim 512, ffn 512: 256 per rank), qwen2's biases (safetensors)
MODELS = [
    ("llama-f32", TinySpec("llama", seed=1), Q.F32),
    ("qwen3-q8_0", TinySpec("qwen3", seed=2), Q.Q8_0),
    ("llama-q4_k", TinySpec("llama", dim=256, ffn_dim=512, n_heads=8, n_kv_heads=2, head_dim=64, seed=3), Q.Q4_K),
    ("qwen2-hf", TinySpec("qwen2", seed=4), "hf"),
    # beyond the Llama layer: Gemma 2's post norms, soft-caps, sliding window and tied head; Phi-3's fused
    # q|k|v and gate|up (split, then cut) with LongRoPE; SmolLM3's NoPE layers, tied, permuted q/k (Q8_0)
    ("gemma2-f32", tm.FAMILY_CASES["gemma2"], Q.F32),
    ("phi3-hf", tm.PHI_CASES["phi3"], "hf"),
    ("smollm3-q8_0", tm.PHI_CASES["smollm3"], Q.Q8_0),
]
# shapes that do not split at TP=2: one kv head; Q8_0 ffn_down columns of 48 per rank (blocks of 32)
BAD = [("one-kv-head", TinySpec("llama", n_kv_heads=1, seed=5), Q.F32, "n_kv_heads (1) does not split into 2"),
       ("q8-ffn-96", TinySpec("llama", ffn_dim=96, seed=6), Q.Q8_0, "not on a 32-value block boundary")]


def write_model(folder: Path, name: str, spec: TinySpec, qtype) -> Path:
    if qtype == "hf":
        return write_hf_folder(spec, folder / name)
    if qtype == Q.Q4_K:  # gguf cannot quantize K-quants: random blocks of small values for every 2-D tensor
        rng = np.random.default_rng(spec.seed)
        raw = {n: (random_tensor_data(Q.Q4_K, *d.shape, rng), Q.Q4_K)
               for n, d in gguf_tensors(spec).items() if d.ndim == 2}
        return write_gguf(spec, folder / f"{name}.gguf", Q.F32, raw=raw)
    return write_gguf(spec, folder / f"{name}.gguf", qtype)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tp_models")
    return {name: write_model(folder, name, spec, q) for name, spec, q in MODELS + [b[:3] for b in BAD]}


def prompt_and_greedy(rt) -> tuple[torch.Tensor, list[int]]:
    """PROMPT's logits (T, V) in one pass, then STEPS greedy ids decoded one at a time."""
    cache = rt.new_cache(len(PROMPT) + STEPS + 1)
    logits = rt.forward(torch.tensor([PROMPT]), cache, 0)[0].clone()
    out, tok = [], logits[-1].argmax()
    for _ in range(STEPS):
        out.append(int(tok))
        tok = rt.decode(cache, tok.view(1)).argmax(-1)[0]
    return logits, out


@pytest.fixture(scope="module")
def tp2(models, tmp_path_factory) -> tuple[Path, list[str]]:
    """Both ranks run every model (one process each, all models in one run: seconds)."""
    out = tmp_path_factory.mktemp("tp_out")
    names = [m[0] for m in MODELS] + [b[0] for b in BAD] + ["synthetic"]
    port, ids = free_port(), ",".join(map(str, PROMPT))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), "2", str(port), "cpu", str(out), ids,
                               str(len(PROMPT)), str(STEPS),
                               *[str(models.get(n, n)) for n in names]], env=env) for r in range(2)]
    for p in procs:
        assert p.wait(timeout=300) == 0
    return out, names


def oracle(path: Path) -> dict:
    """TP=1 on the same file with the same runtime (the CPU's eager one: the torch forward, C++ products)."""
    lm = load_model(str(path), "cpu", backend=CpuEagerRuntime)
    rt = lm.runtime
    logits, out = prompt_and_greedy(rt)
    return {"logits": logits, "greedy": out, "cfg": lm.config, "slots": slot_logits(rt, PROMPT, "cpu")}


# ---- the arithmetic

def test_splits_of_each_weight():
    cfg = replace(tm_config(), n_heads=8, n_kv_heads=4, head_dim=16, ffn_dim=96, vocab_size=10)
    tp = TensorParallel(1, 2)
    assert split_of("blk.0.attn.attn_q.weight", cfg, tp) == split_of("blk.0.attn.attn_q.bias", cfg, tp)
    assert split_of("blk.0.attn.attn_q.weight", cfg, tp).__dict__ == dict(kind=ROWS, start=64, stop=128)
    assert split_of("blk.3.attn.attn_k.weight", cfg, tp).__dict__ == dict(kind=ROWS, start=32, stop=64)
    assert split_of("blk.3.attn.attn_v.bias", cfg, tp).__dict__ == dict(kind=ROWS, start=32, stop=64)
    assert split_of("blk.1.ffn_gate.weight", cfg, tp).__dict__ == dict(kind=ROWS, start=48, stop=96)
    assert split_of("blk.1.ffn_up.weight", cfg, tp).__dict__ == dict(kind=ROWS, start=48, stop=96)
    assert split_of("blk.1.attn.attn_output.weight", cfg, tp).__dict__ == dict(kind=COLS, start=64, stop=128)
    assert split_of("blk.1.attn.attn_output.bias", cfg, tp).kind == RANK0
    assert split_of("blk.1.ffn_down.weight", cfg, tp).__dict__ == dict(kind=COLS, start=48, stop=96)
    assert split_of("token_embd.weight", cfg, tp).__dict__ == dict(kind=ROWS, start=5, stop=10)
    assert split_of("output.weight", cfg, tp).__dict__ == dict(kind=ROWS, start=5, stop=10)
    for name in ("blk.0.attn_norm.weight", "blk.0.attn.attn_q_norm.weight", "output_norm.weight", "rope_freqs"):
        assert split_of(name, cfg, tp).kind == WHOLE


def tm_config():
    from localllm.config_hf import config_from_hf

    return config_from_hf(hf_config(TinySpec("llama")))


def test_vocab_parts_cover_the_vocabulary_uneven():
    # V = 10 over 4 ranks: k = 3, the last rank holds 1 row (its logits padded to 3, then trimmed)
    parts = [vocab_part(10, TensorParallel(r, 4)) for r in range(4)]
    assert parts == [(0, 3, 3), (3, 6, 3), (6, 9, 3), (9, 10, 3)]
    assert [vocab_part(128256, TensorParallel(r, 2))[:2] for r in range(2)] == [(0, 64128), (64128, 128256)]


def test_byte_ranges_are_whole_blocks():
    assert byte_range(Q.Q4_K, 256, 512) == (144, 288)  # 256 values -> 144 bytes per block
    assert byte_range(Q.Q8_0, 32, 64) == (34, 68)
    assert byte_range(Q.F16, 3, 5) == (6, 10)
    with pytest.raises(LocalLLMError, match=r"Q4_K.*256-value block boundary"):
        byte_range(Q.Q4_K, 128, 256, "blk.0.ffn_down.weight")


def test_shard_tensor_cuts_rows_block_columns_and_rank0_bias():
    cfg = replace(tm_config(), n_heads=8, n_kv_heads=2, head_dim=64, ffn_dim=512, dim=256)
    raw = torch.arange(512 * 288, dtype=torch.int32).to(torch.uint8).view(512, 288)  # 2 Q4_K blocks per row
    bias = torch.arange(256.0)
    for r in range(2):
        tp = TensorParallel(r, 2)
        got = shard_tensor("blk.0.attn.attn_output.weight", raw[:256], cfg, tp, Q.Q4_K)  # (C, q_dim) rows
        assert torch.equal(got, raw[:256, 144 * r:144 * (r + 1)])  # one whole 256-value block each
        assert torch.equal(shard_tensor("blk.0.ffn_gate.weight", raw, cfg, tp, Q.Q4_K), raw[256 * r:256 * (r + 1)])
        out_bias = shard_tensor("blk.0.attn.attn_output.bias", bias, cfg, tp)
        assert torch.equal(out_bias, bias if r == 0 else torch.zeros(256))  # added once, by rank 0
    with pytest.raises(LocalLLMError, match="attn_output.weight .Q8_0. splits at column 48"):
        shard_tensor("blk.0.attn.attn_output.weight", raw[:, :102], replace(cfg, head_dim=12), TensorParallel(1, 2),
                     Q.Q8_0)


def test_local_config_and_unsupported():
    cfg = replace(tm_config(), n_heads=8, n_kv_heads=2, head_dim=16, ffn_dim=128)
    local = local_config(cfg, TensorParallel(0, 2))
    assert (local.n_heads, local.n_kv_heads, local.ffn_dim, local.head_dim, local.vocab_size) == \
        (4, 1, 64, 16, cfg.vocab_size)
    with pytest.raises(LocalLLMError, match=r"^--tp 4: the model's n_kv_heads \(2\) does not split into 4"):
        check_supported(cfg, 4)
    with pytest.raises(LocalLLMError, match="^--tp is not supported for mixtral"):
        check_supported(replace(cfg, arch="mixtral", n_experts=4, n_experts_used=2, expert_ffn_dim=64), 2)


# ---- each rank reads only its part (the oracle: the whole model's tensors, as the TP=1 reader gives them)

def raw_or_float(v):
    return v.data if isinstance(v, QuantizedTensor) else v


@pytest.mark.parametrize("name", [m[0] for m in MODELS])
def test_rank_shard_is_the_slice_of_the_whole(models, name):
    path = models[name]
    if path.is_dir():
        cfg, keys = check_hf_folder(path)
        whole = hf_state_dict(path, keys, cfg)
        shards = [hf_shard(path, keys, cfg, TensorParallel(r, 2)) for r in range(2)]
    else:
        f = open_gguf(path)
        cfg = check_gguf(f)
        keep = frozenset({Q.Q8_0, Q.Q4_K})
        whole = gguf_state_dict(f, cfg, keep, keep_embedding=True)
        shards = [gguf_shard(f, cfg, TensorParallel(r, 2), keep, keep_embedding=True) for r in range(2)]
    for r, shard in enumerate(shards):
        tp = TensorParallel(r, 2)
        assert set(shard) == set(whole)
        for key, value in whole.items():
            split, w, part = split_of(key, cfg, tp), raw_or_float(value), raw_or_float(shard[key])
            assert isinstance(shard[key], QuantizedTensor) == isinstance(value, QuantizedTensor), key
            if split.kind == ROWS:
                expect = w[split.start:split.stop]
            elif split.kind == COLS:
                a, b = byte_range(value.qtype, split.start, split.stop) if isinstance(value, QuantizedTensor) \
                    else (split.start, split.stop)
                expect = w[:, a:b]
            else:
                expect = w if (split.kind == WHOLE or r == 0) else torch.zeros_like(w)
            assert part.shape == expect.shape and torch.equal(part, expect), key
        if cfg.arch == "llama":  # the shard is half of the whole's bytes, replicated norms aside
            assert shard["blk.0.attn.attn_q.weight"].data.shape[0] == cfg.n_heads * cfg.head_dim // 2


# ---- TP=2 forwards against TP=1

@pytest.mark.parametrize("i", range(len(MODELS)))
def test_tp2_logits_and_greedy_ids_equal_tp1(models, tp2, i):
    out, names = tp2
    name = names[i]
    ref = oracle(models[name])
    for r in range(2):
        assert not (out / f"{i}-{r}.err").exists(), (out / f"{i}-{r}.err").read_text()
        got = torch.load(out / f"{i}-{r}.pt")
        assert got["runtime"] == "CpuEagerRuntime"
        assert got["logits"].shape == ref["logits"].shape  # the full vocabulary on every rank
        # fp32 weights: only the sums' order differs. Quantized ones: the C++ integer-dot products quantize
        # the activations to 8-bit blocks, where a last-bit difference can move a value by one step
        scale = ref["logits"].abs().max() * (2e-5 if MODELS[i][2] in (Q.F32, "hf") else 1e-3)
        torch.testing.assert_close(got["logits"], ref["logits"], atol=scale, rtol=0)
        assert got["greedy"] == ref["greedy"]
        torch.testing.assert_close(got["slots"], ref["slots"], atol=scale, rtol=0)  # serve's slot steps
        cfg = ref["cfg"]  # this rank holds its half of the heads, MLP columns and vocabulary rows
        assert got["shapes"]["blk.0.attn.attn_q.weight"] == (cfg.n_heads * cfg.head_dim // 2, cfg.dim)
        assert got["shapes"]["blk.0.attn.attn_k.weight"] == (cfg.n_kv_heads * cfg.head_dim // 2, cfg.dim)
        assert got["shapes"]["blk.0.ffn_down.weight"] == (cfg.dim, cfg.ffn_dim // 2)
        assert got["shapes"]["blk.0.attn.attn_output.weight"] == (cfg.dim, cfg.n_heads * cfg.head_dim // 2)
        assert got["shapes"]["token_embd.weight"] == (cfg.vocab_size // 2, cfg.dim)


@pytest.mark.parametrize("j", range(len(BAD)))
def test_tp2_shapes_that_do_not_split_say_so(tp2, j):
    out, names = tp2
    i = len(MODELS) + j
    for r in range(2):
        assert not (out / f"{i}-{r}.pt").exists()
        msg = (out / f"{i}-{r}.err").read_text()
        assert BAD[j][3] in msg and "\n" not in msg


def test_tp2_synthetic_shard(tp2):
    """bench --synthetic's model at TP=2: each rank makes only its shard (per-rank random weights), and
    both ranks see the same full-vocabulary logits (gathered)."""
    out, names = tp2
    i = names.index("synthetic")
    got = [torch.load(out / f"{i}-{r}.pt") for r in range(2)]
    cfg = tm_config()
    assert got[0]["logits"].shape == (len(PROMPT), cfg.vocab_size)
    assert torch.equal(got[0]["logits"], got[1]["logits"]) and got[0]["greedy"] == got[1]["greedy"]
    assert got[0]["logits"].std() > 0
    for g in got:
        assert g["shapes"]["blk.0.ffn_down.weight"] == (cfg.dim, cfg.ffn_dim // 2)
        assert g["shapes"]["token_embd.weight"] == (cfg.vocab_size // 2, cfg.dim)


# ---- an uneven vocabulary (384 rows over 5 ranks: 77, 77, 77, 77, 76), ranks as threads of this process

class ThreadTP(TensorParallel):
    """A TensorParallel whose collectives join the ranks' threads (a Barrier and shared slots): the
    sharded forward at any N in one process, for tests only."""

    def __init__(self, rank: int, world: int, hub: dict):
        super().__init__(rank, world)
        object.__setattr__(self, "hub", hub)

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        hub = self.hub
        hub["slots"][self.rank] = x.clone()
        hub["barrier"].wait()
        parts = list(hub["slots"])
        hub["barrier"].wait()  # every rank has read before the next exchange writes
        return parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(x)
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        x.copy_(total)
        return x

    def gather_last(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return torch.cat(self._exchange(x), dim=-1)


def test_uneven_vocabulary_five_ranks(tmp_path):
    import threading

    spec = TinySpec("llama", dim=160, n_heads=5, n_kv_heads=5, ffn_dim=320, seed=11)  # Q8_0 parts of 32 columns
    path = write_gguf(spec, tmp_path / "five.gguf", Q.Q8_0)
    ref = oracle(path)
    world = 5
    hub = {"slots": [None] * world, "barrier": threading.Barrier(world)}
    tps = [ThreadTP(r, world, hub) for r in range(world)]
    # CpuRuntime asked for explicitly: its C++ decoder must step aside for a shard (no place for the reduces)
    runtimes = [load_model(str(path), "cpu", tp=tp, backend=CpuRuntime).runtime for tp in tps]
    assert [rt.model.token_embd.weight.shape[0] for rt in runtimes] == [77, 77, 77, 77, 76]
    results = [None] * world

    def rank_main(r: int) -> None:
        results[r] = prompt_and_greedy(runtimes[r])

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for got, greedy in results:
        assert greedy == ref["greedy"]
        assert got.shape == ref["logits"].shape
        torch.testing.assert_close(got, ref["logits"], atol=1e-3 * ref["logits"].abs().max(), rtol=0)
