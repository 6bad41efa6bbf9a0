"""Models from the Hugging Face Hub: `owner/repo[:QUANT]` references, fetched once into
huggingface_hub's standard cache (HF_HOME / HF_HUB_CACHE), then used offline.

huggingface_hub does the transfer: resumable downloads (a file's .incomplete part is continued with a
Range request), a progress bar per file, HF_TOKEN for gated and private repos, HF_ENDPOINT for another
server, HF_HUB_OFFLINE for no network. Which files make the model: localllm/hub_files.py (llama.cpp's
rules). A reference used as a MODEL looks in the cache first and touches the network only when the
model is not there (resolve); `pull` always asks the Hub, so it also brings a cached model up to date.
The cache keeps the branch `main`: refs/main names the snapshot folder whose files (links to blobs)
are the repo's at that commit.
"""

from __future__ import annotations

import json
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .errors import LocalLLMError
from .hub_files import choose_files, complete_split, model_ggufs, quant_of, safetensors_files

REVISION = "main"
# owner/repo[:QUANT], as llama.cpp's -hf and ollama's hf.co/ take it (an hf.co/ prefix is allowed)
REF = re.compile(r"^(?:hf\.co/|huggingface\.co/)?(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<quant>[\w.-]+))?$")
FILE_SUFFIXES = (".gguf", ".safetensors", ".json")


class RepoNotFound(LocalLLMError):
    """The Hub has no such repository (or hides a private one): a MODEL string that was meant as a path
    says so (resolve)."""


@dataclass(frozen=True)
class RepoRef:
    repo: str  # owner/name
    quant: str | None = None  # a GGUF quant tag (Q4_K_M), case-insensitive; None: llama.cpp's default

    def __str__(self) -> str:
        return self.repo + (f":{self.quant}" if self.quant else "")


@dataclass(frozen=True)
class CachedModel:
    name: str  # the reference that names it: owner/repo:QUANT (GGUF) or owner/repo (safetensors)
    kind: str  # "gguf" or "safetensors"
    path: Path  # what the loader opens: the GGUF (a split set's first part) or the snapshot folder
    files: tuple[Path, ...]  # the model's files in the snapshot
    size: int  # bytes


def parse_ref(spec: str) -> RepoRef | None:
    """A MODEL string as a repo reference; None for one that is not (a file name, a path)."""
    m = REF.match(spec)
    if m is None or m["repo"].lower().endswith(FILE_SUFFIXES):
        return None
    return RepoRef(m["repo"], m["quant"])


def hub_cache() -> Path:
    """huggingface_hub's cache folder (read when asked: HF_HOME / HF_HUB_CACHE as that library set them)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def repo_dir(repo: str, cache: Path) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    return cache / repo_folder_name(repo_id=repo, repo_type="model")


def _snapshot(folder: Path) -> Path | None:
    """The snapshot folder that refs/main names; None when the repo was never fetched."""
    try:
        commit = (folder / "refs" / REVISION).read_text().strip()
    except OSError:
        return None
    snapshot = folder / "snapshots" / commit
    return snapshot if commit and snapshot.is_dir() else None


def _files(snapshot: Path) -> list[str]:
    """The snapshot's complete files, as repo paths (a link whose blob is gone does not count)."""
    return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())


def _entry(repo: str, snapshot: Path, files: list[str], quant: str | None) -> CachedModel | None:
    try:
        kind, chosen = choose_files(repo, files, quant)
    except LocalLLMError:
        return None
    if kind == "gguf" and not complete_split(files, chosen):
        return None
    if kind == "safetensors" and not _shards_present(snapshot, files):
        return None
    paths = tuple(snapshot / f for f in chosen)
    size = sum(p.stat().st_size for p in paths)
    if kind == "gguf":
        return CachedModel(f"{repo}:{quant_of(chosen[0])}", kind, paths[0], paths, size)
    return CachedModel(repo, kind, snapshot, paths, size)


def _shards_present(snapshot: Path, files: list[str]) -> bool:
    index = snapshot / "model.safetensors.index.json"
    if not index.is_file():
        return True
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return True  # the loader names what is wrong with the index
    return shards <= set(files)


def find_cached(ref: RepoRef, cache: Path | None = None) -> CachedModel | None:
    """The model ref names, if the cache holds all its files; no network."""
    snapshot = _snapshot(repo_dir(ref.repo, cache or hub_cache()))
    return _entry(ref.repo, snapshot, _files(snapshot), ref.quant) if snapshot else None


