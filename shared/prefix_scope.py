"""Whose cached prompt prefixes a request may reuse: its own tenant's.

A cache hit is visible to the caller (`cached_tokens` in the usage, and a faster first token), so
a cache shared between tenants tells one tenant what another has sent. Each tenant's prefix-cache
and KV-tier block hashes therefore chain from a root of its own (as a LoRA adapter's do,
worker/engine/block_manager.py), and prefix affinity hashes a prompt under the same root
(shared/prefix_affinity.py). The tenants `shared_prefix_tenants` names (`*`: all) chain from no
root instead, the one space they share with each other; so do requests without a tenant (auth
off), whose hashes are those of a cache keyed by tokens alone.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

ALL = "*"


def _hash(*parts: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(b"\0".join(parts), digest_size=16).digest(), "little")


def tenant_root(tenant: str) -> int:
    """The chain root of `tenant`'s own prefixes: the same in every process (api and workers)."""
    return _hash(b"tenant", tenant.encode())


def join_roots(tenant: int | None, adapter: int | None) -> int | None:
    """The root of a chain of both a tenant's space and a LoRA adapter's (None where neither has one)."""
    if tenant is None or adapter is None:
        return adapter if tenant is None else tenant
    return _hash(b"join", tenant.to_bytes(16, "little"), adapter.to_bytes(16, "little"))


@dataclass(frozen=True)
class PrefixScope:
    """Which tenants keep their prefixes to themselves: all but those of `shared` (`*` in it: none)."""

    shared: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, value: str) -> PrefixScope:
        """From the setting: comma-separated tenant names, `*` for every tenant, empty for none."""
        return cls(frozenset(name.strip() for name in value.split(",") if name.strip()))

    def root(self, tenant: str, adapter: int | None = None) -> int | None:
        """The chain root of a request of `tenant` (run with the LoRA adapter of root `adapter`)."""
        own = tenant and ALL not in self.shared and tenant not in self.shared
        return join_roots(tenant_root(tenant) if own else None, adapter)


PER_TENANT = PrefixScope()  # the default: every tenant's prefixes its own
