"""Small helpers shared by the tests in tests/gpu."""

from __future__ import annotations

import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error |a - b| / |b| (Frobenius norms, fp64, on the CPU)."""
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


def random_ids(vocab_size: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def take_dense_values(ref_model: torch.nn.Module, gpu_model: torch.nn.Module) -> int:
    """Give the CPU fp32 reference the dense values the GPU model holds (bf16: a file's F16 embedding and
    F32 norms are rounded on the GPU), so both sides compute with the same weights and only the
    arithmetic differs. Tensors the GPU keeps quantized or fused have other names or shapes there and
    are left alone (the reference holds their exact fp32 decoding). Returns how many were taken."""
    gpu = gpu_model.state_dict()
    taken = 0
    for name, ref in ref_model.state_dict().items():
        got = gpu.get(name)
        if (got is None or got.is_meta or not got.is_floating_point() or tuple(got.shape) != tuple(ref.shape)
                or name == "rope_freqs"):
            continue
        ref.copy_(got.float().cpu())
        taken += 1
    return taken


def round_inputs_as_int_dot(model: torch.nn.Module) -> torch.nn.Module:
    """A CPU reference of the integer-dot kernels' extra rounding (kernels/triton_q8.py): every linear map
    with K a multiple of 32 (Linear, ExpertLinear; not the fp32 routers) gets its input rounded as
    quantize_act rounds it (int8 per 32 values, quantize/act.py). Its error against the fp32 forward
    is what bf16 plus Q8_0 activations cost on these weights: the bound for quantized GPU runs of tiny
    random models, where that cost alone reaches 0.1-0.4 (Gemma 4's E2B-style case)."""
    from localllm.model import Linear
    from localllm.moe import ExpertLinear
    from localllm.quantize.act import dequantize_act, quantize_act

    def hook(_module, args):
        x = args[0]
        if x.shape[-1] % 32:
            return None
        q, d, _ = quantize_act(x.reshape(-1, x.shape[-1]).float())
        return (dequantize_act(q, d).reshape(x.shape).to(x.dtype), *args[1:])

    for name, m in model.named_modules():
        if isinstance(m, (Linear, ExpertLinear)) and not name.endswith("ffn_gate_inp"):
            m.register_forward_pre_hook(hook)
    return model


def decode_errors(gpu, ref, gpu_cache, ref_cache, ids: list[int]) -> tuple[list[float], int]:
    """One decode step per id on both runtimes -> (each step's relative error of the GPU's logits
    against the reference's, the number of steps whose greedy ids differ)."""
    errs, disagree = [], 0
    for t in ids:
        lg = gpu.decode(gpu_cache, torch.tensor([t], device=gpu.device))[0].float().cpu()
        lc = ref.decode(ref_cache, torch.tensor([t]))[0]
        errs.append(rel(lg, lc))
        disagree += int(lg.argmax() != lc.argmax())
    return errs, disagree


def check_logits(gpu, ref, prompt: int, steps: int, seed: int = 1) -> None:
    """The prompt's logits (rel < 3e-2), then `steps` decode steps (rel < 5e-2, greedy ids differing on
    at most one step) of the GPU runtime against the CPU fp32 reference: test_gpu_logits.py's bounds."""
    ids = random_ids(gpu.cfg.vocab_size, prompt + steps, seed=seed)
    cg, cc = gpu.new_cache(64), ref.new_cache(64)
    lg, lc = gpu.prefill(cg, [ids[:prompt]], 0)[0], ref.prefill(cc, [ids[:prompt]], 0)[0]
    assert rel(lg.float(), lc) < 3e-2
    errs, disagree = decode_errors(gpu, ref, cg, cc, ids[prompt:])
    assert max(errs) < 5e-2, errs
    assert disagree <= 1, f"greedy ids differ on {disagree} of {steps} steps"


def check_greedy_graph_and_verify(gpu, prompt_len: int, steps: int = 24) -> None:
    """greedy_step (graph) == decode + argmax for `steps` steps, and a verify pass of 6 ids == 6 plain
    steps bit for bit."""
    prompt = random_ids(gpu.cfg.vocab_size, prompt_len, seed=5)
    caches = [gpu.new_cache(prompt_len + steps + 8) for _ in range(2)]
    ids, want = (gpu.prefill(c, [prompt], 0).argmax(-1) for c in caches)
    for i in range(steps):
        ids = gpu.greedy_step(caches[0], ids)
        want = gpu.decode(caches[1], want).argmax(-1)
        assert torch.equal(ids, want), f"step {i}"
    cache, six = caches[1], random_ids(gpu.cfg.vocab_size, 6, seed=6)
    depth = cache.length
    rows = gpu.verify(cache, six).clone()
    cache.length = depth
    plain = torch.stack([gpu.decode(cache, torch.tensor([t], device=gpu.device))[0].clone() for t in six])
    assert torch.equal(rows, plain), (rows - plain).abs().max().item()


def check_speculative_equals_plain(rt, prompt: list[int], n: int) -> None:
    """Greedy speculative decoding with prompt lookup (up to 5 drafts a round: verify passes of several
    rows) yields plain greedy decoding's n ids."""
    from localllm.draft import LookupDrafter
    from localllm.generate import generate
    from localllm.sampling import Sampler
    from localllm.settings import DraftSettings, SamplingSettings
    from localllm.speculative import generate_speculative

    greedy = SamplingSettings(temperature=0)
    plain = list(generate(rt, rt.new_cache(len(prompt) + n + 1), prompt, Sampler(greedy, rt.device), n))
    spec = list(generate_speculative(rt, rt.new_cache(len(prompt) + n + 1), prompt, Sampler(greedy, rt.device),
                                     LookupDrafter(3, 0.0), n, settings=DraftSettings(lookup=3, max_draft=5)))
    assert len(plain) == n and spec == plain
