"""A local stand-in for the Hugging Face Hub, for tests (nothing downloads from the real one).

It serves what huggingface_hub asks for (read from its source: HfApi.model_info and
file_download.get_hf_file_metadata / http_get):
  GET  /api/models/{owner}/{name}[/revision/{rev}]  -> {"id", "sha", "siblings": [{"rfilename"}]}
  HEAD /{owner}/{name}/resolve/{rev}/{path}          -> X-Repo-Commit, ETag, Content-Length
  GET  the same                                       -> the bytes; a Range request gets 206 and the rest
Unknown repos and files are 404 with the X-Error-Code header the Hub sends (RepoNotFound /
EntryNotFound); a gated repo is 403 GatedRepo without its token. Requests are recorded (with their
Range header), and a file's first GET can break off mid-body (cut_once) to exercise the resume.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

API = re.compile(r"^/api/models/([^/]+/[^/]+?)(?:/revision/([^/]+))?$")
RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


@dataclass
class Repo:
    files: dict[str, bytes]
    token: str | None = None  # gated: only this bearer token gets in

    @property
    def sha(self) -> str:
        h = hashlib.sha1()
        for name in sorted(self.files):
            h.update(name.encode() + hashlib.sha256(self.files[name]).digest())
        return h.hexdigest()


@dataclass
class HubState:
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, path, Range header)
    cut_once: dict[str, int] = field(default_factory=dict)  # file path -> bytes sent before its next GET breaks


def add_folder(state: HubState, repo: str, folder: Path, token: str | None = None, **extra: bytes) -> Repo:
    files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    state.repos[repo] = Repo(files | extra, token)
    return state.repos[repo]


def _handler(state: HubState):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def do_HEAD(self):
            self._serve(body=False)

        def do_GET(self):
            self._serve(body=True)

        def _error(self, status: int, code: str) -> None:
            payload = json.dumps({"error": code}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(payload)

        def _repo(self, name: str) -> Repo | None:
            repo = state.repos.get(name)
            if repo is None:
                self._error(404, "RepoNotFound")
                return None
            if repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
                self._error(403, "GatedRepo")
                return None
            return repo

        def _serve(self, body: bool) -> None:
            path = self.path.split("?", 1)[0]
            state.requests.append((self.command, path, self.headers.get("Range")))
            if m := API.match(path):
                if (repo := self._repo(m[1])) is None:
                    return
                info = {"id": m[1], "modelId": m[1], "sha": repo.sha, "private": False,
                        "siblings": [{"rfilename": f} for f in sorted(repo.files)]}
                self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
            elif m := RESOLVE.match(path):
                if (repo := self._repo(m[1])) is None:
                    return
                data = repo.files.get(m[3])
                if data is None:
                    return self._error(404, "EntryNotFound")
                headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                           "Accept-Ranges": "bytes"}
                start = 0
                if body and (r := re.match(r"bytes=(\d+)-$", self.headers.get("Range") or "")):
                    start = int(r[1])
                    headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                cut = state.cut_once.pop(m[3], None) if body else None
                self._send(206 if start else 200, data[start:], headers, body, cut)
            else:
                self._error(404, "NotFound")

        def _send(self, status, payload, headers, body, cut=None):
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if body and cut is not None:  # the connection drops mid-body: the client sees a short read
                self.wfile.write(payload[:cut])
                self.wfile.flush()
                self.close_connection = True
            elif body:
                self.wfile.write(payload)

    return Handler


class HubServer:
    """with HubServer(state) as url: ... (serving on 127.0.0.1 on a free port, in a thread)."""

    def __init__(self, state: HubState):
        self.state = state
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
