"""Files of llama.cpp's own tools, read and written by localllm (tests/data/llamacpp, README.md there):

- imatrix: llama-imatrix's GGUF and legacy .dat files of the tiny llama model read as the statistics
  localllm collects on the same tokens; localllm's GGUF imatrix laid out as llama-imatrix's; both
  handed to llama-quantize (IQ4_NL) gave the very IQ4 bytes localllm's quantize gives with them;
- KL divergence: llama-perplexity's --kl-divergence-base file of the F32 model as localllm's --kld-base
  (the F32 model against it ~0, the Q4_0 model as llama-perplexity --kl-divergence measured it), and
  llama-perplexity judging the Q4_0 model against localllm's file as localllm judges it in one run;
- IQ4_NL / IQ4_XS presets: llama-quantize's types tensor for tensor, its bytes for the IQ4 tensors.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import tiny_models as tm
from tiny_gguf import write_gguf
from tiny_spec import Q
from localllm import imatrix as IM
from localllm.commands import evaluate as ev
from localllm.commands import llama_logits as ll
from localllm.commands.quantize_cmd import quantize_model
from localllm.errors import LocalLLMError
from localllm.imatrix_files import read_gguf_imatrix, write_dat_imatrix, write_gguf_imatrix
from localllm.load import load_model

DATA = Path(__file__).parent / "data" / "llamacpp"
RESULTS = json.loads((DATA / "results.json").read_text())  # make_samples.py's figures and hashes
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: small passes run faster on one thread


@pytest.fixture(scope="module")
def models(tiny):
    f32, q4 = tiny.gguf("llama"), tiny.gguf("llama", Q.Q4_0)
    return f32, q4, load_model(str(f32), "cpu", torch.float32), load_model(str(q4), "cpu", torch.float32)


@pytest.fixture(scope="module")
def base_file():
    return ll.load_llama_logits(DATA / "base.kld")


@pytest.fixture(scope="module")
def chunks(models, base_file):
    """The KLD chunks as localllm cuts the text: they must be the file's tokens."""
    lm = models[2]
    c = ev.chunks_for(lm, (DATA / "text.txt").read_text(), RESULTS["ctx"], RESULTS["kld_chunks"])
    base_file.check(c, lm.config.vocab_size)
    return c


@pytest.fixture(scope="module")
def our_stats(models, base_file):
    """localllm's statistics on llama-imatrix's chunks (the same tokens: the text, BOS first)."""
    rows = [list(map(int, r)) for r in base_file.tokens[: RESULTS["imatrix_chunks"]]]
    return IM.collect_imatrix_stats(models[2].model, rows, dataset="text.txt")


# ---- imatrix


@pytest.mark.parametrize("name", ["imatrix.gguf", "imatrix.dat"])
def test_llama_imatrix_files_read_as_our_statistics(models, our_stats, name):
    values, meta = IM.load_imatrix(DATA / name, models[2].model)
    ours = our_stats.means()
    assert set(values) == set(ours) and meta["chunks"] == RESULTS["imatrix_chunks"]
    for k, v in values.items():  # llama.cpp's fp16 KV cache moves attention's outputs by ~1e-3
        torch.testing.assert_close(v, ours[k], rtol=1e-2, atol=1e-6, msg=k)


def test_llama_imatrix_gguf_counts_and_layout_equal_ours(our_stats, tmp_path):
    theirs = read_gguf_imatrix(DATA / "imatrix.gguf")
    tokens = RESULTS["imatrix_chunks"] * RESULTS["ctx"]
    assert theirs.chunk_count == RESULTS["imatrix_chunks"] and theirs.chunk_size == RESULTS["ctx"]
    assert all(torch.equal(c, torch.full((1,), float(tokens))) for c in theirs.counts.values())
    assert all(torch.equal(c.float(), theirs.counts[k]) for k, c in our_stats.counts.items())
    ours = write_gguf_imatrix(tmp_path / "ours.gguf", our_stats)
    a, b = gguf.GGUFReader(DATA / "imatrix.gguf"), gguf.GGUFReader(ours)
    assert [(t.name, t.tensor_type, list(t.shape)) for t in a.tensors] == [(t.name, t.tensor_type, list(t.shape)) for t in b.tensors]
    assert {k for k in a.fields if not k.startswith("GGUF.")} == {k for k in b.fields if not k.startswith("GGUF.")}
    back = read_gguf_imatrix(ours)
    assert all(torch.equal(back.sums[k], our_stats.sums[k].float()) for k in our_stats.sums)


def test_dat_written_from_llama_gguf_equals_llama_dat(tmp_path):
    """The legacy file localllm writes from llama-imatrix's GGUF statistics holds llama-imatrix's own
    .dat values (the same run's sums: to an ulp of fp32 order)."""
    ours = write_dat_imatrix(tmp_path / "x.dat", read_gguf_imatrix(DATA / "imatrix.gguf"))
    a, b = IM.load_imatrix(ours)[0], IM.load_imatrix(DATA / "imatrix.dat")[0]
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=0, msg=k)


def tensor_hashes(path: Path) -> dict:
    return {t.name: [t.tensor_type.name, hashlib.sha256(bytes(t.data)).hexdigest()] for t in gguf.GGUFReader(path).tensors}


