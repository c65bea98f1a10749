"""The Files API against a real Redis, with keys on and two tenants: each sees its own files only,
uploads are capped, and a batch is created from a tenant's own batch file only."""
import json

import pytest
from fastapi.testclient import TestClient
from redis import Redis

from api.app import create_app
from shared.api_keys import KeyStore
from shared.settings import ApiSettings
from shared.tokenizer import Tokenizer

LINE = {"custom_id": "q0", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a b", "max_tokens": 2}}


@pytest.fixture
async def keys(redis, prefix):
    store = KeyStore(redis, prefix)
    return {"a": await store.create("tenant-a"), "b": await store.create("tenant-b")}


@pytest.fixture
def client(redis_url, prefix, tiny_llama):
    settings = ApiSettings(_env_file=None, redis_url=redis_url, prefix=prefix, model=str(tiny_llama),
                           served_model_name="m", auth="on", files_max_bytes=4096, files_tenant_max_bytes=6000)
    with TestClient(create_app(settings, Tokenizer(tiny_llama)), base_url="http://127.0.0.1") as client:
        yield client


def _as(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _upload(client, key: str, content: bytes, purpose: str = "batch", name: str = "in.jsonl"):
    return client.post("/v1/files", files={"file": (name, content, "application/jsonl")}, data={"purpose": purpose},
                       headers=_as(key))


def test_a_tenants_file_is_its_own(client, keys):
    content = (json.dumps(LINE) + "\n").encode()
    made = _upload(client, keys["a"], content)
    assert made.status_code == 200, made.text
    stored = made.json()
    assert stored["object"] == "file" and stored["purpose"] == "batch" and stored["bytes"] == len(content)
    assert stored["filename"] == "in.jsonl" and stored["id"].startswith("file-")
    fid = stored["id"]
    assert client.get(f"/v1/files/{fid}", headers=_as(keys["a"])).json() == stored
    assert client.get(f"/v1/files/{fid}/content", headers=_as(keys["a"])).content == content
    listed = client.get("/v1/files", headers=_as(keys["a"])).json()
    assert [f["id"] for f in listed["data"]] == [fid] and listed["has_more"] is False
    # Tenant B: no such file, whatever it asks.
    for method, path in (("GET", f"/v1/files/{fid}"), ("GET", f"/v1/files/{fid}/content"),
                         ("DELETE", f"/v1/files/{fid}")):
        reply = client.request(method, path, headers=_as(keys["b"]))
        assert reply.status_code == 404, (method, path, reply.text)
        assert reply.json()["error"]["code"] == "not_found"
    assert client.get("/v1/files", headers=_as(keys["b"])).json()["data"] == []
    batch = client.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions"},
                        headers=_as(keys["b"]))
    assert batch.status_code == 404 and batch.json()["error"]["param"] == "input_file_id"
    # A's delete works once.
    assert client.delete(f"/v1/files/{fid}", headers=_as(keys["a"])).json() == {
        "id": fid, "object": "file", "deleted": True}
    assert client.get(f"/v1/files/{fid}", headers=_as(keys["a"])).status_code == 404


def test_uploads_are_checked_and_capped(client, keys):
    big = _upload(client, keys["a"], b"x" * 4097)
    assert big.status_code == 413 and "STREAMQ_FILES_MAX_BYTES" in big.json()["error"]["message"]
    assert _upload(client, keys["a"], b"{}", purpose="fine-tune").status_code == 400
    assert _upload(client, keys["a"], b"\xff\xfe").status_code == 400
    assert _upload(client, keys["a"], b"").status_code == 400
    # The tenant's bytes in all: a second 4000-byte file passes 6000.
    assert _upload(client, keys["a"], b"x" * 4000).status_code == 200
    full = _upload(client, keys["a"], b"x" * 4000)
    assert full.status_code == 413 and "STREAMQ_FILES_TENANT_MAX_BYTES" in full.json()["error"]["message"]
    assert _upload(client, keys["b"], b"x" * 4000).status_code == 200  # B's own allowance
    # An id not in the server's form is no file, answered without a lookup.
    for fid in ("FILE-0", "file-" + "A" * 32, " file-" + "0" * 32, "../x"):
        assert client.get(f"/v1/files/{fid}", headers=_as(keys["a"])).status_code == 404


def test_a_batch_file_is_read_line_by_line(client, keys):
    wrong_url = dict(LINE, url="/v1/chat/completions")
    for content, says in ((b"not json\n", "line 1"), ((json.dumps(LINE) + "\n" + json.dumps(wrong_url)).encode(),
                                                      "line 2"), (b"\n\n", "no requests")):
        fid = _upload(client, keys["a"], content).json()["id"]
        reply = client.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions"},
                            headers=_as(keys["a"]))
        assert reply.status_code == 400 and says in reply.json()["error"]["message"], reply.text
        client.delete(f"/v1/files/{fid}", headers=_as(keys["a"]))
    fid = _upload(client, keys["a"], (json.dumps(LINE) + "\n").encode()).json()["id"]
    both = client.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                            "requests": [{"custom_id": "x", "body": LINE["body"]}]},
                       headers=_as(keys["a"]))
    assert both.status_code in (400, 422)
    window = client.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                              "completion_window": "48h"}, headers=_as(keys["a"]))
    assert window.status_code in (400, 422)
    made = client.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                            "completion_window": "1h"}, headers=_as(keys["a"]))
    assert made.status_code == 200, made.text
    batch = made.json()
    assert batch["input_file_id"] == fid and batch["completion_window"] == "1h"
    assert batch["expires_at"] == batch["created_at"] + 3600 and batch["request_counts"]["total"] == 1
    assert client.get(f"/v1/batches/{batch['id']}", headers=_as(keys["b"])).status_code == 404


def test_files_are_kept_no_longer_than_their_lifetime(client, keys, redis_url, prefix):
    fid = _upload(client, keys["a"], b"{}\n").json()["id"]
    with Redis.from_url(redis_url, decode_responses=True) as redis:
        ttls = [redis.ttl(key) for key in redis.scan_iter(match=f"{prefix}:*file*")]
    assert ttls and all(0 < ttl <= ApiSettings.model_fields["files_ttl_s"].default for ttl in ttls), ttls
    assert client.get(f"/v1/files/{fid}", headers=_as(keys["a"])).json()["expires_at"] > 0
