"""API keys and ownership across two replicas, with keys made by `streamq keys`."""
import subprocess
import sys

import httpx
import pytest

from tests.stack import ROOT, Stack


@pytest.fixture(scope="module")
def secured(redis_url, tiny_llama, tmp_path_factory):
    with Stack(redis_url, tiny_llama, tmp_path_factory.mktemp("auth"), replicas=2,
               env={"STREAMQ_AUTH": "on"}) as stack:
        yield stack


def keys_cli(stack, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "streamq.cli", "keys", *args], cwd=ROOT, env=stack.env,
                          capture_output=True, text=True, timeout=60)


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


def test_requests_need_a_key(secured):
    api = secured.urls[0]
    with httpx.Client(timeout=30) as client:
        native = client.post(f"{api}/v1/requests", json={"prompt": "x", "max_tokens": 2})
        assert native.status_code == 401 and native.headers["WWW-Authenticate"] == "Bearer"
        chat = client.post(f"{api}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                           headers=bearer("sq-wrong"))
        assert chat.status_code == 401 and chat.json()["error"]["code"] == "invalid_api_key"
        assert client.get(f"{api}/healthz").status_code == 200  # health needs no key
        # pages without data are open (docs/security.md): the playground asks for the key
        for path in ("/", "/docs", "/redoc", "/openapi.json"):
            assert client.get(f"{api}{path}").status_code == 200, path
        for path in ("/v1/models", "/v1/cluster"):
            assert client.get(f"{api}{path}").status_code == 401, path


def test_the_operators_routes_and_readyz_details_take_the_admin_tenants_key(secured):
    """Adapters, the cluster view and /readyz's workers (hosts, plans) are the operator's: the admin
    tenant's key (STREAMQ_ADMIN_TENANT) gets them, another key 403 (readyz: the status alone)."""
    api = secured.urls[1]
    admin = bearer(keys_cli(secured, "create", "--tenant", "admin").stdout.strip())
    user = bearer(keys_cli(secured, "create", "--tenant", "mallory").stdout.strip())
    body = {"lora_name": "x", "lora_path": "/no/such/folder"}
    with httpx.Client(timeout=30) as client:
        for who in ({}, user):
            assert client.get(f"{api}/readyz", headers=who).json() == {"status": "ready"}
        assert client.get(f"{api}/readyz", headers=bearer("sq-wrong")).status_code == 401
        ready = client.get(f"{api}/readyz", headers=admin).json()
        assert ready["model"] == secured.model_name and "plan" in ready["workers"][0]
        cluster = client.get(f"{api}/v1/cluster", headers=user)
        assert cluster.status_code == 403 and "'admin'" in cluster.json()["detail"]
        refused = client.post(f"{api}/v1/load_lora_adapter", json=body, headers=user)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden"
        assert client.post(f"{api}/v1/unload_lora_adapter", json={"lora_name": "x"}, headers=user).status_code == 403
        assert [w["worker"] for w in client.get(f"{api}/v1/cluster", headers=admin).json()["workers"]] == \
            [w["worker"] for w in ready["workers"]]
        tried = client.post(f"{api}/v1/load_lora_adapter", json=body, headers=admin)  # past the check: the folder
        assert tried.status_code == 400 and "adapter_config.json" in tried.json()["error"]["message"]


def test_anthropic_clients_send_their_key_as_x_api_key(secured):
    import anthropic

    key = keys_cli(secured, "create", "--tenant", "claude").stdout.strip()
    client = anthropic.Anthropic(base_url=secured.urls[0], api_key=key, max_retries=0, timeout=60)
    message = client.messages.create(model=secured.model_name, max_tokens=3,
                                     messages=[{"role": "user", "content": "x"}])
    assert message.type == "message" and message.usage.output_tokens <= 3
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic.Anthropic(base_url=secured.urls[0], api_key="sq-wrong", max_retries=0).messages.create(
            model=secured.model_name, max_tokens=3, messages=[{"role": "user", "content": "x"}])
    assert refused.value.body["error"]["type"] == "authentication_error"


def test_metrics_need_a_key_like_every_route_but_health(secured):
    api = secured.urls[0]
    key = keys_cli(secured, "create", "--tenant", "prometheus").stdout.strip()
    with httpx.Client(timeout=30) as client:
        refused = client.get(f"{api}/metrics")
        assert refused.status_code == 401 and refused.headers["WWW-Authenticate"] == "Bearer"
        assert client.get(f"{api}/metrics", headers=bearer("sq-wrong")).status_code == 401
        scraped = client.get(f"{api}/metrics", headers=bearer(key))
        assert scraped.status_code == 200 and "streamq:api_requests_total" in scraped.text
        assert client.get(f"{api}/readyz").status_code == 200  # readiness needs no key


def test_a_request_is_visible_only_to_its_tenant_on_every_replica(secured):
    first, second = secured.urls
    alice = keys_cli(secured, "create", "--tenant", "alice").stdout.strip()
    bob = keys_cli(secured, "create", "--tenant", "bob", "--name", "bob's laptop").stdout.strip()
    with httpx.Client(timeout=30) as client:
        rid = client.post(f"{first}/v1/requests", json={"prompt": "mine", "max_tokens": 3},
                          headers=bearer(alice)).json()["id"]
        assert client.get(f"{second}/v1/requests/{rid}", headers=bearer(alice)).status_code == 200
        for url in (first, second):
            assert client.get(f"{url}/v1/requests/{rid}", headers=bearer(bob)).status_code == 404
            assert client.get(f"{url}/v1/requests/{rid}/events", headers=bearer(bob)).status_code == 404
            assert client.delete(f"{url}/v1/requests/{rid}", headers=bearer(bob)).status_code == 404
        # Exactly as for an id that does not exist.
        ghost = client.get(f"{second}/v1/requests/1b0c2a8e-1111-4222-8333-444455556666", headers=bearer(bob))
        mine = client.get(f"{second}/v1/requests/{rid}", headers=bearer(bob))
        assert ghost.json()["detail"].startswith("no request") and mine.json()["detail"].startswith("no request")
        listed = keys_cli(secured, "list").stdout
        assert "tenant=alice" in listed and "bob's laptop" in listed and alice not in listed


def test_a_stored_response_is_visible_only_to_its_tenant(secured):
    """Another tenant's response id answers exactly as an unknown one, for every Responses call."""
    first, second = secured.urls
    erin = keys_cli(secured, "create", "--tenant", "erin").stdout.strip()
    frank = keys_cli(secured, "create", "--tenant", "frank").stdout.strip()
    with httpx.Client(timeout=30) as client:
        created = client.post(f"{first}/v1/responses", json={"input": "mine", "max_output_tokens": 3},
                              headers=bearer(erin))
        rid = created.json()["id"]
        assert client.get(f"{second}/v1/responses/{rid}", headers=bearer(erin)).json()["id"] == rid
        for path in (rid, "resp_0123456789abcdef0123456789abcdef"):
            calls = [client.get(f"{second}/v1/responses/{path}", headers=bearer(frank)),
                     client.get(f"{second}/v1/responses/{path}/input_items", headers=bearer(frank)),
                     client.post(f"{second}/v1/responses/{path}/cancel", headers=bearer(frank)),
                     client.delete(f"{second}/v1/responses/{path}", headers=bearer(frank)),
                     client.post(f"{second}/v1/responses", headers=bearer(frank),
                                 json={"input": "x", "previous_response_id": path})]
            assert [c.status_code for c in calls] == [404] * 5
            assert all(c.json()["error"]["code"] == "not_found" for c in calls)
        assert client.get(f"{first}/v1/responses/{rid}", headers=bearer(erin)).status_code == 200


def test_a_revoked_key_stops_working_on_every_replica_at_once(secured):
    key = keys_cli(secured, "create", "--tenant", "carol").stdout.strip()
    with httpx.Client(timeout=30) as client:
        for url in secured.urls:
            assert client.get(f"{url}/v1/models", headers=bearer(key)).status_code == 200
        assert keys_cli(secured, "revoke", key).returncode == 0
        for url in secured.urls:
            assert client.get(f"{url}/v1/models", headers=bearer(key)).status_code == 401


def test_tenant_limits_apply_across_replicas(secured):
    key = keys_cli(secured, "create", "--tenant", "dave").stdout.strip()
    assert keys_cli(secured, "limits", "--tenant", "dave", "--rpm", "2").returncode == 0
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    with httpx.Client(timeout=30) as client:
        codes = [client.post(f"{url}/v1/chat/completions", json=body, headers=bearer(key)).status_code
                 for url in secured.urls]
        assert codes == [200, 200]
        limited = client.post(f"{secured.urls[0]}/v1/chat/completions", json=body, headers=bearer(key))
        assert limited.status_code == 429 and int(limited.headers["Retry-After"]) >= 1
        assert limited.json()["error"]["type"] == "rate_limit_error"
        assert "requests per minute" in limited.json()["error"]["message"]


def test_each_tenant_and_priority_has_its_own_lane_with_the_tenants_weight(secured):
    import redis

    from shared import redis_keys
    from shared.messages import RequestPayload

    key = keys_cli(secured, "create", "--tenant", "erin").stdout.strip()
    assert keys_cli(secured, "limits", "--tenant", "erin", "--weight", "2.5").returncode == 0
    with httpx.Client(timeout=30) as client:
        reply = client.post(f"{secured.urls[1]}/v1/completions", headers=bearer(key), json={
            "model": secured.model_name, "prompt": "x", "max_tokens": 2, "priority": -3})
        assert reply.status_code == 200, reply.text
        bad = client.post(f"{secured.urls[0]}/v1/requests", headers=bearer(key),
                          json={"prompt": "x", "priority": 99})
        assert bad.status_code == 422 and "priority" in bad.text
    with redis.Redis.from_url(secured.env["REDIS_URL"], decode_responses=True) as client:
        assert "-3:erin" in client.smembers(redis_keys.request_lanes(secured.prefix, secured.model_name))
        [(_, fields)] = client.xrange(redis_keys.request_stream(secured.prefix, secured.model_name, "-3:erin"))
    payload = RequestPayload.model_validate_json(fields["payload"])
    assert (payload.tenant, payload.priority, payload.weight) == ("erin", -3, 2.5)


def test_one_tenants_cached_prefix_is_not_another_tenants(secured):
    """The prefix cache and the KV tier key a prompt's blocks in its tenant's space: tenant B sending
    tenant A's prompt is told cached_tokens 0 (and computes it), then hits its own copy."""
    api = secured.urls[0]
    alice = bearer(keys_cli(secured, "create", "--tenant", "alice").stdout.strip())
    bob = bearer(keys_cli(secured, "create", "--tenant", "bob").stdout.strip())
    prompt = " ".join(f"word{i}" for i in range(40))  # several full blocks, inside the tiny model's context
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}

    def cached(who) -> int:
        reply = client.post(f"{api}/v1/completions", json=body, headers=who)
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    with httpx.Client(timeout=60) as client:
        assert cached(alice) == 0
        assert cached(alice) > 0  # her own prefix, cached
        assert cached(bob) == 0  # the same prompt: nothing of hers
        assert cached(bob) > 0


