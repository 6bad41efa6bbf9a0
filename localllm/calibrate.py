"""Calibration: the measurements behind `localllm quantize --target-bpw` (quantize/allocate.py).

- `collect_imatrix`: per weight matrix W (out, in) consumed by a linear layer, the importance of each
  input column j, I_j = E[x_j^2] over all calibration tokens (llama.cpp's imatrix); per expert for the
  expert stacks of a mixture of experts, over the tokens routed to it (E, in). For a rounding
  error dW, E||dW x||^2 = tr(dW E[x x^T] dW^T) ~ sum_j I_j ||dW[:, j]||^2 (the diagonal of the input
  covariance, as llama.cpp keeps it): `weighted_error`.
- `measure_sensitivity`: the model's real response to one tensor's error, as the mean KL(base || perturbed)
  of its next-token distributions over every calibration position, one tensor at a time.
- `predict_losses`: the model the allocator uses to extend one measured probe to every candidate type.

Names are GGUF tensor names ("blk.0.attn_q.weight", "output.weight"); weights.to_module_name maps them
onto the model's parameters.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable, Hashable, Iterator, Mapping, Sequence

import torch


from .cache import KVCache, make_cache
from .errors import LocalLLMError
from .model import Linear, Transformer
from .moe import ExpertLinear
from .fused import file_imatrix, file_shapes
from .imatrix_files import ImatrixStats, fit_shapes, read_dat_imatrix, read_gguf_imatrix, write_dat_imatrix, write_gguf_imatrix
from .weights import ROPE_BUFFERS, gguf_name, to_module_name

IMATRIX_FORMAT = "localllm-imatrix"
IMATRIX_VERSION = 1

# progress(stage, done, total), as localllm.progress.stage_progress's report takes it:
# ("imatrix", chunks done, chunks) and ("sensitivity", tensors done, tensors).
Progress = Callable[[str, int, int], None]


# ---- calibration text ----------------------------------------------------------------------------


def calibration_text() -> str:
    """The packaged calibration text (localllm/data/calibration.txt)."""
    return resources.files("localllm").joinpath("data/calibration.txt").read_text(encoding="utf-8")


def calibration_chunks(tokenizer, text: str, ctx: int, max_chunks: int) -> list[list[int]]:
    """Consecutive chunks of exactly ctx token ids; each starts with BOS when tokenizer.add_bos.

    The text is tokenized once, without special-token parsing (as llama.cpp's imatrix), and BOS is
    inserted before each chunk's ctx - 1 text tokens (llama.cpp overwrites the first token instead:
    here no text token is lost). A partial last chunk is dropped."""
    bos = [tokenizer.bos_id] if tokenizer.add_bos else []
    body = ctx - len(bos)
    if body < 1 or max_chunks < 1:
        raise ValueError(f"need ctx > {len(bos)} and max_chunks >= 1, got ctx {ctx}, max_chunks {max_chunks}")
    ids = tokenizer.encode(text, add_bos=False, parse_special=False)
    n = min(len(ids) // body, max_chunks)
    if n == 0:
        raise ValueError(f"calibration text too short: {len(ids)} tokens, one chunk of {ctx} needs {body}")
    return [bos + ids[i * body : (i + 1) * body] for i in range(n)]


# ---- names ---------------------------------------------------------------------------------------


def model_tensors(model: Transformer) -> dict[str, tuple[int, ...]]:
    """GGUF name -> shape (numpy order, (out, in) for matrices) of every weight of the model."""
    out = {gguf_name(n): tuple(p.shape) for n, p in model.named_parameters()}
    for n, m in model.named_modules():  # weights held quantized (CUDA) are no parameters
        if isinstance(m, Linear) and m.qweight is not None:
            out[gguf_name(n) + ".weight"] = tuple(m.qweight.shape)
    return file_shapes(model.cfg, out)  # as the checkpoint holds them (Phi-3's fused q|k|v, gate|up)


def get_weight(model: Transformer, name: str) -> torch.nn.Parameter:
    """The parameter of a GGUF name; weights held quantized (CUDA loads) are no parameters."""
    try:
        return model.get_parameter(to_module_name(name))
    except AttributeError:
        raise ValueError(f"the model has no dense weight {name!r} (quantized weights: load on the CPU)") from None


# ---- the importance matrix -----------------------------------------------------------------------


def _device_cache(model: Transformer, length: int) -> KVCache:
    w = model.token_embd.weight
    return make_cache(model.cfg, length, dtype=w.dtype, device=w.device)


@contextmanager
def recording_imatrix(model: Transformer, dataset: str = "") -> Iterator[Callable[[Sequence[Sequence[int]]], ImatrixStats]]:
    """While open, every forward pass of `model` adds to the imatrix statistics (collect_imatrix_stats'),
    with or without autograd (mixed.plan_mixed records them during its Fisher passes: no forward of its
    own). Yields stats(chunks): the statistics so far, of those chunks (their count and size)."""
    sums: dict[str, torch.Tensor] = {}  # name -> (in,) or (E, in) float64 sum of x^2 over tokens
    counts: dict[str, int | torch.Tensor] = {}  # tokens seen: int, or (E,) float64 per expert
    memo: list = [None, None]  # (last input, its sums): q/k/v and gate/up read the very same tensor

    def square_sums(x: torch.Tensor) -> torch.Tensor:
        # x: (..., in) -> sum over tokens of x^2 (in,) in float64 (fp32 per call, exact enough for a mean).
        if memo[0] is not x:
            memo[:] = [x, x.detach().float().pow(2).reshape(-1, x.shape[-1]).sum(0).double()]
        return memo[1]

    def record(name: str, x: torch.Tensor) -> None:
        sums[name] = sums[name] + square_sums(x) if name in sums else square_sums(x).clone()
        counts[name] = counts.get(name, 0) + x.numel() // x.shape[-1]

    def record_expert(mod: ExpertLinear, name: str, x: torch.Tensor, expert: int) -> None:
        # ExpertLinear.forward(x (n, in), expert): the n tokens routed to this expert
        if name not in sums:
            sums[name] = torch.zeros(mod.n_experts, x.shape[-1], dtype=torch.float64, device=x.device)
            counts[name] = torch.zeros(mod.n_experts, dtype=torch.float64, device=x.device)
        sums[name][expert] += square_sums(x)
        counts[name][expert] += x.numel() // x.shape[-1]

    def stats(chunks: Sequence[Sequence[int]]) -> ImatrixStats:
        s = {k: v.cpu().reshape(-1, v.shape[-1]) for k, v in sums.items()}
        c = {k: torch.as_tensor(v, dtype=torch.float64).cpu().reshape(-1) for k, v in counts.items()}
        return ImatrixStats(file_imatrix(model.cfg, s), file_imatrix(model.cfg, c), len(chunks),
                            max(len(ch) for ch in chunks), [dataset] if dataset else [])

    hooks = [m.register_forward_pre_hook(lambda mod, args, name=gguf_name(n) + ".weight": record(name, args[0]))
             for n, m in model.named_modules() if isinstance(m, Linear)]
    hooks += [m.register_forward_pre_hook(lambda mod, args, name=gguf_name(n) + ".weight": record_expert(mod, name, *args))
              for n, m in model.named_modules() if isinstance(m, ExpertLinear)]
    # The output matmul runs inside Transformer.forward (kernels.linear): its input is output_norm's output.
    out_name = "token_embd.weight" if model.cfg.tied_output else "output.weight"  # the tensor it reads
    hooks.append(model.output_norm.register_forward_hook(lambda mod, args, out: record(out_name, out)))
    try:
        yield stats
    finally:
        for h in hooks:
            h.remove()
        memo.clear()


@torch.inference_mode()
def collect_imatrix_stats(model: Transformer, chunks: Sequence[Sequence[int]], progress: Progress | None = None,
                          dataset: str = "") -> ImatrixStats:
    """The raw statistics behind collect_imatrix, as llama-imatrix keeps them: per GGUF weight name the
    float64 sums of x_j^2 over the tokens (1, in) (an expert stack (E, in), row e over the tokens routed
    to expert e, as llama.cpp's MUL_MAT_ID statistics) and the tokens summed (1,) (or (E,)); with the
    chunk count and size, and `dataset` as the file's dataset name (imatrix_files writes them)."""
    with recording_imatrix(model, dataset) as stats:
        cache = _device_cache(model, max(len(c) for c in chunks))
        for i, chunk in enumerate(chunks):
            model(torch.tensor([list(chunk)], device=model.output_norm.weight.device), cache, 0)
            if progress:
                progress("imatrix", i + 1, len(chunks))
        return stats(chunks)


def collect_imatrix(model: Transformer, chunks: Sequence[Sequence[int]], progress: Progress | None = None
                    ) -> dict[str, torch.Tensor]:
    """GGUF weight name -> (in_features,) fp32 mean of x_j^2 over all tokens of all chunks, where x is
    the input of the matmul that weight takes part in (one forward pass per chunk).

    Expert stacks (E, out, in) (moe.ExpertLinear) get (E, in): row e the mean over the tokens routed to
    expert e, as llama.cpp's imatrix keeps its MUL_MAT_ID statistics (in_sum2 (E, in), counts (E,));
    an expert no token reached gets 1 in every column, as llama-quantize reads a zero count."""
    return collect_imatrix_stats(model, chunks, progress).means()


def save_imatrix(path: str | Path, stats: ImatrixStats) -> Path:
    """Write stats in llama.cpp's format, as llama-imatrix does: the GGUF imatrix, or its legacy .dat
    when PATH ends in .dat (written whole or not at all). llama-quantize --imatrix reads either."""
    if str(path).endswith(".dat"):
        return write_dat_imatrix(path, stats)
    return write_gguf_imatrix(path, stats)


def load_imatrix(path: str | Path, model: Transformer | Mapping[str, Sequence[int]] | None = None
                 ) -> tuple[dict[str, torch.Tensor], dict]:
    """-> (name -> fp32 means as llama-quantize computes them from the file, meta with chunks (and
    chunk_size, datasets; tensors for our own older files)). Reads llama.cpp's GGUF imatrix and legacy
    .dat and localllm's own torch format. With a model (or its name -> shape mapping), a file whose
    entries are not this model's weights, or do not fit their shapes, is a ValueError."""
    if not Path(path).is_file():
        raise ValueError(f"imatrix file not found: {path}")
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"GGUF":
        stats = read_gguf_imatrix(path)
        values, meta = stats.means(), {"chunks": stats.chunk_count, "chunk_size": stats.chunk_size,
                                       "datasets": stats.datasets}
    elif head.startswith(b"PK"):  # torch.save's zip: our own format, version 1
        values, meta = _load_torch_imatrix(path)
    else:
        values, chunks, datasets = read_dat_imatrix(path)
        meta = {"chunks": chunks, "datasets": datasets}
    if model is not None:
        expected = model_tensors(model) if isinstance(model, Transformer) else {k: tuple(v) for k, v in model.items()}
        values = fit_shapes(values, expected)
        if "tensors" in meta and (problem := _mismatch(meta["tensors"], expected)):
            raise ValueError(f"{path} was collected on a different model ({len(meta['tensors'])} tensors) than "
                             f"this one ({len(expected)} tensors): {problem}")
        if unknown := sorted(set(values) - set(expected)):
            raise ValueError(f"{path} was collected on a different model: it has {unknown[0]!r}, the model does not")
        if problem := _bad_value(values, expected):
            raise ValueError(f"{path} was collected on a different model: {problem}")
    return values, meta


def _load_torch_imatrix(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """localllm's own format (torch.save of {format, version, chunks, tensors, meta, imatrix})."""
    try:
        d = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception:  # torch.load raises many kinds on foreign files
        d = None
    if not isinstance(d, dict) or d.get("format") != IMATRIX_FORMAT:
        raise ValueError(f"{path} is not an imatrix file (GGUF, llama.cpp's .dat or localllm's)")
    if d.get("version") != IMATRIX_VERSION:
        raise ValueError(f"{path} has imatrix format version {d.get('version')}, this localllm reads {IMATRIX_VERSION}")
    saved = {k: tuple(v) for k, v in d["tensors"].items()}
    return dict(d["imatrix"]), {**d["meta"], "chunks": d["chunks"], "tensors": saved}


def _bad_value(imatrix: dict, shapes: dict) -> str:
    """The first imatrix entry that is no tensor or not of its weight's shape: (cols,) for a matrix,
    (E, cols) or (cols,) for an expert stack (E, F, cols); '' when all fit."""
    if not isinstance(imatrix, dict):
        return "no imatrix entries"
    for name, v in imatrix.items():
        shape = shapes.get(name)
        if shape is None:
            continue
        fits = [(shape[-1],)] + ([(shape[0], shape[-1])] if len(shape) == 3 else [])
        if not isinstance(v, torch.Tensor) or tuple(v.shape) not in fits:
            got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            return f"the entry of {name!r} has shape {got}, its weight {shape} takes {' or '.join(map(str, fits))}"
    return ""


def _mismatch(saved: dict, expected: dict) -> str:
    """The first difference between two name -> shape tables, or ''."""
    saved, expected = ({k: v for k, v in t.items() if not k.startswith(ROPE_BUFFERS)} for t in (saved, expected))
    for name in sorted(set(saved) | set(expected)):
        if name not in expected:
            return f"the file has {name!r}, the model does not"
        if name not in saved:
            return f"the model has {name!r}, the file does not"
        if saved[name] != expected[name]:
            return f"{name!r} has shape {saved[name]} in the file, {expected[name]} in the model"
    return ""


# ---- sensitivity: KL of the output when one tensor is perturbed ----------------------------------


@dataclass
class Reference:
    """The unperturbed run: what KLs compare against, and where a perturbed run restarts. Per chunk:
    resid (L + 1, 1, T, C) fp32, the residual stream entering each block and leaving the last (18 MiB
    for 256 tokens of the 135M default model); z (T, V) fp32 logits and p (T, V) fp32 softmax (8 bytes
    per vocabulary entry and position: 100 MiB for 256 tokens at V = 49152); lse (T,) float64."""

    tokens: list[torch.Tensor]
    resid: list[torch.Tensor]
    z: list[torch.Tensor]
    p: list[torch.Tensor]
    lse: list[torch.Tensor]


def _lse(z: torch.Tensor) -> torch.Tensor:
    """(T, V) fp32 -> (T,) float64 log-sum-exp: exp in fp32, summed in float64 (an fp32 sum over the
    vocabulary leaves ~2e-7 of error in a position's KL; this ~1e-8, and ~1e-11 in the mean)."""
    m = z.max(-1, keepdim=True).values
    return m[:, 0].double() + (z - m).exp().sum(-1, dtype=torch.float64).log()


def _kl(ref: Reference, i: int, zq: torch.Tensor) -> torch.Tensor:
    """(T,) float64 KL(p || q) per position of chunk i, from q's logits zq (T, V) fp32.

    KL = sum_v p_v (log p_v - log q_v) = sum_v p_v (zp_v - zq_v) + lse(zq) - lse(zp)  (sum_v p_v = 1).
    Shift-invariant, so fp32 over the vocabulary suffices (1.3x faster than float64 log_softmaxes, and
    no float64 copy of the reference); the same logits give exactly 0."""
    return (ref.p[i] * (ref.z[i] - zq)).sum(-1).double() + _lse(zq) - ref.lse[i]


def _blocks(model: Transformer, x: torch.Tensor, first: int, cache: KVCache, rope, keep: list | None = None):
    """Run blocks first .. L-1 on x (1, T, C) at positions 0 .. T-1, as Transformer.forward does."""
    for i in range(first, len(model.blk)):
        if keep is not None:
            keep.append(x)
        x = model.blk[i](x, i, cache, 0, *rope[i])
    return x


def _head(model: Transformer, x: torch.Tensor) -> torch.Tensor:
    """The last residual (1, T, C) -> logits (T, V) fp32, as Transformer.forward ends."""
    return model.head(x)[0]


@torch.inference_mode()
def reference_outputs(model: Transformer, chunks: Sequence[Sequence[int]]) -> Reference:
    """One forward pass per chunk of the unperturbed model (reusable across measure_sensitivity calls)."""
    if model.cfg.per_layer_dim:  # _blocks runs layers without Transformer.per_layer_inputs
        raise LocalLLMError("sensitivity measurement does not support per-layer embeddings (Gemma 4 E2B/E4B) yet")
    dev = model.token_embd.weight.device
    cache = _device_cache(model, max(len(c) for c in chunks))
    ref = Reference([], [], [], [], [])
    for chunk in chunks:
        tokens, keep = torch.tensor([list(chunk)], device=dev), []
        rope = model.layer_inputs(0, len(chunk), dev)
        x = _blocks(model, model.embed(tokens), 0, cache, rope, keep)
        z = _head(model, x)
        ref.tokens.append(tokens)
        ref.resid.append(torch.stack(keep + [x]))
        ref.z.append(z)
        ref.p.append(torch.softmax(z.double(), -1).float())
        ref.lse.append(_lse(z))
    return ref


def _first_layer(name: str, n_layers: int) -> int | None:
    """Where a run restarts when this tensor changes: its block; L (output, output_norm); None: embedding."""
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blk" else None if name == "token_embd.weight" else n_layers


@torch.inference_mode()
def _perturbed_kl(model: Transformer, ref: Reference, first: int | None, cache: KVCache) -> float:
    """Mean KL over all positions of all chunks, restarting each chunk at block `first`."""
    total, count = 0.0, 0
    for i, tokens in enumerate(ref.tokens):
        T = tokens.shape[1]
        rope = model.layer_inputs(0, T, tokens.device)
        x = model.embed(tokens) if first is None else ref.resid[i][first]
        zq = _head(model, _blocks(model, x, first or 0, cache, rope))
        total += _kl(ref, i, zq).sum().item()
        count += T
    return total / count


def measure_sensitivity(model: Transformer, chunks: Sequence[Sequence[int]], tensors: Sequence[str],
                        perturb: Callable[[str, torch.Tensor], torch.Tensor], progress: Progress | None = None,
                        reference: Reference | None = None) -> dict[str, float]:
    """Tensor name -> mean KL(base || model with that one tensor replaced by perturb(name, w)) over
    every position of every chunk (chunks are not read when a reference is given). perturb gets a copy
    of the weight (it may work in place); the original is put back untouched (the same tensor object).

    Cost per tensor: the blocks from its own layer on (earlier ones restart from the reference), the
    output matmul and a few fp32 passes over the logits. 135M default model, 2 x 256 tokens, one core of
    the project's CPU: 0.8 s (last block) to 2.2 s (first block, token_embd), 1.5 s mean, so ~5 min
    for all 211 matrices at one probe type (plus the probe's quantize-dequantize, 0.01-0.35 s). With
    other processes busy on that 2-core machine, two torch threads ran 5-20x slower than one."""
    ref = reference if reference is not None else reference_outputs(model, chunks)
    cache = _device_cache(model, max(t.shape[1] for t in ref.tokens))
    out: dict[str, float] = {}
    for k, name in enumerate(tensors):
        p = get_weight(model, name)
        original = p.data
        with torch.no_grad():
            new = perturb(name, original.clone())
        if tuple(new.shape) != tuple(original.shape):
            raise ValueError(f"perturb({name!r}) returned shape {tuple(new.shape)}, expected {tuple(original.shape)}")
        try:
            p.data = new.to(device=original.device, dtype=original.dtype)
            out[name] = _perturbed_kl(model, ref, _first_layer(name, len(model.blk)), cache)
        finally:
            p.data = original
        if progress:
            progress("sensitivity", k + 1, len(tensors))
    return out


# ---- predicting a type's loss from one probe -----------------------------------------------------


def weighted_error(w: torch.Tensor, w_hat: torch.Tensor, importance: torch.Tensor | None) -> float:
    """sum_j importance_j * ||w[:, j] - w_hat[:, j]||^2 for w, w_hat (out, in), importance (in,) or None
    (plain squared error): E||(W - W_hat) x||^2 under the imatrix's diagonal input covariance.

    An expert stack w, w_hat (E, out, in) (or its (E * out, in) rows) with a per-expert importance
    (E, in): the sum over experts of each expert's own weighted error."""
    groups = importance.shape[0] if importance is not None and importance.dim() == 2 else 1
    diff = w.detach().double() - w_hat.detach().double()
    col = diff.reshape(groups, -1, diff.shape[-1]).pow(2).sum(1)  # (groups, in)
    return float(col.sum() if importance is None else (col * importance.double().to(col.device).reshape(groups, -1)).sum())


def predict_losses(sens_kl: float, probe_err: float, errs: Mapping[Hashable, float]) -> dict[Hashable, float]:
    """Each type's predicted KL: sens_kl * err_q / probe_err.

    Why: a weight error dW moves the logits by dz = J dW x (linear in dW for small errors), and the KL
    is second order in dz: KL ~ 1/2 dz^T F dz (F the Fisher matrix of the output distribution). So for
    errors of the same character (block rounding noise, nearly independent across columns and of the
    input), E[KL] scales with E||dW x||^2 ~ weighted_error. One measured probe per tensor
    (sens_kl = its KL at the probe type, probe_err = the probe's weighted_error) fixes that tensor's
    constant J^T F J; every other type's loss follows from its weighted_error alone."""
    if probe_err <= 0:
        if all(e == 0 for e in errs.values()):
            return {q: 0.0 for q in errs}
        raise ValueError("the probe's weighted error is 0: probe with a lossy type")
    return {q: sens_kl * e / probe_err for q, e in errs.items()}


def roundtrip(w: torch.Tensor, qtype, importance: torch.Tensor | None = None, ext=None) -> torch.Tensor:
    """w (out, in) quantized to qtype (a GGUF type) and decoded back, in w's dtype: a ready perturbation.
    ext: the C++ encoders for w's device (kernels/cpu.py encoders_for) or None."""
    from localllm.quantize import dequantize_torch, quantize_tensor

    back = dequantize_torch(quantize_tensor(w.detach().float(), qtype, importance, ext=ext), qtype)
    return back.reshape(w.shape).to(device=w.device, dtype=w.dtype)

