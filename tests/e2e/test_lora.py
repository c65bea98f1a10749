"""LoRA adapters through the whole stack: served by model name (STREAMQ_LORA_MODULES, and loaded
at run time through /v1/load_lora_adapter), listed by /v1/models, run in one batch with the base
model, each request's tokens those of peft's merged model; and kept to their tenants."""
from __future__ import annotations

import subprocess
import sys
import threading

import httpx
import pytest

from api.admin.answers import AdapterLoaded, AdapterUnloaded
from api.openai.answers import Completion, ModelList
from shared.tokenizer import Tokenizer
from streamq.testing.lora_adapters import make_adapter, merged_greedy
from shared.messages import RequestStatus
from tests.stack import ROOT, Stack, hold_mid_stream
from tests.waiting import until_sync

NEW = 16
PROMPT = "the capital of France is Paris and once upon a time"


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora-e2e")
    return {"qv": make_adapter(tiny_llama, root / "qv", r=4, modules=["q_proj", "v_proj"], seed=1),
            "all": make_adapter(tiny_llama, root / "all", r=8, seed=2),
            "late": make_adapter(tiny_llama, root / "late", r=2, seed=3)}


@pytest.fixture(scope="module")
def lora_stack(redis_url, tiny_llama, adapters, tmp_path_factory):
    # A long heartbeat TTL: a worker paused by a test stays live, its adapters accepted meanwhile.
    env = {"STREAMQ_LORA_MODULES": f"qv={adapters['qv']},all={adapters['all']}", "STREAMQ_HEARTBEAT_INTERVAL_S": "0.25",
           "STREAMQ_HEARTBEAT_TTL_S": "120"}
    with Stack(redis_url, tiny_llama, tmp_path_factory.mktemp("lora-stack"), env=env) as stack:
        yield stack


def _completion(url: str, model: str, headers: dict | None = None) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers or {}, timeout=120)


def _models(url: str, headers: dict | None = None) -> dict:
    return {m["id"]: m for m in httpx.get(f"{url}/v1/models", headers=headers or {}, timeout=30).json()["data"]}


def test_adapters_and_the_base_in_one_batch_give_each_its_merged_models_text(lora_stack, tiny_llama, adapters):
    url, base = lora_stack.urls[0], lora_stack.model_name
    models = _models(url)
    assert models["qv"]["parent"] == base and models["all"]["parent"] == base and "late" not in models
    tok = Tokenizer(tiny_llama)
    ids = tok.encode(PROMPT)
    names = [base, "qv", "all", base, "qv", "all"]
    replies: dict[int, httpx.Response] = {}
    calls = [threading.Thread(target=lambda i=i, n=n: replies.__setitem__(i, _completion(url, n)))
             for i, n in enumerate(names)]
    for call in calls:
        call.start()
    for call in calls:
        call.join()
    for i, name in enumerate(names):
        body = replies[i].json()
        assert replies[i].status_code == 200, body
        want = merged_greedy(tiny_llama, adapters.get(name), ids, NEW)
        assert body["model"] == name and body["choices"][0]["text"] == tok.decode(want), name
    assert _completion(url, "nope").status_code == 404
    embed = httpx.post(f"{url}/v1/embeddings", json={"model": "qv", "input": "x"}, timeout=30)
    assert embed.status_code == 400 and "base models only" in embed.json()["error"]["message"]


def test_an_adapter_loaded_at_run_time_is_served_then_unloaded(lora_stack, tiny_llama, adapters):
    url = lora_stack.urls[0]
    bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such/folder"}, timeout=30)
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(adapters["late"])},
                        timeout=30)
    assert loaded.status_code == 200, loaded.text
    AdapterLoaded.model_validate(loaded.json())
    until_sync(lambda: "late" in _models(url), what="the workers list the adapter loaded at run time")
    listed = httpx.get(f"{url}/v1/models", timeout=30)
    ModelList.model_validate(listed.json())  # the base, its adapters
    assert not [path for path in adapters.values() if str(path) in listed.text]  # no folder shown, to anyone
    reply = _completion(url, "late")
    assert reply.status_code == 200, reply.text
    want = merged_greedy(tiny_llama, adapters["late"], Tokenizer(tiny_llama).encode(PROMPT), NEW)
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == Tokenizer(tiny_llama).decode(want)
    Completion.model_validate(reply.json())
    unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=30)
    assert unloaded.status_code == 200
    AdapterUnloaded.model_validate(unloaded.json())
    until_sync(lambda: "late" not in _models(url), what="the adapter gone from the list")
    assert _completion(url, "late").status_code == 404
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "qv"}, timeout=30)
    assert gone.status_code == 404  # a configured adapter stays with its workers


