"""A tiny in-memory Hugging Face Hub over real HTTP, for tests of the Hub resolution path.

It serves what the real huggingface_hub client asks for when resolving a model:
  GET  /api/models/{repo_id}[/revision/{revision}]      model info: id, sha, siblings
  HEAD /{repo_id}/resolve/{revision}/{filename}          file metadata (X-Repo-Commit, ETag, size)
  GET  /{repo_id}/resolve/{revision}/{filename}          file bytes
and answers unknown repositories, revisions and files with 404 and the X-Error-Code
the Hub sends, so the client raises its own error types. Every request is recorded
(method, path, headers) so a test can assert which files were fetched and which
token was sent. Binds 127.0.0.1 on a free port; nothing leaves the machine.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+(?:/[^/]+)?)(?:/revision/(?P<rev>[^/]+))?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+(?:/[^/]+)?)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]


@dataclass
class FakeHub:
    """Repositories as {repo_id: {sha: {filename: bytes}}} plus branch names pointing at SHAs."""

    commits: dict[str, dict[str, dict[str, bytes]]] = field(default_factory=dict)
    branches: dict[str, dict[str, str]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    unservable: set[str] = field(default_factory=set)  # listed in model info, 404 on download
    url: str = ""

    def add(self, repo_id: str, files: dict[str, bytes], branch: str = "main") -> str:
        """Publish files as a new commit on branch; returns its 40-hex SHA."""
        digest = hashlib.sha1(repr((repo_id, branch, sorted(files.items()))).encode()).hexdigest()
        self.commits.setdefault(repo_id, {})[digest] = dict(files)
        self.branches.setdefault(repo_id, {})[branch] = digest
        return digest

    def fetched(self) -> list[str]:
        """File names downloaded with GET (HEAD metadata calls excluded)."""
        return [
            unquote(m["file"])
            for r in self.requests
            if r.method == "GET" and (m := _RESOLVE.match(r.path))
        ]

    def touched(self) -> list[str]:
        """File names the client asked about at all (HEAD or GET), each once, in order."""
        names = [unquote(m["file"]) for r in self.requests if (m := _RESOLVE.match(r.path))]
        return list(dict.fromkeys(names))

    def _lookup(self, repo: str, rev: str) -> tuple[str | None, dict | None, str | None]:
        """(sha, files, error): error is the X-Error-Code for an unknown repo or revision."""
        if repo not in self.commits:
            return None, None, "RepoNotFound"
        sha = self.branches[repo].get(rev, rev)
        if sha not in self.commits[repo]:
            return None, None, "RevisionNotFound"
        return sha, self.commits[repo][sha], None


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # keep pytest output clean
            pass

        def do_GET(self) -> None:
            self._serve(body=True)

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def _serve(self, body: bool) -> None:
            path = urlsplit(self.path).path
            headers = {k.lower(): v for k, v in self.headers.items()}
            hub.requests.append(Request(self.command, path, headers))
            if (m := _INFO.match(path)) and self.command == "GET":
                self._model_info(unquote(m["repo"]), unquote(m["rev"] or "main"))
            elif m := _RESOLVE.match(path):
                self._file(unquote(m["repo"]), unquote(m["rev"]), unquote(m["file"]), body)
            else:
                self._send(404, b'{"error": "not found"}', {})

        def _model_info(self, repo: str, rev: str) -> None:
            sha, files, error = hub._lookup(repo, rev)
            if error:
                self._send(404, json.dumps({"error": error}).encode(), {"X-Error-Code": error})
                return
            info = {"id": repo, "sha": sha, "siblings": [{"rfilename": n} for n in sorted(files)]}
            self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"})

        def _file(self, repo: str, rev: str, name: str, body: bool) -> None:
            sha, files, error = hub._lookup(repo, rev)
            if error:
                self._send(404, b"", {"X-Error-Code": error}, body)
            elif name not in files or name in hub.unservable:
                self._send(404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": sha}, body)
            else:
                data = files[name]
                # The client needs the commit and an ETag (its blob name in the cache).
                headers = {
                    "X-Repo-Commit": sha,
                    "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                    "Content-Type": "application/octet-stream",
                }
                self._send(200, data, headers, body)

        def _send(
            self, status: int, data: bytes, headers: dict[str, str], body: bool = True
        ) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

    return Handler


class HubServer:
    """Context manager: starts a FakeHub on 127.0.0.1 in a daemon thread, stops it on exit."""

    def __init__(self) -> None:
        self.hub = FakeHub()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self.hub))
        self.hub.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        # A short poll interval: shutdown() waits for it, once per test.
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.02,), daemon=True
        )

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self.hub

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


@contextmanager
def serving(monkeypatch, tmp_path):
    """A running FakeHub with the environment the client reads pointed at it.

    HF_ENDPOINT and HF_HOME are read by resolve() at call time. huggingface_hub's
    constants were frozen when it was first imported, so two are set there too:
    telemetry off (with it on, the client asks the frozen endpoint, possibly the
    real Hub, for its agent-harness registry) and offline mode off.
    """
    from huggingface_hub import constants

    with HubServer() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
        # A suite may run offline (HF_HUB_OFFLINE=1) for everything else; this Hub is local.
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_CACHE", "HF_HUB_OFFLINE"):
            monkeypatch.delenv(name, raising=False)
        yield hub


# ---- tiny checkpoint files, shared by the local and Hub tests ----


def tokenizer_json() -> bytes:
    """A valid tokenizers JSON (WordLevel over a few words)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "hello": 1, "world": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str().encode()


def safetensors_bytes(name: str = "model.embed_tokens.weight") -> bytes:
    """A small safetensors file holding one tensor."""
    import torch
    from safetensors.torch import save

    return save({name: torch.zeros(4, 2)})


def config_json(model_type: str | None = "llama", **extra) -> bytes:
    config = {
        "model_type": model_type,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "vocab_size": 4,
        **extra,
    }
    return json.dumps(config).encode()
