"""`localllm perplexity` and localllm.commands.evaluate: llama.cpp's perplexity and KL divergence.

- The perplexity of the default model (SmolLM2-135M Q4_1) equals a reference computed here from
  transformers' logits on the same GGUF, with the chunking and second-half scoring written out again.
- KL divergence: a model against itself is exactly 0 with 100 % same top; the default model as base
  against a copy with bfloat16-rounded weights matches a plain float64 full-softmax computation here.
- A saved logits file gives the same KLD as the base run in the same pass (within the documented
  error), and a file from another text, ctx or vocabulary is refused.
- The command prints `PPL = X ± Y` (and the KLD line) and exits 0; bad input exits 1 with one line.

Cost (the suite should stay under a minute on 2 cores): 64-token chunks, at most 3 of them; the real
`localllm` processes (tiny models) start first, in the background; the other command runs go through
typer's in-process runner.
"""

from __future__ import annotations

import copy
import math
import re
import subprocess
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tiny_spec import Q
from _bad_files import cli_env, localllm_command
from conftest import default_model_path
from localllm.commands import evaluate as ev
from localllm.cache import make_cache
from localllm.errors import LocalLLMError

CTX = 64
N_CHUNKS = 3
TINY_CTX = 32
TINY_CHUNKS = 6
TINY_ARGS = ["--ctx", TINY_CTX, "--chunks", TINY_CHUNKS, "--device", "cpu", "--dtype", "float32"]

TEXT = """The village of Ashford sat at the bend of a slow brown river, where the water widened into a
shallow pool before it turned south toward the sea. Every spring the meadows flooded, and the children
waded out to catch the small silver fish that came up with the tide. The miller, a patient man with
flour in his beard, kept a ledger of every flood since his grandfather's time, and he liked to say
that the river remembered more than any of the people who lived beside it.

In the autumn of the dry year the river fell lower than anyone had seen it. Stones that had been hidden
for a century rose out of the mud, green with moss, and between them the villagers found the remains of
an old wooden bridge. Nobody knew who had built it. The schoolteacher measured the posts and drew them
in her notebook; the blacksmith said the iron nails were older than the church. For a few weeks the
whole village walked down to the water each evening to look at the bridge, as if it might tell them
something if they waited long enough.

Then the rains came back. The river rose in a single night, the pool filled, and by morning the bridge
was gone again under the brown water. The miller wrote a new line in his ledger, the children went back
to their fish, and the schoolteacher's drawings were pinned to the classroom wall, where they stayed for
many years, curling a little at the corners, until a new teacher took them down and put them in a drawer.
"""
OTHER_TEXT = """A different story entirely: the lighthouse keeper counted the steps each evening, polished the
great lens, trimmed the wick and watched the fishing boats come home through the fog before the storm.
""" * 8


# ---- helpers


def invoke(*args) -> tuple[str, str, int]:
    """The command in this process (typer's runner): stdout, stderr, exit code."""
    from typer.testing import CliRunner

    from localllm.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args])
    # Anything but the CLI's own exit would have been a traceback outside the test runner.
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result.stdout, result.stderr, result.exit_code


def report(stdout: str) -> dict[str, float]:
    """The numbers of the final report lines."""
    values = {}
    m = re.search(r"^PPL = ([\d.]+) ± ([\d.]+)", stdout, re.M)
    if m:
        values["ppl"], values["ppl_err"] = float(m.group(1)), float(m.group(2))
    m = re.search(r"^base PPL = ([\d.]+) ± ([\d.]+)", stdout, re.M)
    if m:
        values["base_ppl"] = float(m.group(1))
    m = re.search(r"^mean KLD = ([\d.]+) ± ([\d.]+), 99% KLD = ([\d.]+), median KLD = ([\d.]+), "
                  r"same top = ([\d.]+) ± ([\d.]+)%$", stdout, re.M)
    if m:
        values.update(zip(("kld", "kld_err", "kld99", "kld_median", "same_top"), map(float, m.groups()[:5])))
    return values


def naive_chunks(ids: list[int], ctx: int, n: int, bos: int | None) -> list[list[int]]:
    rows = [list(ids[i * ctx : (i + 1) * ctx]) for i in range(n)]
    if bos is not None:
        for row in rows:
            row[0] = bos
    return rows


