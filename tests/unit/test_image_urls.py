"""Image URLs fetched for allowed hosts only (api/core/image_urls.py): the checks on the host, its
addresses and every redirect, the size cap, and the connection made to the checked address. The
network is a stand-in (httpx.MockTransport) and so is the resolver: they see what the fetch asks."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from api.core.errors import ApiError
from api.core.image_urls import AllowedHosts, fetch, public
from streamq.testing.tiny_vision import png

PICTURE = png(1)
DNS = {"images.test": ["93.184.216.34"], "cdn.images.test": ["93.184.216.35"], "inside.images.test": ["10.0.0.5"],
       "meta.images.test": ["169.254.169.254"], "mixed.images.test": ["93.184.216.36", "127.0.0.1"],
       "v6.images.test": ["::1"], "mapped.images.test": ["::ffff:127.0.0.1"], "evil.test": ["93.184.216.37"]}


async def resolver(host: str, port: int) -> list[str]:
    if host not in DNS:
        raise OSError("no such host")
    return DNS[host]


def routes(seen: list[httpx.Request]):
    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        host, path = request.headers["host"], request.url.path
        if path == "/cat.png":
            return httpx.Response(200, content=PICTURE, headers={"content-type": "image/png"})
        if path == "/to-inside":
            return httpx.Response(302, headers={"location": "http://inside.images.test/cat.png"})
        if path == "/to-meta":
            return httpx.Response(301, headers={"location": "http://169.254.169.254/latest/meta-data"})
        if path == "/to-cdn":
            return httpx.Response(302, headers={"location": "https://cdn.images.test/cat.png"})
        if path == "/loop":
            return httpx.Response(302, headers={"location": f"http://{host}/loop"})
        if path == "/big":
            return httpx.Response(200, content=b"\x89PNG" + bytes(5000))
        if path == "/missing":
            return httpx.Response(404)
        raise AssertionError(path)
    return handle


def get(url: str, hosts: str = "images.test,*.images.test", max_bytes: int = 4096) -> tuple[bytes, list]:
    seen: list[httpx.Request] = []
    data = asyncio.run(fetch(url, "image 1", AllowedHosts(hosts), max_bytes, 5.0, "messages", resolver,
                             httpx.MockTransport(routes(seen))))
    return data, seen


def test_an_allowed_host_is_fetched_from_its_checked_address():
    data, seen = get("http://images.test/cat.png", max_bytes=len(PICTURE))
    assert data == PICTURE
    [request] = seen
    assert request.url.host == "93.184.216.34" and request.headers["host"] == "images.test"
    assert request.extensions["sni_hostname"] == "images.test"


def test_a_redirect_to_another_allowed_host_is_followed_and_checked():
    data, seen = get("http://images.test/to-cdn", max_bytes=len(PICTURE))
    assert data == PICTURE and [r.url.host for r in seen] == ["93.184.216.34", "93.184.216.35"]
    assert seen[1].url.scheme == "https" and seen[1].extensions["sni_hostname"] == "cdn.images.test"


@pytest.mark.parametrize("url, hosts, status, says", [
    ("http://images.test/cat.png", "", 400, "not fetched"),
    ("http://evil.test/cat.png", "images.test", 400, "not among"),
    ("http://127.0.0.1/cat.png", "images.test", 400, "not among"),
    ("http://169.254.169.254/latest/meta-data", "*.images.test", 400, "not among"),
    ("http://inside.images.test/cat.png", "*.images.test", 400, "not public"),
    ("http://meta.images.test/cat.png", "*.images.test", 400, "not public"),
    ("http://mixed.images.test/cat.png", "*.images.test", 400, "not public"),
    ("http://v6.images.test/cat.png", "*.images.test", 400, "not public"),
    ("http://mapped.images.test/cat.png", "*.images.test", 400, "not public"),
    ("http://nowhere.images.test/cat.png", "*.images.test", 400, "does not resolve"),
    ("http://images.test/to-inside", "images.test,*.images.test", 400, "not public"),
    ("http://images.test/to-meta", "images.test", 400, "not among"),
    ("http://images.test/loop", "images.test", 400, "redirects"),
    ("http://images.test/big", "images.test", 413, "larger than"),
    ("http://images.test/missing", "images.test", 400, "HTTP 404"),
    ("ftp://images.test/cat.png", "images.test", 400, "no http(s) URL"),
    ("http://user:pw@images.test/cat.png", "images.test", 400, "user name"),
])
def test_a_url_that_could_reach_inside_is_refused(url, hosts, status, says):
    with pytest.raises(ApiError) as refused:
        get(url, hosts)
    assert refused.value.status == status and says in refused.value.message and "image 1" in refused.value.message


@pytest.mark.parametrize("address, ok", [("93.184.216.34", True), ("2606:2800:220:1::1", True), ("10.1.2.3", False),
                                         ("192.168.0.1", False), ("172.16.0.1", False), ("100.64.0.1", False),
                                         ("169.254.169.254", False), ("fe80::1", False), ("fd00::1", False),
                                         ("224.0.0.1", False), ("0.0.0.0", False), ("::ffff:10.0.0.1", False)])
def test_only_public_addresses_are_public(address, ok):
    assert public(address) is ok


def test_the_allow_list_takes_names_and_subdomains():
    hosts = AllowedHosts(" Images.Test , *.cdn.example ")
    assert hosts.allows("images.test") and hosts.allows("a.cdn.example") and hosts.allows("x.y.cdn.example")
    assert not hosts.allows("cdn.example") and not hosts.allows("images.test.evil") and not AllowedHosts("")
