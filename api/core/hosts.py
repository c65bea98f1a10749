"""Which Host headers the api answers (STREAMQ_ALLOWED_HOSTS).

A page on evil.example whose name is made to resolve to 127.0.0.1 (DNS rebinding) lets a browser
call a loopback api as that page's own origin; the browser still sends `Host: evil.example`, so
answering only the names the api is reached by refuses it. On loopback the default names are
loopback's own; bound beyond it (compose, Kubernetes, whose probes use pod addresses) any name.
"""
from __future__ import annotations

import ipaddress
from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def is_loopback(host: str) -> bool:
    """Whether a bind address or Host name is this machine's loopback (`localhost`, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:  # a host name other than localhost: assume it is reachable from outside
        return False


def allowed_names(setting: str, bind: str) -> tuple[str, ...]:
    """The setting's names, lower case ("*": any); `auto` decided for the bind address. ValueError
    names a name that cannot match a Host header (with a port, or IPv6 without brackets)."""
    if setting.strip().lower() == "auto":
        return LOOPBACK_NAMES if is_loopback(bind) else ("*",)
    names = tuple(name.strip().lower() for name in setting.split(","))
    for name in names:
        if not name or any(c.isspace() for c in name):
            raise ValueError(f"STREAMQ_ALLOWED_HOSTS={setting!r} has an empty or spaced name; write name,name,...")
        if ":" in name and not (name.startswith("[") and name.endswith("]")):
            raise ValueError(f"STREAMQ_ALLOWED_HOSTS names {name!r}: name a host without its port (every port is "
                             "answered), an IPv6 address in brackets ([::1])")
    return names


def host_name(header: str) -> str:
    """The Host header's name, without its port, lower case ("[::1]:8000" → "[::1]")."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[:header.find("]") + 1] if "]" in header else header
    name, colon, port = header.rpartition(":")
    return name if colon and port.isdigit() else header


def allows(names: tuple[str, ...], name: str) -> bool:
    return any(n == "*" or n == name or n.startswith("*.") and name.endswith(n[1:]) for n in names)


class HostCheck:
    """400, in the path's family's error body, for a request whose Host is not an allowed name."""

    def __init__(self, app: ASGIApp, names: tuple[str, ...], error: Callable[[str, int, str], Response]):
        self.app, self.names, self.error = app, names, error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and "*" not in self.names:
            header = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if not allows(self.names, host_name(header)):
                message = (f"Host {header!r} is not a name this api answers to ({', '.join(self.names)}); "
                           "its operator can add it to STREAMQ_ALLOWED_HOSTS")
                await self.error(scope["path"], 400, message)(scope, receive, send)
                return
        await self.app(scope, receive, send)
