"""How much of the machine other work took while a cell ran: the host's busy CPU time (all cores) minus what this
process and the server's process tree used, per second of the cell, in cores. A shared machine (CI, other jobs)
shows here: a cell measured while another process used a whole core is not comparable with a quiet one."""

from __future__ import annotations

import time

import psutil


def _busy_s() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)


def _tree_cpu_s(pids: list[int | None]) -> float:
    """CPU seconds of the processes `pids` and their descendants, each process once (a server is often a child of
    the process that measures it)."""
    procs: dict[int, psutil.Process] = {}
    for pid in pids:
        if pid is None:
            continue
        try:
            root = psutil.Process(pid)
            procs |= {p.pid: p for p in [root, *root.children(recursive=True)]}
        except psutil.Error:
            continue
    total = 0.0
    for p in procs.values():
        try:
            c = p.cpu_times()
            total += c.user + c.system
        except psutil.Error:
            pass
    return total


class ForeignLoad:
    """start() ... stop() -> cores used by processes outside `pids` (and their children) in between."""

    def __init__(self, pids: list[int | None]):
        self.pids = pids
        self._start: tuple[float, float, float] | None = None

    def start(self) -> None:
        self._start = (time.monotonic(), _busy_s(), _tree_cpu_s(self.pids))

    def stop(self) -> float | None:
        if self._start is None:
            return None
        t0, busy0, own0 = self._start
        elapsed = time.monotonic() - t0
        if elapsed <= 0:
            return None
        foreign = (_busy_s() - busy0) - (_tree_cpu_s(self.pids) - own0)
        return max(0.0, foreign / elapsed)
