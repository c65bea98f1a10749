"""The Lua scripts the processes run in Redis: one file each in shared/lua/, loaded here.

A file begins with a header comment: what the script does, its KEYS and ARGV (a line each) and
what it returns, and, on a `-- uses:` line, what is put before it. A library (a header beginning
`-- Library:`) only defines local functions, for the scripts that use it; it is never run alone.
What a script reads of the names Python owns (the request record's field, status and
finish-reason tables F, S and R of shared/request_record.py, and the token log's EVENT_FIELD) is
made here, at load time, as the prelude `names`, which a script uses as it would a library: so no
script spells those names itself, and none takes them as ARGV.

`register` gives a redis-py Script: it runs by EVALSHA and, where Redis answers NOSCRIPT (restarted,
its scripts flushed, or a replica promoted that never loaded it), loads the script with SCRIPT LOAD
(on every master of a Redis Cluster) and runs it again. On a cluster a script runs on the node of
its KEYS' slot, so every key a script touches lies in one slot (a hash tag: docs/scaling.md).
"""
from __future__ import annotations

import functools
from importlib import resources

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from shared import redis_keys
from shared.request_record import LUA_NAMES

LIBRARY = "-- Library:"  # how a library's header begins
_USES = "-- uses:"

# The preludes made from Python's names, by the name a `-- uses:` line gives them.
_MADE = {"names": LUA_NAMES + f"local EVENT_FIELD = '{redis_keys.EVENT_FIELD}'\n"}


def _folder():
    return resources.files("shared") / "lua"


@functools.cache
def text(name: str) -> str:
    """The file shared/lua/<name>.lua as written."""
    return (_folder() / f"{name}.lua").read_text()


def header(name: str) -> list[str]:
    """The comment lines the file begins with."""
    lines = text(name).splitlines()
    end = next((i for i, line in enumerate(lines) if not line.startswith("--")), len(lines))
    return lines[:end]


def is_library(name: str) -> bool:
    return text(name).startswith(LIBRARY)


def uses(name: str) -> list[str]:
    """What the file's `-- uses:` line names, in its order (none without one)."""
    found = [line.removeprefix(_USES) for line in header(name) if line.startswith(_USES)]
    return [used.strip() for line in found for used in line.split(",") if used.strip()]


def names() -> list[str]:
    """Every file of shared/lua/, libraries too, by name, sorted."""
    return sorted(entry.name.removesuffix(".lua") for entry in _folder().iterdir() if entry.name.endswith(".lua"))


@functools.cache
def source(name: str) -> str:
    """The script as Redis runs it: what it uses, each once, what they use before them; then its text."""
    order: list[str] = []
    _add_uses(name, order)
    return "".join(_MADE[part] if part in _MADE else text(part) for part in order) + text(name)


def _add_uses(name: str, order: list[str]) -> None:
    for used in uses(name):
        if used in order:
            continue
        if used not in _MADE:
            if not is_library(used):
                raise ValueError(f"{name}.lua uses {used}.lua, which is a script, not a library")
            _add_uses(used, order)
        order.append(used)


def register(redis: Redis, name: str) -> AsyncScript:
    """The script shared/lua/<name>.lua on this client: called with keys= and args=, it runs by
    EVALSHA, loaded again after a NOSCRIPT."""
    if is_library(name):
        raise ValueError(f"{name}.lua is a library: it runs only in the scripts that use it")
    return redis.register_script(source(name))
