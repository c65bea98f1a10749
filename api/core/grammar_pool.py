"""The api's grammar compiles, in a few processes of their own under a time cap, so none runs on
the event loop (a large schema takes llguidance up to a few hundred milliseconds, and holds the
GIL while it does).

The processes are started by multiprocessing's spawn method (a fresh interpreter: nothing of the
api's threads, locks or sockets is inherited) when the first compile is asked for, and exchange
plain strings with the api: the constraint's JSON in, the verdict out ('' when it compiles, else
llguidance's reason). A compile that runs past the cap has its process killed and replaced, and
its request gets the cap's reason; a process that dies is replaced too. Verdicts are kept per
tenant (an app sends the same schema again and again), never across tenants: a verdict another
tenant's request left behind would answer faster, telling one tenant what another sent.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import multiprocessing
import signal
from collections import OrderedDict
from collections.abc import Callable
from multiprocessing.connection import Connection

from shared.structured import verdict

log = logging.getLogger(__name__)

MAX_REASON_CHARS = 2000  # a verdict longer than this is cut: it goes back in one small message
READY = b"ready"


class CompileFailed(Exception):
    """The compile gave no verdict: its process died under it (and was replaced)."""


class CompileTimeout(CompileFailed):
    """The compile ran past the pool's time cap (its process was killed and replaced)."""


class PoolBusy(Exception):
    """No process of the pool came free within the time cap."""