def test_a_tenant_uses_the_service_tiers_it_was_given(secured):
    """Priority is granted (`streamq keys limits --tiers`); auto is the tenant's own tier."""
    api = secured.urls[0]
    plain = bearer(keys_cli(secured, "create", "--tenant", "plain").stdout.strip())
    gold = bearer(keys_cli(secured, "create", "--tenant", "gold").stdout.strip())
    granted = keys_cli(secured, "limits", "--tenant", "gold", "--tiers", "priority,flex", "--auto-tier", "priority")
    assert granted.returncode == 0, granted.stderr
    assert keys_cli(secured, "limits", "--tenant", "x", "--tiers", "gold").returncode == 2  # no such tier
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with httpx.Client(timeout=120) as client:
        def tier(who, **extra):
            reply = client.post(f"{api}/v1/chat/completions", json={**chat, **extra}, headers=who)
            return reply.json()["service_tier"] if reply.status_code == 200 else (reply.status_code, reply.json())
        assert [tier(plain), tier(plain, service_tier="flex")] == ["default", "flex"]
        status, body = tier(plain, service_tier="priority")
        assert status == 403 and body["error"]["param"] == "service_tier", body
        assert [tier(gold), tier(gold, service_tier="auto"), tier(gold, service_tier="flex")] == \
            ["priority", "priority", "flex"]
        status, body = tier(gold, service_tier="default")
        assert status == 403 and "priority, flex" in body["error"]["message"], body
