"""STREAMQ_MODEL as users have it: a hub id, a hub repo's GGUF file, a local GGUF file.

A stand-in for the Hugging Face hub runs in a thread: the few endpoints huggingface_hub's
`model_info`, `snapshot_download` and `hf_hub_download` call. The api and the worker sides run as
separate processes (HF_ENDPOINT and the HF cache are read when huggingface_hub is imported), each
with a cache of its own, as on two machines, sharing the test's Redis.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from shared import hub_revision, model_paths, model_source
from shared.settings import CommonSettings
from shared.tokenizer import Tokenizer
from streamq.testing.tiny_models import write_tiny_gguf


class StandInHub:
    """Repos of files at commits, branches and tags naming commits, and a log of the requests."""

    def __init__(self):
        self.commits: dict[str, dict[str, dict[str, bytes]]] = {}  # repo -> commit -> path -> content
        self.refs: dict[str, dict[str, str]] = {}  # repo -> branch or tag -> commit
        self.requests: list[tuple[str, str, str | None]] = []  # method, path, Authorization
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def push(self, repo: str, files: dict[str, bytes], *refs: str) -> str:
        commit = hashlib.sha1(repr(sorted(files.items())).encode()).hexdigest()
        self.commits.setdefault(repo, {})[commit] = files
        for ref in refs:
            self.refs.setdefault(repo, {})[ref] = commit
        return commit

    def served(self, repo: str) -> list[str]:
        """The files of `repo` whose content was sent (GET of resolve)."""
        return [path.split("/resolve/", 1)[1].split("/", 1)[1] for method, path, _ in self.requests
                if method == "GET" and path.startswith(f"/{repo}/resolve/")]

    def _commit(self, repo: str, revision: str) -> str | None:
        if revision in self.commits.get(repo, {}):
            return revision
        return self.refs.get(repo, {}).get(revision)

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                self._answer(body=False)

            def do_GET(self):
                self._answer(body=True)

            def _send(self, status: int, content: bytes, headers: dict[str, str], body: bool):
                self.send_response(status)
                for name, value in {"Content-Length": str(len(content)), **headers}.items():
                    self.send_header(name, value)
                self.end_headers()
                if body:
                    self.wfile.write(content)

            def _error(self, code: str, body: bool):
                self._send(404, json.dumps({"error": code}).encode(), {"X-Error-Code": code}, body)

            def _answer(self, body: bool):
                path = unquote(urlsplit(self.path).path)
                hub.requests.append((self.command, path, self.headers.get("Authorization")))
                api = path.startswith("/api/models/")
                parts = path.removeprefix("/api/models/" if api else "/").split("/")
                repo, verb, revision, name = "/".join(parts[:2]), parts[2:3], parts[3:4], "/".join(parts[4:])
                if repo not in hub.commits:
                    return self._error("RepoNotFound", body)
                commit = hub._commit(repo, revision[0]) if revision else None
                if commit is None:
                    return self._error("RevisionNotFound", body)
                files = hub.commits[repo][commit]
                if api and verb == ["revision"]:
                    info = {"id": repo, "modelId": repo, "sha": commit, "private": False,
                            "siblings": [{"rfilename": f} for f in files]}
                    return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
                if api and verb == ["tree"]:
                    tree = [{"type": "file", "path": f, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                            for f, data in files.items()]
                    return self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, body)
                if not api and verb == ["resolve"]:
                    if name not in files:
                        return self._error("EntryNotFound", body)
                    etag = hashlib.sha256(files[name]).hexdigest()
                    return self._send(200, files[name], {"X-Repo-Commit": commit, "ETag": f'"{etag}"'}, body)
                self._error("EntryNotFound", body)
        return Handler

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub():
    with StandInHub() as running:
        yield running


def folder_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def with_context(files: dict[str, bytes], context: int) -> dict[str, bytes]:
    """The same model with another context length: another commit, told apart by the tokenizer."""
    config = json.loads(files["config.json"])
    return {**files, "config.json": json.dumps({**config, "max_position_embeddings": context}).encode()}


# Decoys a causal LM's download must leave on the hub.
DECOYS = {"pytorch_model.bin": b"old weights", "other.Q4_K_M.gguf": b"GGUF", "README.md": b"# tiny"}

SIDE = """
import json, sys
from shared import hub_revision, model_paths, model_source
from shared.settings import CommonSettings
settings = CommonSettings()
out = {call: str(getattr(model_paths, call)(settings)) for call in sys.argv[1:]}
out["heavy"] = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "safetensors"))
print(json.dumps(out))
"""


def side(env: dict[str, str], *calls: str) -> dict:
    """Run model_paths' `calls` in a process of its own with `env`; their results."""
    done = subprocess.run([sys.executable, "-c", SIDE, *calls], env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def env(hub, redis_url, prefix, tmp_path):
    """What a process of the deployment gets; `machine` gives each its own caches."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE", "STREAMQ_"))}

    def make(machine: str, **extra: str) -> dict[str, str]:
        return {**base, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / machine / "hf"),
                "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                "REDIS_URL": redis_url, "STREAMQ_PREFIX": prefix,
                "STREAMQ_MODEL_CACHE_DIR": str(tmp_path / machine / "models"), **extra}
    return make


def test_a_hub_id_downloads_what_a_causal_lm_needs_and_every_process_loads_one_commit(hub, env, tiny_llama):
    files = folder_files(tiny_llama)
    first = hub.push("org/tiny", {**files, **DECOYS}, "main")
    api = side(env("api", STREAMQ_MODEL="org/tiny"), "model_dir")
    assert Path(api["model_dir"]).name == first
    assert api["heavy"] == []  # the api's side: no torch, no transformers
    assert Tokenizer(api["model_dir"]).context_length == 256
    assert "model.safetensors" not in hub.served("org/tiny")  # the api fetched no weights
    later = hub.push("org/tiny", with_context(files, 128), "main")  # main moves on while the api runs

    worker = side(env("worker", STREAMQ_MODEL="org/tiny"), "weights_dir", "model_dir")
    assert Path(worker["weights_dir"]).name == Path(worker["model_dir"]).name == first
    assert sorted(p.name for p in Path(worker["weights_dir"]).iterdir()) == sorted(files)  # no decoys
    assert not set(DECOYS) & set(hub.served("org/tiny"))
    assert (Path(worker["weights_dir"]) / "model.safetensors").read_bytes() == files["model.safetensors"]

    # Another deployment (another prefix) resolves main afresh.
    other = side(env("other", STREAMQ_MODEL="org/tiny", STREAMQ_PREFIX="another"), "model_dir")
    assert Path(other["model_dir"]).name == later


def test_the_revision_setting_is_honoured(hub, env, tiny_llama):
    files = folder_files(tiny_llama)
    tagged = hub.push("org/tiny", with_context(files, 128), "v1")
    hub.push("org/tiny", files, "main")
    by_tag = side(env("a", STREAMQ_MODEL="org/tiny", STREAMQ_MODEL_REVISION="v1"), "model_dir")
    assert Path(by_tag["model_dir"]).name == tagged
    assert Tokenizer(by_tag["model_dir"]).context_length == 128
    seen = len(hub.requests)
    by_commit = side(env("b", STREAMQ_MODEL="org/tiny", STREAMQ_MODEL_REVISION=tagged), "weights_dir")
    assert Path(by_commit["weights_dir"]).name == tagged
    asked = {path.rsplit("/", 1)[1] for _, path, _ in hub.requests[seen:] if "/revision/" in path}
    assert asked <= {tagged}  # a commit needs no resolving


def test_hf_token_reaches_the_hub(hub, env, tiny_llama):
    hub.push("org/private", folder_files(tiny_llama), "main")
    side(env("a", STREAMQ_MODEL="org/private", HF_TOKEN="hf_standin_token"), "weights_dir")
    assert hub.requests
    assert {auth for _, _, auth in hub.requests} == {"Bearer hf_standin_token"}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("command", ["prepare-model", "api"])
def test_an_unreachable_hub_fails_the_start_with_one_clear_error(env, command):
    environment = env("offline", STREAMQ_MODEL="org/nowhere", HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}",
                      STREAMQ_PORT="0")
    done = subprocess.run([sys.executable, "-m", "streamq.cli", command], env=environment, capture_output=True,
                          text=True, timeout=400)
    assert done.returncode != 0
    assert "'org/nowhere'" in done.stderr and "out of reach" in done.stderr and "STREAMQ_MODEL" in done.stderr
    assert "Traceback" not in done.stderr


def test_with_the_hub_away_the_cache_serves_what_it_holds(hub, env, tiny_llama):
    commit = hub.push("org/tiny", folder_files(tiny_llama), "main")
    assert Path(side(env("a", STREAMQ_MODEL="org/tiny"), "model_dir")["model_dir"]).name == commit
    offline = env("a", STREAMQ_MODEL="org/tiny", STREAMQ_PREFIX="fresh", HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}")
    assert Path(side(offline, "model_dir")["model_dir"]).name == commit  # the revision from the cache's refs
    done = subprocess.run([sys.executable, "-c", SIDE, "weights_dir"], env=offline, capture_output=True, text=True,
                          timeout=400)
    assert done.returncode != 0 and "out of reach" in done.stderr  # the weights were never fetched here


def test_with_redis_away_a_process_resolves_the_revision_alone(hub, env, tiny_llama):
    commit = hub.push("org/tiny", folder_files(tiny_llama), "main")
    away = env("a", STREAMQ_MODEL="org/tiny", REDIS_URL=f"redis://127.0.0.1:{closed_port()}/0")
    done = subprocess.run([sys.executable, "-c", SIDE, "model_dir"], env=away, capture_output=True, text=True,
                          timeout=400)
    assert done.returncode == 0, done.stderr
    assert Path(json.loads(done.stdout.splitlines()[-1])["model_dir"]).name == commit
    assert "may not share" in done.stderr


def test_a_missing_repo_or_revision_is_named(hub, env, tiny_llama):
    hub.push("org/tiny", folder_files(tiny_llama), "main")
    for extra in ({"STREAMQ_MODEL": "org/absent"}, {"STREAMQ_MODEL": "org/tiny", "STREAMQ_MODEL_REVISION": "v9"}):
        done = subprocess.run([sys.executable, "-c", SIDE, "model_dir"], env=env("a", **extra),
                              capture_output=True, text=True, timeout=400)
        assert done.returncode != 0 and "ModelNotFound" in done.stderr
        assert "has no model" in done.stderr and extra["STREAMQ_MODEL"] in done.stderr


# -- GGUF ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama, tmp_path_factory) -> Path:
    return write_tiny_gguf(tiny_llama, tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf")


def test_a_gguf_file_is_enough(tiny_gguf, tiny_llama, tmp_path):
    settings = CommonSettings(model=str(tiny_gguf), model_cache_dir=tmp_path / "models")
    assert model_source.served_name(settings) == "tiny-llama.F32"
    assert model_paths.gguf_file(settings) == tiny_gguf
    folder = model_paths.prepare_model(settings, weights=False)
    assert folder == model_paths.model_dir(settings)
    tok, reference = Tokenizer(folder), Tokenizer(tiny_llama)
    text = "The capital of France is Paris. 안녕하세요 😀"
    assert tok.encode(text) == reference.encode(text)
    assert tok.decode(tok.encode(text)) == text
    chat = [{"role": "user", "content": "hi there"}]
    assert tok.render_chat(chat, add_generation_prompt=True) == reference.render_chat(chat, add_generation_prompt=True)
    assert tok.context_length == 256 and tok.eos_token_ids == {2}


def test_a_changed_gguf_file_is_read_again(tiny_llama, tmp_path):
    path = write_tiny_gguf(tiny_llama, tmp_path / "m.gguf", context=256)
    settings = CommonSettings(model=str(path), model_cache_dir=tmp_path / "models")
    first = model_paths.prepare_model(settings, weights=False)
    assert Tokenizer(first).context_length == 256
    before = path.stat().st_mtime_ns
    write_tiny_gguf(tiny_llama, tmp_path / "m.gguf", context=512)  # as large as before: its time tells
    os.utime(path, ns=(before + 10**9, before + 10**9))  # a coarse file clock could give the rewrite the same time
    second = model_paths.prepare_model(settings, weights=False)
    assert second != first and Tokenizer(second).context_length == 512


def test_a_gguf_file_is_dequantised_into_safetensors(tiny_gguf, tiny_llama, tmp_path):
    import torch
    from safetensors.torch import load_file

    settings = CommonSettings(model=str(tiny_gguf), model_cache_dir=tmp_path / "models")
    model_paths.prepare_model(settings)
    folder = model_paths.weights_dir(settings)
    tensors = load_file(folder / "model.safetensors")
    original = load_file(tiny_llama / "model.safetensors")
    assert torch.equal(tensors["model.embed_tokens.weight"], original["model.embed_tokens.weight"])
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 2
    assert (folder / "tokenizer.json").is_file()  # vLLM reads the tokenizer from the weights' folder


def test_a_hub_repos_gguf_file_is_the_one_file_downloaded(hub, env, tiny_gguf, tiny_llama):
    data = tiny_gguf.read_bytes()
    hub.push("org/tiny-GGUF", {"tiny.F32.gguf": data, "tiny.Q8_0.gguf": b"GGUF other", "README.md": b"#"}, "main")
    api = side(env("api", STREAMQ_MODEL="org/tiny-GGUF:tiny.F32.gguf"), "gguf_file", "model_dir")
    assert Path(api["gguf_file"]).read_bytes() == data
    assert hub.served("org/tiny-GGUF") == ["tiny.F32.gguf"]
    assert api["heavy"] == []  # the tokenizer was built in a child process
    tok, reference = Tokenizer(api["model_dir"]), Tokenizer(tiny_llama)
    assert tok.encode("Once upon a time") == reference.encode("Once upon a time")
    assert model_source.served_name(CommonSettings(model="org/tiny-GGUF:tiny.F32.gguf")) == "tiny.F32"


def test_of_two_first_processes_the_one_that_records_first_wins(redis_url, prefix, monkeypatch):
    """Both found no commit in Redis; the other recorded its answer while this one asked the hub."""
    import redis as sync_redis

    from shared import redis_keys
    key = redis_keys.model_commit(prefix, "org/tiny", "main")

    def resolve_while_another_records(repo: str, revision: str) -> str:
        sync_redis.Redis.from_url(redis_url).set(key, "b" * 40)
        return "a" * 40
    monkeypatch.setattr(hub_revision, "_resolve", resolve_while_another_records)
    settings = CommonSettings(model="org/tiny", redis_url=redis_url, prefix=prefix)
    assert hub_revision.hub_commit(settings, "org/tiny") == "b" * 40


def test_a_hub_sentence_transformers_repo_brings_its_modules(hub, env, tmp_path):
    """An embedding model's repo: the api side fetches its module configs (not its weights), the
    worker's its Dense layer's weights too; both read the same description of it."""
    pytest.importorskip("sentence_transformers")
    from shared.pooling_model import describe
    from streamq.testing.tiny_encoders import build_encoder

    folder = build_encoder(tmp_path / "st", "bert", pooling="cls", dense=[(16, "Tanh")],
                           prompts={"query": "query: "})
    files = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert "2_Dense/model.safetensors" in files and "1_Pooling/config.json" in files
    hub.push("org/embedder", files, "main")
    api = side(env("api", STREAMQ_MODEL="org/embedder"), "model_dir")
    assert api["heavy"] == []
    assert describe(Path(api["model_dir"])) == describe(folder)
    assert Tokenizer(api["model_dir"]).pooling.dense[0].out_features == 16
    assert not {"model.safetensors", "2_Dense/model.safetensors"} & set(hub.served("org/embedder"))
    worker = side(env("worker", STREAMQ_MODEL="org/embedder"), "weights_dir")
    weights = Path(worker["weights_dir"])
    assert (weights / "2_Dense" / "model.safetensors").read_bytes() == files["2_Dense/model.safetensors"]
    assert (weights / "model.safetensors").is_file()
