"""Images fetched from http(s) URLs, for hosts an operator allows (STREAMQ_IMAGE_URL_HOSTS; empty,
the default: no URL is fetched). A URL is a way into the server's network, so every fetch:
- names an allowed host (`images.example.com`, or `*.example.com` for its subdomains), over
  http or https on the URL's port;
- resolves the host once and goes on only if every address is a public one (not private,
  loopback, link-local such as 169.254.169.254, multicast, reserved or unspecified), then connects
  to that checked address itself, the host named in the Host header and TLS's server name, so a
  DNS answer that changes between the check and the connection (rebinding) reaches nothing else;
- follows at most MAX_REDIRECTS redirects, each one checked as the first URL was;
- reads at most the image byte cap, within a time cap for the whole fetch.
Each refusal is a 400 (413 past the byte cap) naming the image and why, never a 5xx.
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urljoin, urlsplit

import httpx

from api.core.errors import ApiError

MAX_REDIRECTS = 3
Resolve = Callable[[str, int], Awaitable[list[str]]]


class AllowedHosts:
    """The operator's list: exact names, and `*.domain` for any name below domain."""

    def __init__(self, setting: str):
        self.names = {h.strip().lower().rstrip(".") for h in setting.split(",") if h.strip()}

    def __bool__(self) -> bool:
        return bool(self.names)

    def allows(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return host in self.names or any(n.startswith("*.") and host.endswith(n[1:]) for n in self.names)


async def resolve(host: str, port: int) -> list[str]:
    """Every address of `host` (the system's resolver, off the event loop)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


def public(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_loopback or ip.is_link_local)


async def fetch(url: str, where: str, hosts: AllowedHosts, max_bytes: int, timeout_s: float, param: str,
                resolver: Resolve = resolve, transport: httpx.AsyncBaseTransport | None = None) -> bytes:
    """The bytes at `url`, fetched as the module says; ApiError naming `where` where it is refused."""
    def refuse(why: str, status: int = 400) -> ApiError:
        return ApiError(status, f"{where}: {why}", param=param)

    if not hosts:
        raise refuse("image URLs are not fetched by this server; send the image as a data URL "
                     "(data:image/png;base64,...)")
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(transport=transport, follow_redirects=False, trust_env=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise refuse(f"{url[:100]!r} is no http(s) URL of a host")
            host = parts.hostname
            if parts.username or parts.password:
                raise refuse("an image URL may not carry a user name or password")
            if not hosts.allows(host):
                raise refuse(f"the host {host!r} is not among those this server fetches images from")
            try:
                port = parts.port or (443 if parts.scheme == "https" else 80)
            except ValueError:
                raise refuse("the URL's port is not a number") from None
            try:
                addresses = await asyncio.wait_for(resolver(host, port), max(0.0, deadline - time.monotonic()))
            except (OSError, TimeoutError, UnicodeError):
                raise refuse(f"the host {host!r} does not resolve") from None
            if not addresses or not all(public(a) for a in addresses):
                raise refuse(f"the host {host!r} resolves to an address that is not public; not fetched")
            address = addresses[0]
            target = parts._replace(netloc=f"[{address}]:{port}" if ":" in address else f"{address}:{port}").geturl()
            request = client.build_request("GET", target, headers={"Host": parts.netloc.rsplit("@", 1)[-1],
                                                                   "Accept": "image/*"},
                                           extensions={"sni_hostname": host, "timeout": {
                                               "connect": timeout_s, "read": timeout_s, "write": timeout_s,
                                               "pool": timeout_s}})
            try:
                response = await asyncio.wait_for(client.send(request, stream=True),
                                                  max(0.0, deadline - time.monotonic()))
            except (httpx.HTTPError, TimeoutError, OSError) as exc:
                raise refuse(f"the image could not be fetched ({type(exc).__name__})") from None
            try:
                if response.is_redirect:
                    location = response.headers.get("location", "")
                    url = urljoin(url, location)
                    continue
                if response.status_code != 200:
                    raise refuse(f"fetching the image answered HTTP {response.status_code}")
                if int(response.headers.get("content-length") or 0) > max_bytes:
                    raise refuse(f"the image is larger than {max_bytes} bytes", 413)
                data = bytearray()
                try:
                    async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                        async for chunk in response.aiter_bytes():
                            data += chunk
                            if len(data) > max_bytes:
                                raise refuse(f"the image is larger than {max_bytes} bytes", 413)
                except (httpx.HTTPError, TimeoutError) as exc:
                    raise refuse(f"the image could not be fetched ({type(exc).__name__})") from None
                return bytes(data)
            finally:
                await response.aclose()
    raise refuse(f"more than {MAX_REDIRECTS} redirects")
