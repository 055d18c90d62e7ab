"""Is the load generator the bottleneck? Its event loop's lag and its CPU share during a cell.

A chunk's timestamp is taken when the event loop gets round to the read that returned it. While the loop is
busy, every stamp is late by up to one pass of the loop, and reads merge several chunks into one: inter-chunk
gaps collapse to 0 and then jump. Two figures show it, measured in every process that streams:
  loop lag    how late a timer set to fire every TICK_S ran (ms): how long a ready read can wait
  CPU share   CPU seconds of the loop's thread over the wall seconds of the phase (1.0 = one core, all of it)
A cell is `client_saturated` when its busiest process used nearly a whole core (CPU share >= SATURATED_CPU), or
its loop lag p99 reached SATURATED_LAG_MS while it used at least half a core (lag with a low CPU share is the
host's other work, not the client's own: it shows in client_loop_lag_ms_p99 and the cell's foreign_cpu_cores,
not in this flag). Its inter-chunk
figures then measure the client; `--workers N` (plan key `workers`) spreads the streams over N processes.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

TICK_S = 0.01
SATURATED_CPU = 0.85
SATURATED_LAG_MS = 10.0
BUSY_CPU = 0.5


@dataclass(slots=True)
class ProbeResult:
    """One process's figures for one phase (picklable: workers send it to the parent)."""

    lags_ms: list[float]
    cpu_s: float
    wall_s: float


@dataclass(slots=True)
class ClientLoad:
    """The client's load over a cell's measured phase, merged over its processes."""

    lags_ms: list[float] = field(default_factory=list)
    cpu_shares: list[float] = field(default_factory=list)  # one per process
    deferred_cpu_s: float = 0.0  # CPU spent parsing and counting chunks after their streams ended (warm-up included)

    def add(self, result: ProbeResult) -> None:
        self.lags_ms += result.lags_ms
        self.cpu_shares.append(result.cpu_s / result.wall_s if result.wall_s > 0 else 0.0)

    @property
    def loop_lag_ms_p99(self) -> float | None:
        if not self.lags_ms:
            return None
        lags = sorted(self.lags_ms)
        return lags[min(len(lags) - 1, int(0.99 * len(lags)))]

    @property
    def cpu_share(self) -> float | None:
        """The busiest process's share of one core."""
        return max(self.cpu_shares) if self.cpu_shares else None

    @property
    def saturated(self) -> bool:
        cpu, lag = self.cpu_share, self.loop_lag_ms_p99
        if cpu is None:
            return False
        return cpu >= SATURATED_CPU or (lag is not None and lag >= SATURATED_LAG_MS and cpu >= BUSY_CPU)

    def row(self) -> dict:
        """The cell's columns."""
        return {"client_loop_lag_ms_p99": self.loop_lag_ms_p99, "client_cpu_share": self.cpu_share,
                "client_processes": len(self.cpu_shares), "client_saturated": self.saturated}

    def warning(self, workers: int) -> str | None:
        """A line for the user when the cell's figures measure the client, else None."""
        if not self.saturated:
            return None
        lag = self.loop_lag_ms_p99  # None when the cell ended (e.g. Ctrl-C) before the first tick
        lag_text = f", event-loop lag p99 {lag:.1f} ms" if lag is not None else ""
        return (f"client saturated (busiest process {self.cpu_share:.0%} of a core{lag_text}): this cell's inter-chunk and "
                f"TTFT figures measure the load generator, "
                f"not the server; run it with more load-generator processes (--workers {max(2, 2 * workers)}, plan "
                f"key workers)")


@dataclass(slots=True)
class LoopProbe:
    """A timer that measures its own lateness every TICK_S, and the loop thread's CPU time, until stop()."""

    task: asyncio.Task
    lags_ms: list[float]
    cpu0: float
    wall0: int

    @classmethod
    def start(cls) -> LoopProbe:
        lags: list[float] = []
        return cls(asyncio.create_task(_tick(lags)), lags, time.thread_time(), time.perf_counter_ns())

    def stop(self) -> ProbeResult:
        self.task.cancel()
        return ProbeResult(self.lags_ms, time.thread_time() - self.cpu0, (time.perf_counter_ns() - self.wall0) / 1e9)


async def _tick(lags: list[float]) -> None:
    tick_ns = int(TICK_S * 1e9)
    while True:
        due = time.perf_counter_ns() + tick_ns
        await asyncio.sleep(TICK_S)
        lags.append(max(0, time.perf_counter_ns() - due) / 1e6)
