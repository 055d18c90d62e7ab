"""Build, start, stop and read the precise streaming emitter (benchmarks/emitter.c).

The emitter logs, per request, the kernel receive time of the request (rx) and the emission time of every
chunk (a_i), all on CLOCK_MONOTONIC, which is the clock of Python's perf_counter_ns and monotonic_ns on
Linux. The truth a client is checked against is taken from those times, so the emitter's own lateness
(a_i minus its schedule) drops out: true TTFT = a_0 - rx, true gap i = a_i - a_(i-1).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).resolve().parent.parent / "emitter.c"
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "spectune" / "bench"


@dataclass(frozen=True, slots=True)
class Schedule:
    """What the emitter sends for every request."""

    ttft_ms: float = 50.0
    gap_ms: float = 10.0
    tokens_per_chunk: int = 1
    max_tokens: int = 100  # used when the request names none; every client here sends this value
    usage_per_chunk: bool = False  # cumulative `usage` on every content chunk (continuous_usage_stats)

    @property
    def num_chunks(self) -> int:
        return -(-self.max_tokens // self.tokens_per_chunk)

    @property
    def offered_chunks_per_s_per_stream(self) -> float:
        """Chunks per second one stream carries while it streams (ignores TTFT)."""
        return 1000.0 / self.gap_ms if self.gap_ms > 0 else float("inf")


@dataclass(slots=True)
class Emitted:
    """One request as the emitter served it. Times are CLOCK_MONOTONIC ns."""

    seq: int
    rx_ns: int  # kernel receive time of the request
    parse_ns: int  # when the emitter had read it; the schedule counts from here
    max_tokens: int
    aborted: bool  # the client closed the connection before the last chunk
    chunk_ns: np.ndarray  # emission time of each chunk sent


def build(cache_dir: Path = CACHE_DIR) -> Path:
    """Compile emitter.c once per source version; return the binary's path."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    binary = cache_dir / f"emitter-{digest}"
    if not binary.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = binary.with_suffix(".tmp")
        subprocess.run(["gcc", "-O2", "-Wall", "-o", str(tmp), str(SOURCE)], check=True)
        tmp.replace(binary)
    return binary


def start(binary: Path, schedule: Schedule, port: int, out_dir: Path, *, cpu: int | None, workers: int = 1) -> subprocess.Popen:
    """Start the emitter (pinned to `cpu` when given) and wait until it answers /health."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("emitter-*.txt"):
        old.unlink()
    cmd = [
        str(binary), "-p", str(port), "-t", str(schedule.ttft_ms), "-g", str(schedule.gap_ms),
        "-k", str(schedule.tokens_per_chunk), "-n", str(schedule.max_tokens),
        "-u", "1" if schedule.usage_per_chunk else "0", "-w", str(workers), "-o", str(out_dir),
    ]
    if cpu is not None and shutil.which("taskset"):
        cmd = ["taskset", "-c", str(cpu)] + cmd
    if os.geteuid() == 0:  # keep to the schedule when other work shares its core
        cmd = ["nice", "-n", "-10"] + cmd
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 10
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"emitter on port {port} did not start (exit {proc.poll()})")
            time.sleep(0.02)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM: each worker writes its log and exits."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise RuntimeError("emitter did not exit on SIGTERM; its log is lost")


def cpu_seconds(proc: subprocess.Popen) -> float:
    """User + sys CPU the emitter (and its workers) used so far."""
    import psutil

    procs = [psutil.Process(proc.pid)]
    procs += procs[0].children(recursive=True)
    return sum(t.user + t.system for t in (p.cpu_times() for p in procs))


def busy_seconds(served: dict[int, Emitted]) -> float:
    """From the first request received to the last chunk sent."""
    sent = [e for e in served.values() if len(e.chunk_ns)]
    if not sent:
        return float("nan")
    return (max(int(e.chunk_ns[-1]) for e in sent) - min(e.rx_ns for e in sent)) / 1e9


def read_log(out_dir: Path) -> dict[int, Emitted]:
    """Every request the emitter served, by sequence number (the number in its first token, " @<seq>")."""
    served: dict[int, Emitted] = {}
    for path in sorted(out_dir.glob("emitter-*.txt")):
        with path.open() as f:
            for line in f:
                if line.startswith("#") or not line.strip():
                    continue
                seq, rx, parse, max_tokens, aborted, *chunks = map(int, line.split())
                served[seq] = Emitted(seq, rx, parse, max_tokens, bool(aborted), np.array(chunks, dtype=np.int64))
    return served