def resolve(ref: RepoRef) -> Path:
    """The path the loader opens for ref: from the cache, else pulled (unless offline)."""
    found = find_cached(ref)
    if found is not None:
        return found.path
    if offline():
        raise LocalLLMError(f"{ref} is not in the Hugging Face cache ({hub_cache()}) and HF_HUB_OFFLINE is set:"
                            f" run `localllm pull {ref}` with a network first")
    try:
        return pull(ref).path
    except RepoNotFound as e:
        raise LocalLLMError(f"no such file or folder: {ref}; and {e}") from None


def pull(ref: RepoRef) -> CachedModel:
    """Fetch (or bring up to date) the model ref names into the cache; huggingface_hub shows a progress
    bar per file and resumes a broken transfer."""
    from huggingface_hub import HfApi, hf_hub_download

    if offline():
        raise LocalLLMError(f"cannot pull {ref}: HF_HUB_OFFLINE is set")
    with hub_errors(ref):
        info = HfApi().model_info(ref.repo, revision=REVISION)
        files = [s.rfilename for s in info.siblings or []]
        kind, chosen = choose_files(ref.repo, files, ref.quant)
        paths = tuple(Path(hf_hub_download(ref.repo, name, revision=REVISION)) for name in chosen)
    size = sum(p.stat().st_size for p in paths)
    if kind == "gguf":
        return CachedModel(f"{ref.repo}:{quant_of(chosen[0])}", kind, paths[0], paths, size)
    return CachedModel(ref.repo, kind, paths[0].parent, paths, size)  # top-level files: the snapshot folder


@contextmanager
def hub_errors(ref: RepoRef) -> Iterator[None]:
    """huggingface_hub's exceptions as one LocalLLMError line each."""
    from huggingface_hub import constants, errors

    transport = getattr(errors, "HTTPError", OSError)  # the HTTP client's base error, as huggingface_hub imports it
    try:
        yield
    except errors.GatedRepoError:
        raise LocalLLMError(f"{ref.repo} is gated: accept its terms on the Hub, then set HF_TOKEN to a token of"
                            " that account") from None
    except errors.RepositoryNotFoundError:
        raise RepoNotFound(f"no such model repository on the Hub: {ref.repo} (a private one needs HF_TOKEN)") from None
    except errors.RevisionNotFoundError:
        raise LocalLLMError(f"{ref.repo} has no branch {REVISION!r}") from None
    except (errors.OfflineModeIsEnabled, errors.LocalEntryNotFoundError):  # (before: 0.x's is an EntryNotFoundError)
        raise LocalLLMError(f"cannot reach the Hub ({constants.ENDPOINT}) to fetch {ref}: check the network"
                            " (or HF_ENDPOINT)") from None
    except getattr(errors, "RemoteEntryNotFoundError", errors.EntryNotFoundError) as e:
        raise LocalLLMError(f"a file of {ref.repo} is missing on the Hub: {_first_line(e)}") from None
    except errors.HfHubHTTPError as e:
        raise LocalLLMError(f"the Hub refused {ref}: {_first_line(e)}") from None
    except (transport, OSError) as e:
        raise LocalLLMError(f"cannot fetch {ref} from {constants.ENDPOINT}: {_first_line(e)}") from None


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def cached_models(cache: Path | None = None) -> list[CachedModel]:
    """Every model the cache holds: each GGUF quant (a split set once) and each safetensors checkpoint."""
    cache = cache or hub_cache()
    out = []
    for folder in sorted(cache.glob("models--*")) if cache.is_dir() else []:
        snapshot = _snapshot(folder)
        if snapshot is None:
            continue
        repo = folder.name.removeprefix("models--").replace("--", "/", 1)
        files = _files(snapshot)
        quants = sorted({quant_of(f) for f in model_ggufs(files)})
        entries = [_entry(repo, snapshot, files, q) for q in quants] if quants else [_entry(repo, snapshot, files, None)]
        out += [e for e in entries if e is not None and e.name not in {o.name for o in out}]
    return out


def remove(ref: RepoRef, cache: Path | None = None) -> list[Path]:
    """Delete a model from the cache: owner/repo:QUANT its files (their blobs too), owner/repo the whole
    repo folder (as the repo's last model goes). Returns what was removed."""
    cache = cache or hub_cache()
    folder = repo_dir(ref.repo, cache)
    found = find_cached(ref, cache)
    if not folder.is_dir() or (ref.quant and found is None):
        raise LocalLLMError(f"{ref} is not in the Hugging Face cache ({cache}): see `localllm list`")
    if ref.quant:
        for link in found.files:
            blob = link.resolve()
            link.unlink()
            if blob != link and blob.is_file():
                blob.unlink()
        snapshot = _snapshot(folder)
        if snapshot is not None and (model_ggufs(_files(snapshot)) or safetensors_files(_files(snapshot))):
            return list(found.files)
    shutil.rmtree(folder)
    return [folder]

