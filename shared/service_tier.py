"""Service tiers, OpenAI's `service_tier`: which requests go first across tenants.

A request asks for `auto`, `default`, `flex` or `priority`; the api resolves it against the
tiers its tenant may use (`streamq keys limits --tiers`, `--auto-tier`) and the resolved tier
travels with the request. Workers take `priority` lanes before `default` ones and those before
`flex` (shared/lua/intake_take.lua), admit waiting requests tier first and fair share between
tenants within a tier (worker/engine/fair_queue.py), and preempt a running `flex` request when a
better one waits with no room for it (worker/engine/batcher.py). A `flex` request may wait
longer in the queue before it expires (`STREAMQ_FLEX_QUEUE_TIMEOUT_S`). The response's
`service_tier` names the tier that served it.
"""
from __future__ import annotations

from typing import Literal

Tier = Literal["priority", "default", "flex"]
Requested = Literal["auto", "default", "flex", "priority"]

TIERS: tuple[Tier, ...] = ("priority", "default", "flex")  # first runs first
RANK: dict[str, int] = {tier: rank for rank, tier in enumerate(TIERS)}
PREEMPTIBLE_RANK = RANK["flex"]  # running requests of this tier give way to better ones

# What a tenant may use where it was given nothing: priority is granted, the others are anyone's.
DEFAULT_GRANT: tuple[Tier, ...] = ("default", "flex")
DEFAULT_AUTO: Tier = "default"


def parse(text: str) -> tuple[Tier, ...]:
    """A comma-separated list of tiers, in the order of TIERS (ValueError naming a bad one)."""
    names = {name.strip() for name in text.split(",") if name.strip()}
    if bad := sorted(names - set(TIERS)):
        raise ValueError(f"unknown service tiers {bad}; the tiers are {list(TIERS)}")
    if not names:
        raise ValueError(f"give at least one service tier of {list(TIERS)}")
    return tuple(t for t in TIERS if t in names)


def lane_mark(tier: str) -> str:
    """The tier's mark at the head of a lane's priority part (shared/queue.py): none for
    `default`, so the lanes of requests without a tier keep their names."""
    return "" if tier == "default" else tier[0]


def rank_of_lane(lane: str) -> int:
    """The rank of a lane's tier, from its name (`@backend/`, `^worker/` prefixes skipped)."""
    for prefix in ("@", "^"):  # backend and worker names have no '/'
        if lane.startswith(prefix):
            lane = lane.partition("/")[2]
    head = lane[:1]
    return RANK["priority"] if head == "p" else RANK["flex"] if head == "f" else RANK["default"]


def resolve(requested: str, granted: tuple[str, ...], auto: str) -> Tier:
    """The tier a request asking for `requested` runs in, for a tenant granted `granted` whose
    `auto` is `auto` (PermissionError naming what it may use, where the tier is not granted)."""
    tier = auto if requested == "auto" else requested
    if tier not in granted:
        raise PermissionError(f"service_tier {tier!r} is not available to this tenant; it may use "
                              f"{', '.join(['auto', *granted])}")
    return tier  # type: ignore[return-value]
