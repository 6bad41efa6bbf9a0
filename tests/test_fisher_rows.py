"""The Fisher diagonal on sampled rows (localllm/fisher.py) against the whole diagonal as plan_mixed
computed it before (one torch.autograd.grad over every matrix at once, every gradient squared whole):
the kept rows are the same sums bit for bit, on a Llama, a fused-q|k|v Phi model and two mixture-of-
experts models (expert stacks (E, F, C) as E * F rows), and plan_mixed's predicted losses of every
candidate type are those of the whole-diagonal computation bit for bit (so the plans cannot change).
"""

from __future__ import annotations

import pytest
import torch

import tiny_models as tm
from tiny_gguf import write_gguf
from localllm import mixed
from localllm.commands.quantize_cmd import read_source
from localllm.fisher import fisher_rows, layerwise_cache
from localllm.fused import fused_parts
from localllm.load import load_model
from localllm.quantize.plan import sample_rows

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: small passes run faster on one thread

CHUNKS = torch.randint(3, 250, (2, 12), generator=torch.Generator().manual_seed(7)).tolist()
SPECS = {"llama": tm.CASES["llama"], "phi3": tm.PHI_CASES["phi3"], "phi4mini": tm.PHI_CASES["phi4mini"],
         "mixtral": tm.MOE_CASES["mixtral"], "qwen3_moe": tm.MOE_CASES["qwen3_moe"]}


def whole_fisher(model, chunks, seed: int = 0) -> dict[str, torch.Tensor]:
    """plan_mixed's Fisher as it was (369c8be mixed.fisher_diagonal), kept as the oracle: every matrix's
    gradient from one torch.autograd.grad call, squared whole, averaged over chunks."""
    params = {n: p for n, p in model.named_parameters() if p.dim() in (2, 3)}
    fisher = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in params.items()}
    device = next(iter(params.values())).device  # labels drawn on the model's device, as fisher_rows draws them
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.enable_grad():
        for p in params.values():
            p.requires_grad_(True)
        try:
            for ids in chunks:
                logp = model(torch.tensor([ids], device=device), layerwise_cache(model, len(ids)), 0)[0].log_softmax(-1)
                y = torch.multinomial(logp.detach().exp(), 1, generator=gen)
                grads = torch.autograd.grad(logp.gather(1, y).sum(), list(params.values()))
                for n, g in zip(params, grads):
                    fisher[n] += g.float().pow(2) / len(chunks)
        finally:
            for p in params.values():
                p.requires_grad_(False)
    return fisher


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """case -> (the F32 GGUF, the model loaded as the quantize command loads it: dense float32)."""
    root, made = tmp_path_factory.mktemp("fisher_rows"), {}

    def get(case: str):
        if case not in made:
            path = write_gguf(SPECS[case], root / f"{case}.gguf")
            made[case] = path, load_model(str(path), "cpu", torch.float32, keep_quantized=False)
        return made[case]
    return get


@pytest.mark.parametrize("case", list(SPECS))
def test_sampled_rows_equal_whole_fisher_rows(models, case):
    """Every file tensor's sampled rows (a fused tensor's: rows of the concatenation of its parts), as
    plan_mixed asks for them, against the same rows of the whole diagonal: torch.equal."""
    path, lm = models(case)
    params = dict(lm.model.named_parameters())
    todo, _ = mixed.chosen_and_fixed([t.info for t in read_source(path, None).tensors], None)
    sampled = [mixed.sampled_parts(params, [mixed._module_name(params, n) for n in fused_parts(lm.config, t.name)],
                                   t.shape[-1]) for t in todo]
    if case.startswith("phi"):
        assert any(len(parts) > 1 for _, _, parts in sampled)  # the fused q|k|v and gate|up are in it
    wanted = mixed.fisher_wanted(part for _, _, parts in sampled for part in parts)
    got = fisher_rows(lm.model, CHUNKS, wanted)
    want = whole_fisher(lm.model, CHUNKS)
    stacks = 0
    for t, (n_rows, rows, parts) in zip(todo, sampled):
        cols = t.shape[-1]
        whole = torch.cat([want[n].reshape(-1, cols) for n, _ in parts])  # the file tensor's rows
        assert whole.shape[0] == n_rows
        ours = torch.cat([got[n][torch.searchsorted(wanted[n], r)] for n, r in parts])
        assert torch.equal(ours, whole[rows]), t.name
        assert ours.sum() > 0, t.name
        stacks += params[parts[0][0]].dim() == 3
    assert stacks == (3 * SPECS[case].n_layers if case in ("mixtral", "qwen3_moe") else 0)
    assert all(not params[n].requires_grad and params[n].grad is None for n in wanted)  # handed back as they were


def test_some_matrices_only(models):
    """Asking for a few matrices (the others need no gradient, so backward skips them) changes none of
    their sums; rows in any order, repeated; the whole of one matrix (None)."""
    _, lm = models("llama")
    want = whole_fisher(lm.model, CHUNKS, seed=3)
    rows = {"blk.1.ffn_down.weight": torch.tensor([5, 0, 5, 63]), "blk.0.attn.attn_q.weight": None,
            "output.weight": sample_rows(lm.model.output.weight.shape[0], 8)}
    got = fisher_rows(lm.model, CHUNKS, rows, seed=3)
    assert list(got) == list(rows)
    for n, r in rows.items():
        assert torch.equal(got[n], want[n] if r is None else want[n][r]), n


@pytest.mark.parametrize("case", ["phi3", "qwen3_moe"])  # fused parts; expert stacks
def test_plan_losses_equal_whole_fisher_losses(models, case, monkeypatch):
    """plan_mixed's options (type, bytes, predicted loss) for every tensor are those that the whole
    diagonal gives through sampled_losses on the whole (concatenated) weight, as before: float ==."""
    path, lm = models(case)
    infos = [t.info for t in read_source(path, None).tensors]
    seen = []
    real = mixed.allocate
    monkeypatch.setattr(mixed, "allocate", lambda options, budget: seen.append(options) or real(options, budget))
    n_values = sum(t.shape[0] * (t.shape[1] if len(t.shape) > 1 else 1) * (t.shape[2] if len(t.shape) > 2 else 1)
                   for t in infos)
    plan = mixed.plan_mixed(lm, infos, int(5.0 * n_values / 8), CHUNKS)
    todo, _ = mixed.chosen_and_fixed(infos, None)
    fisher = whole_fisher(lm.model, CHUNKS)
    params = dict(lm.model.named_parameters())
    for t, options in zip(todo, seen[0], strict=True):
        names = [mixed._module_name(params, n) for n in fused_parts(lm.config, t.name)]
        w = torch.cat([params[n].data.reshape(-1, t.shape[-1]) for n in names])
        f = torch.cat([fisher[n].reshape(-1, t.shape[-1]) for n in names])
        want = mixed.sampled_losses(w, f, plan.imatrix.get(t.name), mixed.candidates(t.shape[-1]))
        assert {o.qtype: o.loss for o in options} == want, t.name


def test_fisher_wanted_joins_a_parameters_rows():
    """A parameter behind two file tensors (token_embd read as a tied output.weight) keeps the union."""
    got = mixed.fisher_wanted([("a", torch.tensor([4, 0])), ("b", torch.tensor([2])), ("a", torch.tensor([0, 9]))])
    assert {n: r.tolist() for n, r in got.items()} == {"a": [0, 4, 9], "b": [2]}
