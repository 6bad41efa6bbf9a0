"""bench/tp_vs_llamacpp.py's llama-bench calls, against a stand-in llama-bench that behaves as the real one
(llama-cpp-python 0.3.36's tools/llama-bench/llama-bench.cpp) does for `-sm row` on CUDA: without -v its
log callback is null, so stderr holds only "failed to load model"; with -v llama_model_load's own line
names the cause (src/llama-model.cpp's make_gpu_buft_list: the CUDA backend has no split buffer type)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import tp_vs_llamacpp as tpvs  # noqa: E402

CAUSE = "llama_model_load: error loading model: device CUDA0 does not support split buffers"
FAKE = f"""#!/bin/sh
case " $* " in *" -v "*) echo "print_info: n_layer = 32" >&2; echo "{CAUSE}" >&2 ;; esac
case " $* " in *" -sm row "*)
    echo "llama_model_load_from_file_impl: failed to load model" >&2
    echo "main: error: failed to load model 'm.gguf'" >&2; exit 1 ;; esac
echo '[{{"avg_ts": 266.6, "stddev_ts": 0.4, "gpu_info": "H100"}}]'
"""


def fake_bench(tmp_path: Path) -> Path:
    exe = tmp_path / "bin" / "llama-bench"
    exe.parent.mkdir()
    exe.write_text(FAKE)
    exe.chmod(0o755)
    return exe


def test_failed_mode_reports_the_verbose_cause(tmp_path, capsys):
    exe = fake_bench(tmp_path)
    row = tpvs.llama_bench(exe, tmp_path / "m.gguf", "row", 128, 3, 30.0)
    assert "does not support split buffers" in row["error"]
    out = capsys.readouterr().out
    assert "-sm row" in out and "-v -r 1" in out and CAUSE in out and "print_info: n_layer = 32" in out


def test_modes_that_run_and_the_table(tmp_path, capsys):
    exe = fake_bench(tmp_path)
    files = {"Q4_K_M": tmp_path / "m.gguf"}
    theirs = {"Q4_K_M": {m: tpvs.llama_bench(exe, files["Q4_K_M"], m, 128, 3, 30.0) for m in tpvs.MODES}}
    assert theirs["Q4_K_M"]["tensor"] == {"tps": 266.6, "sd": 0.4, "gpu": "H100"}
    capsys.readouterr()
    tpvs.print_table(theirs, {"m.gguf": {"tp1": 400.0, "tp2": 533.2}}, files, list(tpvs.MODES))
    head, row, note = capsys.readouterr().out.splitlines()
    assert head.split()[-4:] == ["TP=2/layer", "TP=2/row", "TP=2/tensor", "TP=1/none"]
    # none layer row tensor, ours TP=1 / TP=2, then 533.2 / 266.6 for layer, row failed, tensor; 400 / 266.6
    assert row.split()[1:] == ["266.6", "266.6", "failed", "266.6", "400.0", "533.2", "2.00x", "-", "2.00x", "1.50x"]
    assert note.strip().startswith("llama-bench -sm row on Q4_K_M:") and "split buffers" in note
