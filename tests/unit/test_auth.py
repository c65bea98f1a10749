import pytest

from api.core.auth import auth_enabled


@pytest.mark.parametrize("mode,host,expected", [
    ("auto", "127.0.0.1", False), ("auto", "localhost", False), ("auto", "::1", False),
    ("auto", "0.0.0.0", True), ("auto", "10.1.2.3", True), ("auto", "api.example", True),
    ("on", "127.0.0.1", True), ("off", "0.0.0.0", False),
])
def test_auth_is_on_beyond_loopback_unless_turned_off(mode, host, expected):
    assert auth_enabled(mode, host) is expected
