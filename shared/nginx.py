"""The load balancer's nginx config: one Jinja template (nginx.conf.j2, shipped in this package).

It renders compose's config (deploy/nginx.conf is `python -m shared.nginx`'s output; a test
keeps the two equal) and the one `streamq serve --api-replicas N` runs nginx with.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

import jinja2


def _render(**variables: object) -> str:
    environment = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                                     undefined=jinja2.StrictUndefined, autoescape=False)
    return environment.from_string(resources.files(__package__).joinpath("nginx.conf.j2").read_text()).render(
        **variables)


def compose_config() -> str:
    """deploy/nginx.conf: listens on 8000; the replicas are compose's service `api`, looked up while serving."""
    return _render(listen="8000", upstream_ports=None, folder=None)


def serve_config(host: str, port: int, upstream_ports: list[int], folder: Path) -> str:
    """The config made to run as an ordinary user in front of replicas on this machine.

    It listens on host:port and proxies to 127.0.0.1:`upstream_ports` (a fixed upstream with
    keep-alive, instead of compose's DNS lookup); it stays in the foreground with one worker
    process, and keeps its pid and temporary files in `folder`. Every proxy setting (buffering
    off, timeouts, headers, body limit) is the same as compose's.
    """
    if not upstream_ports:
        raise ValueError("nginx needs at least one api replica to proxy to")
    listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if host == "::":
        listen += " ipv6only=off"  # every address, IPv4 too, as the api itself binds `::`
    return _render(listen=listen, upstream_ports=upstream_ports, folder=folder)


if __name__ == "__main__":
    print(compose_config(), end="")
