"""Bad input through the real command: each case must print exactly one `error: ...` line naming the
problem on stderr, exit non-zero, and never show a traceback.

The CLI runs are slow to start (a Python and torch import each), so one process per command (complete,
info) keeps the installed command covered: one module fixture runs them, one per core at a time, and
the tests only read their results. Every other case runs in this process through typer's test runner
(the same checks: one line, non-zero exit, no exception but the CLI's own exit).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

from _bad_files import (
    TINY,
    copy_head,
    default_model,
    parallel_jobs,
    patch,
    run_cli,
    tensor_info_offsets,
    tiny_tensors,
    write_gguf,
    write_tiny_model,
)

LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 4


def _absent_device() -> str:
    import torch

    # On this CPU-only machine cuda is the device that is absent; elsewhere pick one that is.
    if not torch.cuda.is_available():
        return "cuda"
    return "mps"


def make_files(d: Path) -> dict[str, Path]:
    """Every broken input, written into folder d."""
    files = {"tiny": write_tiny_model(d / "tiny.gguf")}

    (d / "not_gguf.gguf").write_bytes(b"PK\x03\x04 this is a zip, not a GGUF file" * 10)
    files["not_gguf"] = d / "not_gguf.gguf"

    big = default_model()
    size = big.stat().st_size
    files["cut_data"] = copy_head(big, d / "cut_in_data.gguf", size // 2)  # the middle of the tensor data
    files["cut_meta"] = copy_head(big, d / "cut_in_metadata.gguf", 200_000)  # inside the vocabulary
    files["cut_header"] = copy_head(big, d / "cut_in_header.gguf", 12)  # magic, version, half a count

    # A tensor whose data offset points past the end of the file (the file itself is whole).
    files["offset"] = Path(shutil.copy(files["tiny"], d / "bad_offset.gguf"))
    _, offset_at = tensor_info_offsets(files["offset"], "blk.1.ffn_up.weight")
    past_end = files["offset"].stat().st_size // 32 * 32  # relative to the data section: beyond the file
    patch(files["offset"], offset_at, "<Q", past_end)

    # A type id that is no ggml type, and a real ggml type that we do not run.
    files["type_id"] = Path(shutil.copy(files["tiny"], d / "bad_type_id.gguf"))
    type_at, _ = tensor_info_offsets(files["type_id"], "blk.0.ffn_down.weight")
    patch(files["type_id"], type_at, "<I", 200)
    iq2 = gguf.GGMLQuantizationType.IQ2_XXS  # a whole tensor of it (a patched type id breaks the layout)
    iq2_bytes = np.zeros((TINY["dim"], TINY["ffn_dim"] // 256 * gguf.GGML_QUANT_SIZES[iq2][1]), np.uint8)
    files["iq2"] = write_gguf(d / "iq2_xxs.gguf", tensors={"blk.0.ffn_down.weight": (iq2_bytes, iq2)})

    files["foo"] = write_tiny_model(d / "foo_arch.gguf", arch="foo")

    # A Hugging Face folder with weights and a tokenizer but no config.json.
    st = d / "st_no_config"
    st.mkdir()
    save_file({"model.embed_tokens.weight": tiny_tensors()["token_embd.weight"]}, str(st / "model.safetensors"))
    (st / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {}, "merges": []}}))
    files["st_no_config"] = st
    bad_cfg = d / "st_bad_config"
    shutil.copytree(st, bad_cfg)
    (bad_cfg / "config.json").write_text("{not json")
    files["st_bad_config"] = bad_cfg
    return files


# case -> (CLI arguments, words the one error line must contain (case-insensitive)).
# These run the installed `localllm` command in a process of its own: one per command.
def cases(f: dict[str, Path], d: Path) -> dict[str, tuple[list[str], list[str]]]:
    missing = d / "no_such_model.gguf"
    return {
        "missing_complete": (["complete", missing, "hi"], ["file not found", missing.name]),
        "cut_in_tensor_data": (["info", f["cut_data"]], ["truncated", "past the end", "tensor"]),
    }


# The same check in this process through typer's test runner (no start-up cost): every other path.
def in_process_cases(f: dict[str, Path], d: Path) -> dict[str, tuple[list[str], list[str]]]:
    missing = d / "no_such_model.gguf"
    return {
        "missing_info": (["info", missing], ["file not found", missing.name]),
        "not_gguf": (["info", f["not_gguf"]], ["not a GGUF file", "magic"]),
        "cut_in_metadata": (["info", f["cut_meta"]], ["truncated", "metadata", "past the end"]),
        "cut_in_header": (["complete", f["cut_header"], "hi"], ["truncated", "header", "past the end"]),
        "offset_past_end": (["info", f["offset"]], ["past the end", "blk.1.ffn_up.weight"]),
        "unknown_arch": (["info", f["foo"]], ["unknown architecture 'foo'"]),
        "unknown_type_id": (["complete", f["type_id"], "hi"], ["blk.0.ffn_down.weight", "unknown type id 200"]),
        "unsupported_type": (["complete", f["iq2"], "hi"], ["blk.0.ffn_down.weight", "unsupported type IQ2_XXS"]),
        "safetensors_no_config": (["complete", f["st_no_config"], "hi"], ["no config.json"]),
        "over_context": (["complete", f["tiny"], LONG_PROMPT, "--ctx", "8"], ["context holds 8", "--ctx"]),
        "unknown_name": (["complete", "no-such-model-7b", "hi"], ["no such file or model name", "no-such-model-7b"]),
        "absent_device": (["complete", "hi", "--device", _absent_device()], [_absent_device()]),
        "not_gguf_tokenize": (["tokenize", f["not_gguf"], "hi", "--ids"], ["not a GGUF file"]),
        "unknown_arch_complete": (["complete", f["foo"], "hi"], ["unknown architecture 'foo'"]),
        "unknown_type_id_info": (["info", f["type_id"]], ["unknown type id 200"]),
        "safetensors_no_config_info": (["info", f["st_no_config"]], ["no config.json"]),
        "safetensors_bad_config_info": (["info", f["st_bad_config"]], ["bad config.json"]),
        "markup_in_name": (["info", "[/oops]"], ["[/oops]"]),
        "unknown_device": (["complete", "hi", "--device", "tpu"], ["unknown device 'tpu'"]),
        "bad_dtype": (["complete", "hi", "--dtype", "int3"], ["dtype int3"]),
        "empty_prompt": (["complete", f["tiny"], ""], ["prompt is empty"]),
        "too_many_arguments": (["complete", f["tiny"], "a", "b"], ["expected [MODEL] PROMPT"]),
        "min_p_above_one": (["complete", f["tiny"], "hi", "--min-p", "2"], ["--min-p", "between 0 and 1"]),
        "zero_repeat_penalty": (["complete", f["tiny"], "hi", "--repeat-penalty", "0"], ["--repeat-penalty"]),
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[dict[str, Path], Path]:
    d = tmp_path_factory.mktemp("bad")
    return make_files(d), d


@pytest.fixture(scope="module")
def results(files):
    all_cases = cases(*files)
    with ThreadPoolExecutor(parallel_jobs()) as pool:
        futures = {name: pool.submit(run_cli, *args) for name, (args, _) in all_cases.items()}
        return {name: (fut.result(), all_cases[name][1]) for name, fut in futures.items()}


def assert_one_error_line(r, needles: list[str]) -> None:
    shown = f"exit {r.returncode}\nstdout: {r.stdout!r}\nstderr:\n{r.stderr}"
    assert "Traceback" not in r.stderr, shown
    assert r.returncode != 0, shown
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, shown
    assert lines[0].startswith("error: "), shown
    for word in needles:
        assert word.lower() in lines[0].lower(), f"{word!r} not named\n{shown}"
    assert r.stdout.strip() == "", shown


@pytest.mark.parametrize("name", list(cases(defaultdict(Path), Path())))
def test_bad_input_gives_one_line(results, name):
    r, needles = results[name]
    assert_one_error_line(r, needles)


@pytest.mark.parametrize("name", list(in_process_cases(defaultdict(Path), Path())))
def test_bad_input_in_process(files, name):
    from typer.testing import CliRunner

    from localllm.cli import app

    args, needles = in_process_cases(*files)[name]
    result = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})  # as run_cli
    # Anything but the CLI's own exit would have been a traceback outside the test runner.
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    r = subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)
    assert_one_error_line(r, needles)


def test_tiny_model_itself_is_fine(files):
    """The broken files differ from a working tiny model only by the patched bytes."""
    from localllm.gguf_file import open_gguf
    from localllm.runner import complete, open_model
    from localllm.settings import GenerationSettings, SamplingSettings

    path = files[0]["tiny"]
    lm = open_model(str(path), "cpu", "float32")
    text = "".join(complete(lm, "the", GenerationSettings(max_tokens=4), SamplingSettings(temperature=0)))
    assert isinstance(text, str)
    f = open_gguf(path)
    assert f.tensors["blk.0.ffn_down.weight"].tensor_type == gguf.GGMLQuantizationType.F32
