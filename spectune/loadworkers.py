"""One cell's requests spread over N load-generator processes, merged into the records one process would return.

Request i goes to worker i % N, with the offset the schedule gave it in the whole list; a concurrency cap C is
split into C // N streams per worker (the first C % N workers one more), so the cell still has C in flight. Every
worker counts its offsets from one start time, a perf_counter_ns value the parent picks once all of them are
ready: perf_counter is CLOCK_MONOTONIC, one clock for every process on Linux, so send, intended and chunk
times of all workers compare directly. Between the warm-up and the measured phase the workers wait for the
parent, which runs `after_warmup` once all have finished.

Workers are spawned (not forked: the parent may hold threads and engines), ignore SIGINT (the parent owns
Ctrl-C: it tells them to stop, which cancels their streams), and send each record to the parent as it ends, with
its raw chunks (the parent parses them after the phase), so a stopped run keeps every finished record, as one
process does.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from spectune.clientload import ClientLoad, LoopProbe
from spectune.records import Request

START_MARGIN_S = 0.02  # between the parent picking the start time and the workers using it
STOP_WAIT_S = 10.0


@dataclass(frozen=True, slots=True)
class Share:
    """One worker's part of one phase."""

    requests: list[Request]
    offsets: list[float | None]
    max_concurrency: int | None
    is_warmup: bool


def split(requests: list[Request], offsets: list[float | None], max_concurrency: int | None, workers: int,
          is_warmup: bool) -> list[Share]:
    """Request i to worker i % workers, each keeping its own offset; the cap split as evenly as it goes."""
    shares = []
    for w in range(workers):
        cap = None if max_concurrency is None else max_concurrency // workers + (w < max_concurrency % workers)
        shares.append(Share(requests[w::workers], offsets[w::workers], cap, is_warmup))
    return shares


def usable_workers(workers: int, phases) -> int:
    """No more workers than the smallest concurrency cap or the measured requests (a worker needs a stream)."""
    caps = [p.schedule.max_concurrency for p in phases if p.schedule.max_concurrency]
    measured = max((len(p.requests) for p in phases if not p.is_warmup), default=1)
    return max(1, min([workers, measured] + caps))


async def run_in_workers(sender, phases, workers: int, collect, after_warmup: Callable[[], None] | None,
                         load: ClientLoad) -> None:
    """Run `phases` (loadgen.Phase) over `workers` processes; records go to `collect` (loadgen._Collect) as they
    end, with their raw chunks, parsed here once the phase has ended."""
    n = usable_workers(workers, phases)
    plans = [[] for _ in range(n)]  # per worker: its share of each phase that has requests
    for phase in phases:
        if phase.requests:
            offsets = phase.schedule.send_offsets(phase.requests)
            for w, share in enumerate(split(phase.requests, offsets, phase.schedule.max_concurrency, n, phase.is_warmup)):
                plans[w].append(share)
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(n)]
    procs = [ctx.Process(target=_worker_main, args=(child, sender, plan), daemon=True, name=f"spectune-loadgen-{w}")
             for w, ((_, child), plan) in enumerate(zip(pipes, plans))]
    conns = [parent for parent, _ in pipes]
    inbox = _Inbox(asyncio.get_running_loop())
    for p in procs:
        p.start()
    for (_, child) in pipes:
        child.close()
    readers = [threading.Thread(target=inbox.read, args=(conn, w), daemon=True) for w, conn in enumerate(conns)]
    for reader in readers:
        reader.start()
    try:
        await _gather(inbox, n, "ready")
        for i, share in enumerate(plans[0]):
            if not share.is_warmup and i > 0 and after_warmup is not None:
                await asyncio.to_thread(after_warmup)
            start_ns = time.perf_counter_ns() + int(START_MARGIN_S * 1e9)
            for conn in conns:
                conn.send(("go", start_ns))
            for result in await _gather(inbox, n, "phase_done", collect):
                if result is not None:
                    load.add(result)
            collect.finish()
    finally:
        _stop(conns, procs, readers, inbox, collect)
        collect.finish()


