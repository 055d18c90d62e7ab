"""Ctrl-C during a sweep: never lost, never half a write.

While a sweep runs it owns SIGINT (`owned_sigint`). The handler records the request, then:
- during a measurement (`run`): cancels it on its event loop, thread-safely; the sweep marks the cell partial;
- inside a `critical()` section (writing results, launching a process): nothing more until the section ends,
  then KeyboardInterrupt;
- anywhere else (a server starting, a scrape): KeyboardInterrupt at once, as Python's own handler does.
The sweep also calls `check()` between stages, so a request that some library swallowed (a cancellation turned
into a normal return) still stops it. A second Ctrl-C raises KeyboardInterrupt wherever the program is.

Why not Python's defaults: its handler raises KeyboardInterrupt wherever the main thread is, and where that is
a finalizer (a __del__, a generator closed by the garbage collector) Python prints "Exception ignored" and drops
it. The sweep's main thread runs such finalizers (asyncio and aiohttp transports, sessions, connectors) all the
time; sampled every 0.5 ms over a sweep with a CPU hog beside it, about 1 in 1,000 samples was inside one with
Python's handler active, more when the machine is loaded and a thread is descheduled mid-finalizer. That is how a
Ctrl-C was lost and the sweep ran every cell and exited 0 (tests/sigint_injected.py reproduces it exactly).
asyncio.run's own handler has a weaker form of the same bet: it cancels the main task and relies on the task
ending cancelled. And a KeyboardInterrupt in the middle of writing a finished cell lost that cell. Here the
request is recorded before anything is raised, so a swallowed KeyboardInterrupt only delays the stop to the next
check.

SIGINT is one per process, so this state is too (module-level, like the signal itself).
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")


class _State:
    def __init__(self) -> None:
        self.owned = False
        self.requests = 0  # Ctrl-Cs received while owned
        self.critical = 0  # depth of critical sections
        self.pending = False  # a Ctrl-C arrived inside a critical section
        self.task: asyncio.Task | None = None  # the measurement in flight
        self.loop: asyncio.AbstractEventLoop | None = None


_state = _State()


def _on_sigint(signum: int, frame: object) -> None:
    _state.requests += 1
    if _state.requests > 1:
        raise KeyboardInterrupt  # asked twice: now
    if _state.task is not None and _state.loop is not None:
        _state.loop.call_soon_threadsafe(_state.task.cancel)
        return
    if _state.critical:
        _state.pending = True
        return
    raise KeyboardInterrupt


@contextmanager
def owned_sigint() -> Iterator[None]:
    """Own SIGINT for the duration (main thread only; elsewhere Python's default stays and this is a no-op)."""
    if threading.current_thread() is not threading.main_thread() or _state.owned:
        yield
        return
    previous = signal.signal(signal.SIGINT, _on_sigint)
    _state.owned, _state.requests, _state.pending = True, 0, False
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _state.owned = False


def requested() -> bool:
    """Whether Ctrl-C was pressed while the sweep owned SIGINT."""
    return _state.owned and _state.requests > 0


def check() -> None:
    """Raise KeyboardInterrupt if Ctrl-C was pressed: the sweep calls it between stages."""
    if requested():
        _state.pending = False  # raised here, not again at the end of a critical section
        raise KeyboardInterrupt


@contextmanager
def critical(stop_after: bool = True) -> Iterator[None]:
    """A section Ctrl-C does not cut short (results writes, process launch); it stops right after it, or, with
    stop_after=False, at the caller's next check()."""
    _state.critical += 1
    try:
        yield
    finally:
        _state.critical -= 1
    if _state.critical == 0 and _state.pending and stop_after:
        _state.pending = False
        raise KeyboardInterrupt


def run(coro: Coroutine[Any, Any, T], loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None) -> T:
    """asyncio.run(coro) (on a loop from `loop_factory`, e.g. uvloop's), cancelled by Ctrl-C; KeyboardInterrupt if
    Ctrl-C came, however the coroutine ended."""
    if requested():
        coro.close()
        check()

    async def main() -> T:
        _state.loop, _state.task = asyncio.get_running_loop(), asyncio.current_task()
        try:
            return await coro
        finally:
            _state.task = _state.loop = None

    try:
        with critical():  # outside the task (loop start and teardown) a Ctrl-C waits for asyncio.run to return
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                result = runner.run(main())
    except asyncio.CancelledError:
        check()
        raise
    check()
    return result
