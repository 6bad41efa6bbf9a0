"""`owner/repo[:QUANT]` models from a Hugging Face Hub: llama.cpp's file picking, pulls into
huggingface_hub's cache (single and split GGUF, safetensors checkpoints, gated repos, a broken transfer
resumed), offline use of the cache, list and rm, and one-line errors. The Hub is a local server
(tests/hub_server.py) in the Hub's URL layout; nothing here touches the network.

In-process tests point huggingface_hub at it as its environment variables would (HF_ENDPOINT,
HF_HUB_CACHE, HF_HUB_OFFLINE are read when that library is imported, so the fixture sets the values it
derived from them); the CLI tests run the installed command with the real variables.
"""

from __future__ import annotations

import pytest
import torch

from tiny_gguf import write_gguf
from tiny_hf import write_hf_folder
from tiny_spec import Q, TinySpec
from _bad_files import cli_env, localllm_command
from hub_server import HubServer, HubState, Repo, add_folder
from localllm import hub
from localllm.cache import make_cache
from localllm.errors import LocalLLMError
from localllm.hub_files import available_quants, pick_gguf
from localllm.load import load_model
from localllm.registry import resolve_model
from localllm.runtime import Runtime

SPEC = TinySpec("llama", seed=5)
GGUF_REPO, HF_REPO, GATED_REPO = "tiny/llama-GGUF", "tiny/llama-hf", "tiny/gated-GGUF"

# A real listing's shape (bartowski/Llama-3.2-1B-Instruct-GGUF, abridged), and a split one
BARTOWSKI = ["README.md", "Llama-3.2-1B-Instruct-IQ4_XS.gguf", "Llama-3.2-1B-Instruct-Q3_K_L.gguf",
             "Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Llama-3.2-1B-Instruct-Q4_K_S.gguf", "Llama-3.2-1B-Instruct-Q8_0.gguf",
             "Llama-3.2-1B-Instruct-f16.gguf", "Llama-3.2-1B-Instruct.imatrix"]
SPLIT = ["M-Q8_0/M-Q8_0-00001-of-00003.gguf", "M-Q8_0/M-Q8_0-00002-of-00003.gguf", "M-Q8_0/M-Q8_0-00003-of-00003.gguf",
         "M-Q4_K_M-00002-of-00002.gguf", "M-Q4_K_M-00001-of-00002.gguf", "mmproj-M-F16.gguf", "M-Q4_K_M.gguf"]


def test_quant_picking_follows_llama_cpp():
    q4 = ["Llama-3.2-1B-Instruct-Q4_K_M.gguf"]
    assert pick_gguf(BARTOWSKI, None) == q4  # the default: Q4_K_M
    assert pick_gguf(BARTOWSKI, "q4_k_m") == q4  # case-insensitive
    assert pick_gguf(BARTOWSKI, "F16") == ["Llama-3.2-1B-Instruct-f16.gguf"]
    assert pick_gguf(BARTOWSKI, "Q4_K") is None  # a tag followed by '.' or '-', not a prefix of one
    assert pick_gguf([f for f in BARTOWSKI if "Q4_K_M" not in f], None) == ["Llama-3.2-1B-Instruct-Q8_0.gguf"]
    assert pick_gguf(["a/x-IQ2_M.gguf", "b.gguf"], None) == ["a/x-IQ2_M.gguf"]  # else the first model file
    assert available_quants(BARTOWSKI) == ["F16", "IQ4_XS", "Q3_K_L", "Q4_K_M", "Q4_K_S", "Q8_0"]
    # split sets: every part, in order; the single file before a split set of the same quant
    assert pick_gguf(SPLIT, "Q8_0") == SPLIT[:3]
    assert pick_gguf(SPLIT, "Q4_K_M") == ["M-Q4_K_M.gguf"]
    assert pick_gguf(SPLIT[:6], "Q4_K_M") == ["M-Q4_K_M-00001-of-00002.gguf", "M-Q4_K_M-00002-of-00002.gguf"]
    assert available_quants(SPLIT) == ["Q4_K_M", "Q8_0"]  # mmproj is no model


