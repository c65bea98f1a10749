"""The Host allow-list (api/core/hosts.py): loopback names on loopback, any name beyond it, and a
400 in the path's family's error body for any other Host."""
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.core.hosts import allowed_names, allows, host_name
from shared.settings import ApiSettings
from streamq.serve import _replica_hosts


def _app(**settings):
    return create_app(ApiSettings(_env_file=None, **settings))  # no lifespan: no Redis needed


@pytest.mark.parametrize("header,name", [
    ("localhost:8000", "localhost"), ("LOCALHOST", "localhost"), ("127.0.0.1:80", "127.0.0.1"),
    ("[::1]:8000", "[::1]"), ("[::1]", "[::1]"), ("evil.example", "evil.example"), ("a:b", "a:b"), ("", ""),
])
def test_the_host_headers_name_is_read_without_its_port(header, name):
    assert host_name(header) == name


@pytest.mark.parametrize("setting,bind,names", [
    ("auto", "127.0.0.1", ("localhost", "127.0.0.1", "[::1]")), ("auto", "localhost", ("localhost", "127.0.0.1", "[::1]")),
    ("auto", "::1", ("localhost", "127.0.0.1", "[::1]")), ("auto", "0.0.0.0", ("*",)), ("auto", "10.1.2.3", ("*",)),
    ("API.example, *.example.org", "127.0.0.1", ("api.example", "*.example.org")), ("[::1]", "0.0.0.0", ("[::1]",)),
])
def test_the_default_is_loopback_names_on_loopback_and_any_name_beyond(setting, bind, names):
    assert allowed_names(setting, bind) == names


@pytest.mark.parametrize("setting", ["api.example:8000", "::1", "a,,b", "a b"])
def test_a_name_that_can_never_match_stops_the_api_at_start(setting):
    with pytest.raises(ValueError, match="STREAMQ_ALLOWED_HOSTS"):
        _app(allowed_hosts=setting)


def test_a_wildcard_matches_subdomains_only():
    names = ("*.example.org",)
    assert allows(names, "api.example.org") and not allows(names, "example.org")
    assert not allows(names, "evil-example.org")


@pytest.mark.parametrize("host", ["localhost:8000", "127.0.0.1:8000", "[::1]:8000", "localhost"])
def test_a_loopback_api_answers_its_loopback_names(host):
    client = TestClient(_app(), base_url=f"http://{host}")
    assert client.get("/healthz").status_code == 200


def test_a_loopback_api_refuses_another_host_on_every_route_in_its_familys_body():
    """A DNS-rebinding page's requests carry its own name: refused before any route, the adapter
    routes included, with a body that says what to change."""
    client = TestClient(_app(), base_url="http://evil.example:8000")
    health = client.get("/healthz")
    assert health.status_code == 400 and "'evil.example:8000'" in health.json()["detail"]
    assert "STREAMQ_ALLOWED_HOSTS" in health.json()["detail"]
    for path in ("/v1/load_lora_adapter", "/v1/chat/completions"):
        refused = client.post(path, json={"lora_name": "x", "lora_path": "/tmp"})
        assert refused.status_code == 400 and "evil.example" in refused.json()["error"]["message"], path
    refused = client.post("/v1/messages", json={})
    assert refused.status_code == 400 and refused.json()["type"] == "error"


def test_named_hosts_are_answered_and_others_refused():
    app = _app(allowed_hosts="api.example,*.corp.example")
    assert TestClient(app, base_url="http://api.example:8000").get("/healthz").status_code == 200
    assert TestClient(app, base_url="http://gpu.corp.example").get("/healthz").status_code == 200
    assert TestClient(app, base_url="http://localhost:8000").get("/healthz").status_code == 400


def test_an_api_bound_beyond_loopback_answers_any_host():
    """Compose's and Kubernetes' health checks name the container by 127.0.0.1 or its pod address."""
    app = _app(host="0.0.0.0")
    for host in ("127.0.0.1:8000", "10.1.2.3:8000", "api:8000", "streamq.example.com"):
        assert TestClient(app, base_url=f"http://{host}").get("/healthz").status_code == 200, host


@pytest.mark.parametrize("env,host,setting", [
    ({}, "127.0.0.1", "auto"), ({}, "0.0.0.0", "*"), ({}, "::", "*"),
    ({"STREAMQ_ALLOWED_HOSTS": "api.example"}, "0.0.0.0", "api.example"),
])
def test_serves_replicas_behind_nginx_answer_the_hosts_nginx_listens_for(env, host, setting):
    """The replicas bind loopback, but nginx passes the client's Host on: `auto` follows nginx's address."""
    assert _replica_hosts(env, host) == setting
