import pytest

from api.core.auth import auth_enabled


@pytest.mark.parametrize("mode,host,expected", [
    ("auto", "127.0.0.1", False), ("auto", "localhost", False), ("auto", "::1", False),
    ("auto", "0.0.0.0", True), ("auto", "10.1.2.3", True), ("auto", "api.example", True),
    ("on", "127.0.0.1", True), ("off", "0.0.0.0", False),
])
def test_auth_is_on_beyond_loopback_unless_turned_off(mode, host, expected):
    assert auth_enabled(mode, host) is expected


def test_the_api_description_is_served_without_a_key():
    """/openapi.json, /docs (Swagger UI) and /redoc (ReDoc): pages without data, open with keys on
    (docs/security.md), as the README points at them."""
    from fastapi.testclient import TestClient

    from api.app import create_app
    from shared.settings import ApiSettings

    client = TestClient(create_app(ApiSettings(_env_file=None, auth="on")),  # no lifespan: no Redis needed
                        base_url="http://127.0.0.1:8000")
    assert client.get("/openapi.json").json()["info"]["title"] == "streamq"
    for page in ("/docs", "/redoc"):
        answer = client.get(page)
        assert answer.status_code == 200 and "/openapi.json" in answer.text, page


def _keys_off_app(hosts: str):
    """An app with keys off whose replica holds no Redis: the operator's check answers before any is needed."""
    from types import SimpleNamespace

    from api.app import create_app
    from shared.settings import ApiSettings

    settings = ApiSettings(_env_file=None, allowed_hosts=hosts)
    app = create_app(settings)  # no lifespan: no Redis
    app.state.replica = SimpleNamespace(settings=settings, keys=None, store=None, models=None, model_name="m")
    return app


def test_with_keys_off_the_operators_routes_refuse_a_request_to_another_name():
    """An api that answers a non-loopback name with keys off (STREAMQ_AUTH=off, or a name allowed on
    loopback) keeps adapters and the cluster view to requests that name loopback."""
    from fastapi.testclient import TestClient

    client = TestClient(_keys_off_app("api.example,localhost"), base_url="http://api.example:8000")
    load = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/etc"})
    assert load.status_code == 403 and load.json()["error"]["code"] == "forbidden"
    assert "loopback" in load.json()["error"]["message"]
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 403
    cluster = client.get("/v1/cluster")
    assert cluster.status_code == 403 and "loopback" in cluster.json()["detail"]


@pytest.mark.parametrize("host,sees", [("localhost:8000", True), ("127.0.0.1", True), ("[::1]:8000", True),
                                       ("api.example:8000", False)])
async def test_with_keys_off_readyz_details_go_to_a_request_to_loopback_only(host, sees):
    from starlette.requests import Request

    from api.core.auth import sees_details

    app = _keys_off_app("*")
    request = Request({"type": "http", "headers": [(b"host", host.encode())], "app": app})
    assert await sees_details(request, app.state.replica) is sees