def assert_same_as_llama_quantize(out: Path, want: dict) -> None:
    """Every tensor of llama-quantize's type; the IQ4 ones (and the F32 copies) its very bytes. (The
    Q6_K / Q8_0 output matrix may differ: localllm's K-quant and imatrix searches keep the better of
    several encodings, tests/test_quant_formats.py.)"""
    got = tensor_hashes(out)
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want.items()}
    same = {k for k, v in want.items() if v[0] in ("IQ4_NL", "IQ4_XS", "F32")}
    assert any(want[k][0].startswith("IQ4") for k in same)
    assert {k: got[k] for k in same} == {k: want[k] for k in same}


@pytest.mark.parametrize("case,imatrix", [("tiny_iq4_nl_llama_imatrix", "imatrix.gguf"),
                                          ("tiny_iq4_nl_llama_dat", "imatrix.dat"),
                                          ("tiny_iq4_nl_ours_imatrix", "ours_imatrix.gguf")])
def test_quantize_with_an_imatrix_file_equals_llama_quantize(models, case, imatrix, tmp_path):
    out = tmp_path / "q.gguf"
    quantize_model(str(models[0]), out, "IQ4_NL", imatrix_file=DATA / imatrix, progress=False, device="cpu")
    assert_same_as_llama_quantize(out, RESULTS["llama_quantize"][case])


@pytest.mark.parametrize("case", ["tiny_iq4_xs", "wide_iq4_xs", "wide_iq4_nl"])
def test_iq4_presets_equal_llama_quantize(tiny, case, tmp_path):
    spec = tm.case_spec("llama") if case.startswith("tiny") else tm.MIXED
    src = write_gguf(spec, tmp_path / "f32.gguf")
    out = tmp_path / "q.gguf"
    quantize_model(str(src), out, case.split("_", 1)[1].upper(), progress=False, device="cpu")
    assert_same_as_llama_quantize(out, RESULTS["llama_quantize"][case])


# ---- KL divergence


def test_llama_base_file_as_kld_base(models, base_file, chunks):
    """F32 model against llama-perplexity's file of itself: ~0 (the file's 16-bit codes, llama.cpp's
    fp32 logits); the Q4_0 model: what llama-perplexity --kl-divergence printed for it."""
    _, _, f32, q4 = models
    same = ev.evaluate(f32, chunks, base=base_file)
    assert abs(same.kld.mean) < 2e-5 and same.kld.same_top > 0.98
    assert same.kld.base_ppl == pytest.approx(same.ppl, rel=1e-3)
    want = RESULTS["llama_q4_vs_llama_base"]
    got = ev.evaluate(q4, chunks, base=base_file)
    assert got.kld.mean == pytest.approx(want["mean_kld"], rel=0.02)
    assert got.ppl == pytest.approx(want["ppl"], rel=2e-3) and got.kld.base_ppl == pytest.approx(want["base_ppl"], rel=2e-3)
    assert abs(got.kld.same_top - want["same_top"]) <= 2 / got.count


def test_our_llama_format_file_as_llama_perplexity_read_it(models, chunks, tmp_path):
    """llama-perplexity judged the Q4_0 model against localllm's file of the F32 model (make_samples.py):
    its KLD is localllm's in-run KLD; localllm reads its own file back to the same."""
    _, _, f32, q4 = models
    want = RESULTS["llama_q4_vs_ours_base"]
    in_run = ev.evaluate(q4, chunks, base=f32)
    assert in_run.kld.mean == pytest.approx(want["mean_kld"], rel=0.02)
    assert in_run.kld.base_ppl == pytest.approx(want["base_ppl"], rel=2e-3)
    path = tmp_path / "ours.kld"
    ev.evaluate(f32, chunks, save_to=path, writer_cls=ll.LlamaLogitsWriter)
    from_file = ev.evaluate(q4, chunks, base=ll.load_llama_logits(path))
    assert np.abs(from_file.kld_values - in_run.kld_values).max() < 2e-5
    assert from_file.kld.same_top == in_run.kld.same_top


def test_damaged_llama_logits_file_is_one_error(tmp_path):
    data = (DATA / "base.kld").read_bytes()
    cut = tmp_path / "cut.kld"
    cut.write_bytes(data[:-10])
    with pytest.raises(LocalLLMError, match="truncated"):
        ll.load_llama_logits(cut)


def invoke(*args):
    """`localllm ARGS` in this process (typer's runner); only the CLI's own exit may escape."""
    from typer.testing import CliRunner

    from localllm.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def test_cli_kld_base_llama_file_and_save_in_llama_format(models, tmp_path):
    q4 = models[1]
    args = ["--file", DATA / "text.txt", "--ctx", RESULTS["ctx"], "--chunks", RESULTS["kld_chunks"], "--device", "cpu",
            "--dtype", "float32"]
    saved = tmp_path / "mine.kld"
    r = invoke("perplexity", q4, *args, "--kld-base", DATA / "base.kld", "--save-logits", saved, "--logits-format", "llama.cpp")
    assert r.exit_code == 0, r.stderr
    assert "mean KLD" in r.stdout and ll.is_llama_logits_file(saved)
    assert ll.load_llama_logits(saved).n_chunks == RESULTS["kld_chunks"]
    bad = invoke("perplexity", q4, *args, "--save-logits", saved, "--logits-format", "other")
    assert bad.exit_code != 0 and "--logits-format" in bad.stderr