HELD = 48  # tokens of a request held mid-stream


def _load(url: str, name: str, path) -> None:
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, timeout=30)
    assert loaded.status_code == 200, loaded.text


def _hold(stack: Stack, name: str):
    """A native stream of adapter `name`, every worker paused while it runs (hold_mid_stream)."""
    body = {"model": name, "prompt": PROMPT, "max_tokens": HELD, "temperature": 0, "ignore_eos": True, "stream": True}
    return hold_mid_stream(stack, f"{stack.urls[0]}/v1/requests", body)


def _queue_completion(stack: Stack, name: str) -> tuple[threading.Thread, dict]:
    """A completion of adapter `name` sent while the workers are paused: back once it is in the queue."""
    reply: dict = {}
    call = threading.Thread(target=lambda: reply.__setitem__(0, _completion(stack.urls[0], name)))
    call.start()
    stack.wait_for_record(lambda r: r.status == RequestStatus.QUEUED)
    return call, reply


def _held_tokens(held) -> list[int]:
    return [e["data"]["token_id"] for e in held.events() if e["event"] == "token"]


def test_a_load_under_a_loaded_name_runs_the_new_weights_while_a_running_request_ends_on_the_old(
        lora_stack, tiny_llama, adapters):
    url, ids = lora_stack.urls[0], Tokenizer(tiny_llama).encode(PROMPT)
    text = {k: Tokenizer(tiny_llama).decode(merged_greedy(tiny_llama, adapters[k], ids, NEW)) for k in ("qv", "all")}
    _load(url, "again", adapters["qv"])
    until_sync(lambda: "again" in _models(url), what="the workers list the adapter")
    assert _completion(url, "again").json()["choices"][0]["text"] == text["qv"]
    held = _hold(lora_stack, "again")  # runs on the first load's weights, its worker paused
    _load(url, "again", adapters["all"])  # the same name, other weights
    call, reply = _queue_completion(lora_stack, "again")
    lora_stack.resume_workers()
    call.join(120)
    assert reply[0].status_code == 200 and reply[0].json()["choices"][0]["text"] == text["all"], reply[0].text
    assert _held_tokens(held) == merged_greedy(tiny_llama, adapters["qv"], ids, HELD)
    assert _completion(url, "again").json()["choices"][0]["text"] == text["all"]


def test_an_unload_lets_running_requests_end_and_ends_queued_ones_with_a_404(lora_stack, tiny_llama, adapters):
    url, ids = lora_stack.urls[0], Tokenizer(tiny_llama).encode(PROMPT)
    _load(url, "going", adapters["all"])
    until_sync(lambda: "going" in _models(url), what="the workers list the adapter")
    held = _hold(lora_stack, "going")  # it runs, its worker paused
    call, reply = _queue_completion(lora_stack, "going")  # it waits in the queue
    unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "going"}, timeout=30)
    assert unloaded.status_code == 200
    lora_stack.resume_workers()
    call.join(120)
    error = reply[0].json()["error"]
    assert reply[0].status_code == 404 and error["code"] == "model_not_found", reply[0].text
    assert "'going'" in error["message"] and "unloaded" in error["message"]
    assert _held_tokens(held) == merged_greedy(tiny_llama, adapters["all"], ids, HELD)  # the adapter's, to the end


def test_an_adapter_kept_to_its_tenants(redis_url, tiny_llama, adapters, tmp_path):
    env = {"STREAMQ_AUTH": "on", "STREAMQ_ENABLE_LORA": "true", "STREAMQ_HEARTBEAT_INTERVAL_S": "0.25"}
    with Stack(redis_url, tiny_llama, tmp_path, env=env) as stack:
        def key(tenant: str) -> dict:
            out = subprocess.run([sys.executable, "-m", "streamq.cli", "keys", "create", "--tenant", tenant], cwd=ROOT,
                                 env=stack.env, capture_output=True, text=True, timeout=60, check=True).stdout
            return {"Authorization": f"Bearer {out.strip()}"}
        admin, acme, other = key("admin"), key("acme"), key("other")
        url = stack.urls[0]
        body = {"lora_name": "acme-only", "lora_path": str(adapters["all"]), "tenants": ["acme"]}
        assert httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=acme, timeout=30).status_code == 403
        assert httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=admin, timeout=30).status_code == 200
        until_sync(lambda: "acme-only" in _models(url, acme), what="the adapter listed for its tenant")
        assert "acme-only" not in _models(url, other)
        assert _completion(url, "acme-only", acme).status_code == 200
        refused = _completion(url, "acme-only", other)
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