def naive_nll(logits: torch.Tensor, row: list[int]) -> np.ndarray:
    """logits (ctx, V) of one chunk -> NLL of tokens ctx/2+1 .. ctx-1 (float64)."""
    ctx, first = len(row), len(row) // 2
    logp = torch.log_softmax(logits.double(), -1)
    return np.array([-logp[j, row[j + 1]].item() for j in range(first, ctx - 1)])


def llama_percentile(values: np.ndarray, fraction: float) -> float:
    v = np.sort(values)
    p = fraction * (len(v) - 1)
    i = int(p)
    return float((1 - (p - i)) * v[i] + (p - i) * v[min(i + 1, len(v) - 1)])


def stderr_of_mean(x: np.ndarray) -> float:
    return float(math.sqrt(np.mean(x * x) - np.mean(x) ** 2) / math.sqrt(len(x) - 1))


# ---- fixtures


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("perplexity")
    out = {"text": d / "text.txt", "other": d / "other.txt", "short": d / "short.txt", "dir": d}
    out["text"].write_text(TEXT)
    out["other"].write_text(OTHER_TEXT)
    out["short"].write_text("Too short.")
    out["tiny"] = tiny.gguf("llama")
    out["tiny_q8"] = tiny.gguf("llama", Q.Q8_0)
    return out


@pytest.fixture(scope="module", autouse=True)
def real_cli(files):
    """The installed command, started before everything else (it runs in parallel): a KLD run of the
    tiny models (one process for the command; its errors are checked through typer's runner)."""
    runs = {
        "ok": ["perplexity", files["tiny_q8"], "--file", files["text"], "--kld-base", files["tiny"], *TINY_ARGS],
    }
    procs = {name: subprocess.Popen(localllm_command() + [str(a) for a in args], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=cli_env(), stdin=subprocess.DEVNULL)
             for name, args in runs.items()}
    results: dict[str, tuple[str, str, int]] = {}

    def get(name: str) -> tuple[str, str, int]:
        if name not in results:
            out, err = procs[name].communicate(timeout=600)
            results[name] = (out, err, procs[name].returncode)
        return results[name]

    yield get
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def tiny_saved(files) -> tuple[tuple[str, str, int], Path]:
    path = files["dir"] / "tiny.logits"
    return invoke("perplexity", files["tiny"], "--file", files["text"], "--save-logits", path, *TINY_ARGS), path


@pytest.fixture(scope="module")
def chunks(default_lm) -> ev.Chunks:
    return ev.chunks_for(default_lm, TEXT, CTX, N_CHUNKS)


@pytest.fixture(scope="module")
def saved(default_lm, chunks, tmp_path_factory) -> tuple[ev.Evaluation, Path]:
    """The default model's perplexity, its log-probs written to a file on the way."""
    path = tmp_path_factory.mktemp("logits") / "default.logits"
    steps = list(ev.evaluate_steps(default_lm, chunks, batch=2, save_to=path))
    assert [s.chunks_done for s in steps] == [2, 3]  # one result per forward pass of 2 chunks
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no partial file left
    return steps[-1], path


@pytest.fixture(scope="module")
def perturbed(default_lm):
    """The default model with every weight rounded to bfloat16 (computed in fp32)."""
    lm = copy.deepcopy(default_lm)
    with torch.no_grad():
        for p in lm.model.parameters():
            p.copy_(p.bfloat16().float())
    return lm


@pytest.fixture(scope="module")
def two(chunks) -> ev.Chunks:
    """The first two chunks (the KL tests run two models on each)."""
    return ev.Chunks(chunks.ids[:2], chunks.text_tokens)


@pytest.fixture(scope="module")
def in_run(perturbed, default_lm, two) -> ev.Evaluation:
    return ev.evaluate(perturbed, two, base=default_lm)


# ---- chunking and small pieces


def test_chunks_replace_the_first_token_with_bos():
    c = ev.make_chunks(list(range(10, 30)), 6, bos_id=1)
    assert c.ids.tolist() == [[1, 11, 12, 13, 14, 15], [1, 17, 18, 19, 20, 21], [1, 23, 24, 25, 26, 27]]
    assert c.first == 3 and c.per_chunk == 2 and c.text_tokens == 20
    assert c.targets().tolist() == [14, 15, 20, 21, 26, 27]
    assert ev.make_chunks(list(range(20)), 6, None, max_chunks=2).ids.tolist() == [list(range(6)), list(range(6, 12))]


