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
