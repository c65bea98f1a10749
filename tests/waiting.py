"""Waiting for a condition that another process or task brings about, with a bound."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float = 30.0, what: str = "condition") -> None:
    """Re-check `check` until it holds; fail (not hang) after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout_s} s")
        await asyncio.sleep(0.01)


def until_sync(check: Callable[[], bool], timeout_s: float = 30.0, what: str = "condition") -> None:
    """`until` for synchronous tests."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout_s} s")
        time.sleep(0.01)