def test_too_short_and_bad_options_say_what_is_needed():
    with pytest.raises(LocalLLMError, match="has 5 tokens.*needs 8"):
        ev.make_chunks(list(range(5)), 8)
    with pytest.raises(LocalLLMError, match="--chunks"):
        ev.make_chunks(list(range(50)), 8, max_chunks=0)
    with pytest.raises(LocalLLMError, match="not found"):
        ev.read_text("/nonexistent/text.txt")


def test_chunks_follow_llama_cpp(default_lm, chunks):
    tok = default_lm.tokenizer
    ids = tok.encode(TEXT, add_bos=tok.add_bos)
    assert len(ids) >= N_CHUNKS * CTX
    assert chunks.ids.tolist() == naive_chunks(ids, CTX, N_CHUNKS, tok.bos_id if tok.add_bos else None)


# ---- perplexity against transformers


@torch.inference_mode()
def test_perplexity_matches_transformers(default_path, default_lm, chunks, saved):
    result, _ = saved
    model = AutoModelForCausalLM.from_pretrained(str(default_path.parent), gguf_file=default_path.name,
                                                 dtype=torch.float32).eval()
    tok = default_lm.tokenizer
    rows = naive_chunks(tok.encode(TEXT, add_bos=tok.add_bos), CTX, N_CHUNKS, tok.bos_id if tok.add_bos else None)
    logits = model(torch.tensor(rows)).logits
    del model
    nll = [naive_nll(logits[i], rows[i]) for i in range(N_CHUNKS)]
    every = np.concatenate(nll)
    assert len(every) == result.count == N_CHUNKS * (CTX - 1 - CTX // 2)
    ppl = math.exp(every.mean())
    assert result.ppl == pytest.approx(ppl, rel=1e-4)
    assert result.mean_nll == pytest.approx(every.mean(), rel=1e-4)
    assert result.ppl_stderr == pytest.approx(ppl * stderr_of_mean(every), rel=1e-3)
    running = [math.exp(np.concatenate(nll[: i + 1]).mean()) for i in range(N_CHUNKS)]
    assert result.chunk_ppl == pytest.approx(running, rel=1e-4)
    assert 1 < result.ppl < 1000


# ---- KL divergence


def test_kld_of_a_model_against_itself_is_zero(default_lm, chunks):
    one = ev.Chunks(chunks.ids[:1], chunks.text_tokens)
    r = ev.evaluate(default_lm, one, base=default_lm)
    k = r.kld
    assert k.mean == 0 and k.stderr == 0 and k.p99 == 0 and k.median == 0 and k.maximum == 0
    assert k.same_top == 1
    assert k.base_ppl == pytest.approx(r.ppl, rel=1e-12)


@torch.inference_mode()
def test_kld_matches_a_naive_full_softmax(default_lm, perturbed, two, in_run):
    def logits_of(lm):
        return [lm.model(two.ids[i : i + 1], make_cache(lm.config, CTX), 0)[0] for i in range(2)]

    first = CTX // 2
    base, model = logits_of(default_lm), logits_of(perturbed)
    kld, same, base_nll = [], [], []
    for i in range(2):
        p = torch.log_softmax(base[i].double(), -1)[first : CTX - 1]
        q = torch.log_softmax(model[i].double(), -1)[first : CTX - 1]
        kld.append((p.exp() * (p - q)).sum(-1).numpy())
        same.append((base[i].argmax(-1) == model[i].argmax(-1))[first : CTX - 1].numpy())
        targets = two.ids[i, first + 1 :]
        base_nll.append(-p.gather(-1, targets[:, None])[:, 0].numpy())
    kld, same, base_nll = map(np.concatenate, (kld, same, base_nll))
    k = in_run.kld
    assert 1e-6 < kld.mean() < 0.1, "the perturbation should be visible but small"
    assert in_run.kld_values == pytest.approx(kld, rel=1e-6, abs=1e-12)
    assert k.mean == pytest.approx(kld.mean(), rel=1e-6)
    assert k.stderr == pytest.approx(stderr_of_mean(kld), rel=1e-5)
    assert k.p99 == pytest.approx(llama_percentile(kld, 0.99), rel=1e-6)
    assert k.median == pytest.approx(llama_percentile(kld, 0.5), rel=1e-6)
    assert k.maximum == pytest.approx(kld.max(), rel=1e-6)
    assert k.same_top == same.mean() and 0.5 < k.same_top <= 1
    assert k.base_ppl == pytest.approx(math.exp(base_nll.mean()), rel=1e-9)


def test_saved_logits_give_the_same_kld(perturbed, two, saved, in_run):
    result, path = saved
    base = ev.load_logits(path)
    assert base.ctx == CTX and base.vocab == 49152 and base.n_chunks == N_CHUNKS
    from_file = ev.evaluate(perturbed, two, base=base)  # a run may use fewer chunks than the file holds
    assert from_file.ppl == in_run.ppl and from_file.count == in_run.count
    a, b = from_file.kld, in_run.kld
    # The documented error: within 2e-6 per position and 0.1 % on the mean; top and base PPL exact.
    assert np.abs(from_file.kld_values - in_run.kld_values).max() <= 2e-6
    assert a.mean == pytest.approx(b.mean, rel=1e-3)
    assert a.p99 == pytest.approx(b.p99, rel=1e-2) and a.median == pytest.approx(b.median, rel=1e-2)
    assert a.same_top == b.same_top
    assert a.base_ppl == pytest.approx(b.base_ppl, rel=1e-6)
    assert a.base_ppl == pytest.approx(result.chunk_ppl[1], rel=1e-6)


def test_saved_logits_against_the_same_model_are_near_zero(default_lm, chunks, saved):
    _, path = saved
    one = ev.Chunks(chunks.ids[:1], chunks.text_tokens)
    r = ev.evaluate(default_lm, one, base=ev.load_logits(path))
    assert np.abs(r.kld_values).max() <= 1e-7 and r.kld.same_top == 1


def test_mismatched_logits_file_is_refused(default_lm, chunks, saved, tmp_path):
    _, path = saved
    base = ev.load_logits(path)
    other = ev.chunks_for(default_lm, OTHER_TEXT, CTX, N_CHUNKS)
    with pytest.raises(LocalLLMError, match="other tokens"):
        base.check(other, 49152)
    with pytest.raises(LocalLLMError, match="--ctx 64; this run uses --ctx 32"):
        base.check(ev.chunks_for(default_lm, TEXT, 32, 2), 49152)
    with pytest.raises(LocalLLMError, match="49152 tokens; this model has 384"):
        base.check(chunks, 384)
    more = ev.Chunks(torch.cat([chunks.ids, chunks.ids[:1]]), chunks.text_tokens)
    with pytest.raises(LocalLLMError, match="holds 3 chunks"):
        base.check(more, 49152)
    truncated = tmp_path / "truncated.logits"
    truncated.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(LocalLLMError, match="truncated"):
        ev.load_logits(truncated)
    with pytest.raises(LocalLLMError, match="not a logits file"):
        ev.load_logits(default_model_path())


def test_base_with_another_vocabulary_is_refused(default_lm, tiny):
    from localllm.load import load_model

    small = load_model(str(tiny.gguf("llama")), "cpu", torch.float32)
    c = ev.make_chunks(list(range(1, 200)), 32)
    with pytest.raises(LocalLLMError, match="different vocabulary"):
        ev.evaluate(small, c, base=default_lm)


# ---- the command


def test_cli_prints_the_perplexity(real_cli, files, tiny_saved):
    out, err, rc = real_cli("ok")
    assert rc == 0, err
    assert "Traceback" not in err and "error" not in err
    assert re.search(rf"^PPL = [\d.]+ ± [\d.]+ \({TINY_CHUNKS} chunks of {TINY_CTX} tokens, "
                     rf"{TINY_CHUNKS * (TINY_CTX - 1 - TINY_CTX // 2)} scored\)$", out, re.M), out
    values = report(out)
    assert set(values) == {"ppl", "ppl_err", "base_ppl", "kld", "kld_err", "kld99", "kld_median", "same_top"}, out
    # The same numbers as the library gives for these models and chunks.
    from localllm.runner import open_model

    lm, base = open_model(str(files["tiny_q8"]), "cpu", "float32"), open_model(str(files["tiny"]), "cpu", "float32")
    r = ev.evaluate(lm, ev.chunks_for(lm, TEXT, TINY_CTX, TINY_CHUNKS), base=base)
    expected = {"ppl": r.ppl, "ppl_err": r.ppl_stderr, "base_ppl": r.kld.base_ppl, "kld": r.kld.mean,
                "kld_err": r.kld.stderr, "kld99": r.kld.p99, "kld_median": r.kld.median, "same_top": 100 * r.kld.same_top}
    for key, value in expected.items():
        assert values[key] == pytest.approx(value, rel=1e-3, abs=1e-4 if "ppl" in key else 2e-6), key
    # Perplexity of the base alone (the run that saved its log-probs) is the base PPL above.
    assert report(tiny_saved[0][0])["ppl"] == values["base_ppl"]


def test_cli_kld_from_a_saved_file_equals_the_in_run_base(files, tiny_saved):
    (out, err, rc), path = tiny_saved
    assert rc == 0, err
    assert path.is_file()
    plain = report(out)
    assert set(plain) == {"ppl", "ppl_err"}
    file_out, file_err, file_rc = invoke("perplexity", files["tiny_q8"], "--file", files["text"], "--kld-base", path,
                                         *TINY_ARGS)
    run_out, run_err, run_rc = invoke("perplexity", files["tiny_q8"], "--file", files["text"], "--kld-base",
                                      files["tiny"], *TINY_ARGS)
    assert file_rc == 0 and run_rc == 0, file_err + run_err
    a, b = report(file_out), report(run_out)
    assert set(a) == set(b) == {"ppl", "ppl_err", "base_ppl", "kld", "kld_err", "kld99", "kld_median", "same_top"}
    assert 0 < b["kld"] < 0.1
    for key in a:
        assert a[key] == pytest.approx(b[key], rel=1e-3, abs=2e-6), key
    assert a["base_ppl"] == pytest.approx(plain["ppl"], abs=2e-4)


def error_cases(f: dict[str, Path], saved: Path) -> dict[str, tuple[list, list[str]]]:
    """case -> (arguments, words the one error line must hold)."""
    q8, text = f["tiny_q8"], f["text"]
    return {
        "missing_text": ([f["tiny"], "--file", f["dir"] / "nope.txt"], ["text file not found", "nope.txt"]),
        "too_short": ([f["tiny"], "--file", f["short"], "--ctx", TINY_CTX], ["too short", f"needs {TINY_CTX}"]),
        "other_vocab": ([f["tiny"], "--file", text, "--kld-base", default_model_path(), *TINY_ARGS],
                        ["different vocabulary", "49152", "384"]),
        "file_other_text": ([q8, "--file", f["other"], "--kld-base", saved, *TINY_ARGS], ["other tokens"]),
        "file_other_ctx": ([q8, "--file", text, "--kld-base", saved, "--ctx", 16], ["--ctx 32", "--ctx 16"]),
        "file_more_chunks": ([q8, "--file", text, "--kld-base", saved, "--ctx", TINY_CTX],
                             [f"holds {TINY_CHUNKS} chunks"]),
        "ctx_over_model": ([q8, "--file", text, "--ctx", 4096], ["--ctx 4096", "context"]),
        "bad_batch": ([q8, "--file", text, "--batch", 0, *TINY_ARGS], ["--batch"]),
    }


@pytest.mark.parametrize("name", list(error_cases(defaultdict(Path), Path())))
def test_cli_errors_are_one_line(files, tiny_saved, name):
    args, needles = error_cases(files, tiny_saved[1])[name]
    out, err, rc = invoke("perplexity", *args)
    assert rc == 1, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert out == ""


def test_cli_error_is_one_line(files):
    """A missing text file: one line on stderr, exit 1, no traceback (typer's runner: no exception but
    the command's own exit)."""
    out, err, rc = invoke("perplexity", files["tiny"], "--file", files["dir"] / "x.txt")
    assert rc == 1
    assert err.strip().splitlines() == [f"error: text file not found: {files['dir'] / 'x.txt'}"]
    assert out == ""


def test_cli_help_lists_the_options():
    out, err, rc = invoke("perplexity", "--help")
    assert rc == 0, err
    for option in ("--file", "--ctx", "--kld-base", "--save-logits", "--chunks", "--batch", "--device", "--dtype"):
        assert option in out, option
