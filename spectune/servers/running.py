"""The batch size a server actually ran during a cell: what the adaptive config's per-batch-size slots see.

In closed loop it is the cell's batch size by construction; in open loop (trace, Poisson) it follows the traffic
and the server's speed. Sources, best first (batch_size_ran_source):
  round_log  the embedded engine's round log: mean batch of the verify rounds logged during the cell
  gauge      the server's running-requests gauge (vllm:num_requests_running, sglang:num_running_reqs,
             llamacpp:requests_processing), sampled during the cell
  client     requests in flight as the load generator saw them, time-averaged over the window (Little's law)
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

from spectune.records import RequestRecord


def log_size(path: Path | None) -> int | None:
    """Bytes in a round log now (its lines are whole: the engine writes each with one line-buffered write)."""
    if path is None:
        return None
    try:
        return path.stat().st_size
    except OSError:
        return 0


def round_log_batch_mean(path: Path | None, start: int | None, end: int | None) -> float | None:
    """Mean batch size of the verify rounds logged between two log_size() offsets; None without any."""
    if path is None or start is None or end is None or end <= start:
        return None
    with open(path, "rb") as f:
        f.seek(start)
        lines = f.read(end - start).splitlines()
    sizes = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and not row.get("prefill") and isinstance(row.get("batch_size"), int):
            sizes.append(row["batch_size"])
    return sum(sizes) / len(sizes) if sizes else None


def in_flight_mean(records: list[RequestRecord]) -> float | None:
    """Requests in flight, time-averaged from the first send to the last end (sum of request spans / window)."""
    spans = [(r.send_ns, r.end_ns) for r in records if r.end_ns is not None]
    if not spans:
        return None
    window = max(e for _, e in spans) - min(s for s, _ in spans)
    return sum(e - s for s, e in spans) / window if window > 0 else None


class GaugeSampler:
    """Reads a gauge every `interval_s` on a daemon thread between start() and stop(); stop() returns the mean."""

    def __init__(self, read: Callable[[], float | None], interval_s: float = 0.5):
        self.read, self.interval_s = read, interval_s
        self._values: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        thread = threading.Thread(target=self._run, name="spectune-gauge", daemon=True)
        thread.start()
        self._thread = thread  # only once started: a Ctrl-C inside start() must not leave stop() a thread to join

    def stop(self) -> float | None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return sum(self._values) / len(self._values) if self._values else None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                value = self.read()
            except Exception:  # a scrape that fails mid-cell only costs this sample
                continue
            if value is not None:
                self._values.append(value)