class GrammarPool:
    def __init__(self, workers: int = 2, timeout_s: float = 5.0, check: Callable[[str], str] = verdict,
                 cache_size: int = 1024):
        """`workers` processes; `timeout_s`: the longest one compile may run, and the longest a caller
        waits for a free process; `check`: what a process runs on each string (importable by name,
        as spawn needs); `cache_size`: verdicts kept, over every tenant."""
        self.workers, self.timeout_s, self.check, self.cache_size = workers, timeout_s, check, cache_size
        self._context = multiprocessing.get_context("spawn")
        self._idle: asyncio.Queue[_Process] | None = None  # made in the event loop, at the first compile
        self._changed: asyncio.Condition | None = None  # notified as a process comes up
        self._processes: set[_Process] = set()  # started, not yet killed
        self._up: set[_Process] = set()  # ... of which those that have loaded the compiler
        self._tasks: set[asyncio.Task] = set()
        self._starting: set[asyncio.Future] = set()  # processes being started, on a thread each
        self._cache: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._closed = False
        self.compiles = 0  # sent to a process (not answered from the cache)

    async def verdict(self, constraint: str, tenant: str = "") -> str:
        """The verdict on `constraint` (a StructuredOutputs' JSON): '' when it compiles, else the
        reason. CompileTimeout past the time cap, CompileFailed where the process died under it;
        PoolBusy where no process came free within the cap."""
        key = (tenant, hashlib.sha256(constraint.encode()).hexdigest())
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        self._begin()
        try:
            process = await asyncio.wait_for(self._idle.get(), self.timeout_s)
        except TimeoutError:
            raise PoolBusy(f"no grammar compile process came free within {self.timeout_s:g} s "
                           "(STREAMQ_COMPILE_TIMEOUT_S)") from None
        self.compiles += 1
        # Its own task, shielded: a caller that goes away leaves the process to answer (or be
        # replaced) before it serves anyone else, so no reply reaches the wrong request.
        reply = await asyncio.shield(self._start(self._exchange(process, constraint)))
        self._cache[key] = reply
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return reply

    async def ready(self) -> None:
        """Start the pool if it has not started, and wait until every one of its processes is up."""
        self._begin()
        async with self._changed:
            await self._changed.wait_for(lambda: len(self._up) == self.workers)

    def pids(self) -> list[int]:
        """The ids of the pool's processes that are up."""
        return sorted(p.process.pid for p in self._up)

    def _begin(self) -> None:
        if self._idle is None:
            self._idle, self._changed = asyncio.Queue(), asyncio.Condition()
            for _ in range(self.workers):
                self._spawn()

    async def close(self) -> None:
        self._closed = True
        await asyncio.gather(*self._starting, return_exceptions=True)  # each into _processes, to be killed
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        processes, self._processes, self._up = list(self._processes), set(), set()
        for process in processes:
            process.process.kill()
        await asyncio.gather(*(asyncio.to_thread(p.stop) for p in processes))

    async def _exchange(self, process: _Process, constraint: str) -> str:
        try:
            process.conn.send_bytes(constraint.encode())  # the process waits in recv: it drains at once
            reply = await asyncio.wait_for(_receive(process.conn), self.timeout_s)
        except TimeoutError:
            self._replace(process)
            raise CompileTimeout(f"compiling the constraint took longer than the {self.timeout_s:g} s this "
                                 "server allows (STREAMQ_COMPILE_TIMEOUT_S); simplify it") from None
        except (EOFError, OSError) as exc:
            self._replace(process)
            log.warning("a grammar compile process ended mid-compile (%s); it is replaced", exc)
            raise CompileFailed("the grammar compiler's process ended while compiling this constraint") from None
        self._idle.put_nowait(process)
        return reply.decode()

    def _spawn(self) -> None:
        self._start(self._add())

    def _replace(self, process: _Process) -> None:
        self._processes.discard(process)
        self._up.discard(process)
        process.process.kill()
        self._start(asyncio.to_thread(process.stop))
        if not self._closed:
            self._spawn()

    async def _add(self) -> None:
        """One new process, into the idle queue once it has loaded the compiler."""
        starting = asyncio.ensure_future(asyncio.to_thread(self._new_process))  # start() forks and execs
        self._starting.add(starting)
        starting.add_done_callback(self._starting.discard)
        process = await asyncio.shield(starting)
        if self._closed:  # close() kills it
            return
        try:
            ready = await _receive(process.conn)
        except (EOFError, OSError):
            ready = b""
        if ready != READY:
            self._processes.discard(process)
            process.process.kill()
            log.error("a grammar compile process failed to start (exit code %s)", process.process.exitcode)
            await asyncio.to_thread(process.stop)
            return
        self._up.add(process)
        self._idle.put_nowait(process)
        async with self._changed:
            self._changed.notify_all()

    def _new_process(self) -> _Process:
        """A started process, in the pool's set before close() can look (run on a thread)."""
        process = _Process(self._context, self.check)
        self._processes.add(process)
        return process

    def _start(self, work) -> asyncio.Task:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a caller that went away raised nothing to log


class _Process:
    """One compile process and the api's end of its pipe."""

    def __init__(self, context, check: Callable[[str], str]):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, check), name="streamq-grammar", daemon=True)
        self.process.start()
        child.close()

    def stop(self) -> None:
        """Wait for the (killed or ending) process, and close the pipe."""
        self.process.join()
        self.process.close()
        self.conn.close()


async def _receive(conn: Connection) -> bytes:
    """The next message on `conn`, awaited on the event loop (the pipe's fd in its selector)."""
    loop = asyncio.get_running_loop()
    readable = loop.create_future()
    fd = conn.fileno()
    loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
    try:
        await readable
    finally:
        loop.remove_reader(fd)
    return conn.recv_bytes()  # whole: a reply is one small write


def _serve(conn: Connection, check: Callable[[str], str]) -> None:
    """A compile process: each string in, its verdict out, until the api's end closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the api's to handle
    import llguidance  # noqa: F401  (loaded before "ready": no compile pays for it)

    conn.send_bytes(READY)
    while True:
        try:
            constraint = conn.recv_bytes().decode()
        except (EOFError, OSError):
            return
        try:
            reply = check(constraint)
        except Exception as exc:  # noqa: BLE001  (the compiler's failure is the request's verdict)
            reply = f"the grammar compiler failed: {exc}"
        conn.send_bytes(reply[:MAX_REASON_CHARS].encode())