class _Inbox:
    """Messages from the workers, read by one blocking thread per pipe (an event-loop reader would make the pipe
    non-blocking, and a record larger than the pipe's buffer then fails to read whole)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: queue.SimpleQueue = queue.SimpleQueue()
        self.ready = asyncio.Event()

    def read(self, conn: Connection, worker: int) -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                message = ("exited", None)
            self.items.put((worker, message))
            try:
                self.loop.call_soon_threadsafe(self.ready.set)
            except RuntimeError:  # the loop has closed: _stop drains what is left
                pass
            if message[0] in ("exited", "stopped"):
                return

    async def get(self) -> tuple[int, tuple]:
        while True:
            try:
                return self.items.get_nowait()
            except queue.Empty:
                self.ready.clear()
                if self.items.empty():
                    await self.ready.wait()


async def _gather(inbox: _Inbox, n: int, kind: str, collect=None) -> list:
    """Handle messages until every worker has sent `kind`; returns their payloads in worker order."""
    got: dict[int, object] = {}
    while len(got) < n:
        worker, (what, payload) = await inbox.get()
        if what == kind:
            got[worker] = payload
        elif what in ("stopped", "exited") and worker in got:
            continue  # done with its last phase
        elif not _handle(what, payload, collect):
            raise RuntimeError(f"load-generator worker {worker} {what}: {payload}")
    return [got[w] for w in range(n)]


def _handle(what: str, payload, collect) -> bool:
    """Progress and records; False for anything else (a failure)."""
    if what == "sent" and collect is not None:
        collect.counts.sent()
    elif what == "ended" and collect is not None:
        collect.ended(*payload)
    else:
        return False
    return True


def _stop(conns: list[Connection], procs: list, readers: list[threading.Thread], inbox: _Inbox, collect) -> None:
    """Tell every worker to stop, keep the records they still send, wait for them to exit."""
    deadline = time.monotonic() + STOP_WAIT_S
    for conn in conns:
        try:
            conn.send(("stop", None))
        except OSError:
            pass
    for reader, proc in zip(readers, procs):
        reader.join(max(0.0, deadline - time.monotonic()))
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
    while True:
        try:
            _, (what, payload) = inbox.items.get_nowait()
        except queue.Empty:
            break
        _handle(what, payload, collect)
    for conn in conns:
        conn.close()


# ---- the worker process -------------------------------------------------------------------------------

def _worker_main(conn: Connection, sender, plan: list[Share]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns Ctrl-C and stops us
    from spectune.loadgen import event_loop_factory

    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            runner.run(_worker(conn, sender, plan))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the cell with it
        try:
            conn.send(("failed", traceback.format_exc(limit=5)))
        except OSError:
            pass
    finally:
        try:
            conn.send(("stopped", None))
        except OSError:
            pass
        conn.close()


async def _worker(conn: Connection, sender, plan: list[Share]) -> None:
    from spectune.loadgen import _run_phase

    loop = asyncio.get_running_loop()
    orders: asyncio.Queue = asyncio.Queue()

    def read_orders() -> None:  # a blocking thread, not a loop reader: the pipe must stay blocking (see _Inbox)
        while True:
            try:
                order = conn.recv()
            except (EOFError, OSError):  # the parent is gone
                order = ("stop", None)
            try:
                loop.call_soon_threadsafe(orders.put_nowait, order)
            except RuntimeError:  # our loop has closed
                return
            if order[0] == "stop":
                return

    threading.Thread(target=read_orders, daemon=True).start()
    async with sender.session() as session:
        conn.send(("ready", None))
        for share in plan:
            what, start_ns = await orders.get()
            if what != "go":
                return
            probe = None if share.is_warmup else LoopProbe.start()
            phase = asyncio.create_task(_run_phase(
                session, sender, share.requests, share.offsets, share.max_concurrency, start_ns,
                lambda: conn.send(("sent", None)), lambda record, chunks: conn.send(("ended", (record, chunks))),
                is_warmup=share.is_warmup))
            stop = asyncio.create_task(orders.get())
            await asyncio.wait([phase, stop], return_when=asyncio.FIRST_COMPLETED)
            if not phase.done():  # told to stop: cancel the streams (each still reports its end)
                phase.cancel()
                await asyncio.gather(phase, return_exceptions=True)
                return
            stop.cancel()
            phase.result()
            conn.send(("phase_done", probe.stop() if probe is not None else None))
