"""The api's tokenizing and chat templating, on a bounded pool of threads off the event loop.

A tokenizer's encode runs in Rust and lets go of the GIL, so a few threads tokenize while the
loop goes on with I/O; a chat template (Jinja, in Python) holds the GIL in turns with it. At most
`workers` calls run at once and none waits in a hidden queue: a caller waits for a free thread up
to the time cap (past it, 503: the replica is busy), then its call has what is left of the cap to
finish (past it, the request's error: its prompt costs too much to read). A thread cannot be
stopped, so one that runs past the cap keeps its slot until it ends; the pool never grows past
`workers` threads for it.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class TokenizeTimeout(Exception):
    """The call ran past what was left of the time cap (it goes on in its thread, holding its slot)."""


class PoolBusy(Exception):
    """No thread came free within the time cap."""


class TokenizePool:
    def __init__(self, workers: int = 2, timeout_s: float = 10.0):
        self.workers, self.timeout_s = workers, timeout_s
        self._executor: ThreadPoolExecutor | None = None  # its threads start with the first call
        self._slots: asyncio.Semaphore | None = None

    async def run(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on one of the pool's threads; its exceptions as it raises them. PoolBusy or
        TokenizeTimeout past the time cap."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="streamq-tokenize")
            self._slots = asyncio.Semaphore(self.workers)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        try:
            await asyncio.wait_for(self._slots.acquire(), self.timeout_s)
        except TimeoutError:
            raise PoolBusy(f"every tokenizer thread stayed busy for {self.timeout_s:g} s "
                           "(STREAMQ_TOKENIZE_TIMEOUT_S)") from None
        future = loop.run_in_executor(self._executor, fn, *args)
        future.add_done_callback(self._done)
        try:
            return await asyncio.wait_for(asyncio.shield(future), max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise TokenizeTimeout(f"reading the prompt took longer than the {self.timeout_s:g} s this server "
                                  "allows (STREAMQ_TOKENIZE_TIMEOUT_S)") from None

    def _done(self, future: asyncio.Future) -> None:
        """The slot is freed when the thread is done, not when its caller stopped waiting."""
        self._slots.release()
        if not future.cancelled():
            future.exception()  # retrieved: a caller past the cap raised nothing to log

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