def test_references_and_paths():
    assert hub.parse_ref("bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M") == hub.RepoRef(
        "bartowski/Llama-3.2-1B-Instruct-GGUF", "Q4_K_M")
    assert hub.parse_ref("hf.co/owner/repo") == hub.RepoRef("owner/repo", None)
    for not_a_ref in ("model.gguf", "dir/model.gguf", "./a/b", "/abs/path", "a/b/c", "smollm2-135m", "a/cfg.json"):
        assert hub.parse_ref(not_a_ref) is None, not_a_ref


# ---- the local Hub


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The Hub's state and URL: a GGUF repo (a Q8_0 file, an F16 split set, an mmproj sidecar), a
    safetensors repo (with files a pull must skip), a gated repo."""
    folder = tmp_path_factory.mktemp("hub")
    gguf_dir, hf_dir = folder / "gguf", folder / "hf"
    q8 = write_gguf(SPEC, gguf_dir / "tiny-llama-Q8_0.gguf", Q.Q8_0)
    write_gguf(SPEC, gguf_dir / "tiny-llama-F16.gguf", Q.F16, split_max_tensors=12)
    write_hf_folder(SPEC, hf_dir)
    state = HubState()
    add_folder(state, GGUF_REPO, gguf_dir, **{"mmproj-tiny-F16.gguf": b"not a model", "README.md": b"# tiny"})
    add_folder(state, HF_REPO, hf_dir, **{"onnx/model.onnx": b"x" * 100, "pytorch_model.bin": b"y" * 100})
    state.repos[GATED_REPO] = Repo({"tiny-Q8_0.gguf": q8.read_bytes()}, token="hf_secret")
    whole_f16 = write_gguf(SPEC, folder / "whole-F16.gguf", Q.F16)
    with HubServer(state) as url:
        yield state, url, {"q8": q8, "f16": whole_f16, "hf": hf_dir}


@pytest.fixture
def env(served, tmp_path, monkeypatch):
    """huggingface_hub pointed at the local Hub with an empty cache, as HF_ENDPOINT / HF_HOME would."""
    from huggingface_hub import constants

    state, url, files = served
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    state.requests.clear()
    return state, files


def go_offline(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@torch.inference_mode()
def logits(path) -> torch.Tensor:
    lm = load_model(str(path), "cpu", torch.float32, backend=Runtime)
    tokens = torch.tensor([[1, 7, 80, 250, 3]])
    return lm.model(tokens, make_cache(lm.config, tokens.shape[1]), 0)


def test_pull_a_quant_then_use_it_offline(env, monkeypatch):
    state, files = env
    got = hub.pull(hub.RepoRef(GGUF_REPO, "q8_0"))
    assert got.name == f"{GGUF_REPO}:Q8_0" and got.kind == "gguf"
    assert got.path.read_bytes() == files["q8"].read_bytes()
    fetched = {p for m, p, _ in state.requests if m == "GET" and "/resolve/" in p}
    assert fetched == {f"/{GGUF_REPO}/resolve/main/tiny-llama-Q8_0.gguf"}  # nothing else of the repo
    state.requests.clear()
    go_offline(monkeypatch)
    assert resolve_model(f"{GGUF_REPO}:Q8_0") == got.path
    assert resolve_model(GGUF_REPO) == got.path  # no quant: what the cache holds (Q8_0 after Q4_K_M)
    assert state.requests == []  # the cache answered


def test_a_reference_as_model_pulls_once(env):
    state, files = env
    path = resolve_model(f"{GGUF_REPO}:Q8_0")
    assert path.read_bytes() == files["q8"].read_bytes()
    state.requests.clear()
    assert resolve_model(f"{GGUF_REPO}:Q8_0") == path and state.requests == []


def test_split_quant_pulls_every_part_and_loads_as_one(env):
    state, files = env
    got = hub.pull(hub.RepoRef(GGUF_REPO, "F16"))
    assert [p.name for p in got.files] == ["tiny-llama-F16-00001-of-00002.gguf", "tiny-llama-F16-00002-of-00002.gguf"]
    assert got.path == got.files[0] and got.size == sum(p.stat().st_size for p in got.files)
    assert torch.equal(logits(got.path), logits(files["f16"]))


def test_unknown_quant_lists_the_available_ones(env):
    with pytest.raises(LocalLLMError, match=r"^no Q5_K_S GGUF in tiny/llama-GGUF \(quants: F16, Q8_0\)$"):
        hub.pull(hub.RepoRef(GGUF_REPO, "Q5_K_S"))


def test_safetensors_repo_fetches_the_checkpoint_only(env):
    state, files = env
    got = hub.pull(hub.RepoRef(HF_REPO))
    assert got.kind == "safetensors" and got.path.is_dir() and got.name == HF_REPO
    fetched = sorted(p.rsplit("/", 1)[1] for m, p, _ in state.requests if m == "GET" and "/resolve/" in p)
    expected = sorted(p.name for p in files["hf"].iterdir() if p.suffix in (".json", ".safetensors"))
    assert fetched == expected  # config, tokenizer, weights: no onnx/, no pytorch_model.bin
    assert torch.equal(logits(got.path), logits(files["hf"]))
    with pytest.raises(LocalLLMError, match="is a safetensors checkpoint, it has no quants"):
        hub.pull(hub.RepoRef(HF_REPO, "Q8_0"))


def test_gated_repo_needs_hf_token(env, monkeypatch):
    with pytest.raises(LocalLLMError, match="tiny/gated-GGUF is gated: .* HF_TOKEN"):
        hub.pull(hub.RepoRef(GATED_REPO))
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert hub.pull(hub.RepoRef(GATED_REPO)).name == f"{GATED_REPO}:Q8_0"


def test_a_broken_transfer_resumes(env, monkeypatch):
    """The connection drops mid-file: huggingface_hub asks for the rest (a Range request) and the file
    comes whole. (huggingface_hub 2.x resumes within a pull; a killed process starts the file over.)"""
    from huggingface_hub import constants

    state, files = env
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 4096)  # the bytes kept before the break: one chunk
    state.cut_once["tiny-llama-Q8_0.gguf"] = 5000
    got = hub.pull(hub.RepoRef(GGUF_REPO, "Q8_0"))
    assert got.path.read_bytes() == files["q8"].read_bytes()
    gets = [r for m, p, r in state.requests if m == "GET" and p.endswith("tiny-llama-Q8_0.gguf")]
    assert gets == [None, "bytes=4096-"]


def test_missing_repo_and_offline_miss_are_one_line(env, monkeypatch):
    with pytest.raises(LocalLLMError, match=r"^no such file or folder: tiny/nothing:Q4_K_M; and no such model "
                                            r"repository on the Hub: tiny/nothing"):
        resolve_model("tiny/nothing:Q4_K_M")
    go_offline(monkeypatch)
    with pytest.raises(LocalLLMError, match=r"tiny/llama-GGUF:Q8_0 is not in the Hugging Face cache .* HF_HUB_OFFLINE"):
        resolve_model(f"{GGUF_REPO}:Q8_0")


def test_list_and_rm(env):
    hub.pull(hub.RepoRef(GGUF_REPO, "Q8_0"))
    hub.pull(hub.RepoRef(GGUF_REPO, "F16"))
    hub.pull(hub.RepoRef(HF_REPO))
    listed = {m.name: m for m in hub.cached_models()}
    assert sorted(listed) == [f"{GGUF_REPO}:F16", f"{GGUF_REPO}:Q8_0", HF_REPO]
    assert listed[f"{GGUF_REPO}:F16"].size == sum(p.stat().st_size for p in listed[f"{GGUF_REPO}:F16"].files)
    blobs = hub.repo_dir(GGUF_REPO, hub.hub_cache()) / "blobs"
    hub.remove(hub.RepoRef(GGUF_REPO, "F16"))  # one quant: its links and blobs go, the rest stays
    assert sorted(m.name for m in hub.cached_models()) == [f"{GGUF_REPO}:Q8_0", HF_REPO]
    assert len(list(blobs.iterdir())) == 1
    hub.remove(hub.RepoRef(GGUF_REPO, "Q8_0"))  # the repo's last model: the whole repo folder
    assert not hub.repo_dir(GGUF_REPO, hub.hub_cache()).exists()
    hub.remove(hub.RepoRef(HF_REPO))
    assert hub.cached_models() == []
    with pytest.raises(LocalLLMError, match="is not in the Hugging Face cache"):
        hub.remove(hub.RepoRef(HF_REPO))


# ---- the command line, with the real environment variables


def run(env: dict, *args: str):
    import subprocess

    return subprocess.run(localllm_command() + list(args), capture_output=True, text=True, env=env, timeout=300,
                          stdin=subprocess.DEVNULL)


def one_error(result, needle: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert getattr(result, "returncode", getattr(result, "exit_code", None)) == 1 and len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert needle in lines[0], lines[0]


def test_cli_pull_then_complete_offline(served, tmp_path):
    """HF_HOME / HF_ENDPOINT / HF_HUB_OFFLINE as a user sets them: pull, then the reference as MODEL with
    no Hub at all gives the text the local file gives (that one through typer's runner in this process:
    no Hub involved, so no process of its own)."""
    state, url, files = served
    ours = ("HF_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")
    env = {k: v for k, v in cli_env().items() if k not in ours} | {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": url}
    offline = {**env, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing listens there
    prompt = ["Once upon a time", "-n", "4", "--temp", "0", "--device", "cpu"]
    ref = f"{GGUF_REPO}:Q8_0"
    pulled = run(env, "pull", ref)
    assert pulled.returncode == 0 and f"pulled {ref}: gguf" in pulled.stderr, pulled.stderr
    used = run(offline, "complete", ref, *prompt)
    local = cli("complete", str(files["q8"]), *prompt)
    assert local.exit_code == 0, local.stderr
    assert used.returncode == 0, used.stderr
    assert used.stdout == local.stdout and local.stdout.strip()


def cli(*args: str):
    from typer.testing import CliRunner

    from localllm.cli import app

    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def test_cli_list_rm_version_and_errors(env, monkeypatch):
    from importlib.metadata import version

    assert cli("--version").stdout.strip() == f"localllm {version('localllm')}"
    one_error(cli("pull", "tiny/nothing"), "no such model repository on the Hub: tiny/nothing")
    one_error(cli("pull", f"{GGUF_REPO}:Q5_K_S"), "no Q5_K_S GGUF in tiny/llama-GGUF (quants: F16, Q8_0)")
    one_error(cli("pull", "nothing"), "not a Hugging Face repo reference: 'nothing'")
    ref = f"{GGUF_REPO}:Q8_0"
    assert cli("pull", ref).exit_code == 0
    rows = {r[0]: r for r in map(str.split, cli("list").stdout.splitlines()) if r}
    assert "smollm2-135m" in rows  # models.toml's names too
    cached = hub.find_cached(hub.RepoRef(GGUF_REPO, "Q8_0"))
    assert rows[ref][1:] == [f"{cached.size / 2**20:.1f}", "MiB", "gguf", str(cached.path)]
    one_error(cli("rm", "smollm2-135m"), "is a packaged model of models.toml")
    assert cli("rm", ref).exit_code == 0
    assert ref not in cli("list").stdout.split()
    one_error(cli("rm", ref), "is not in the Hugging Face cache")
    go_offline(monkeypatch)
    one_error(cli("info", ref), "not in the Hugging Face cache")
