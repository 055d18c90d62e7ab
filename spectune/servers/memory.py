"""Memory a server uses while a cell runs: total used GPU memory from NVML when a GPU is present, else
the resident memory of the server's whole process tree (engines run their model in child processes).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import psutil


@dataclass(frozen=True, slots=True)
class MemoryStats:
    peak_mb: float | None  # None: nothing could be sampled (no GPU and no local process)
    mean_mb: float | None
    source: Literal["nvml", "rss"] | None


def gpu_present() -> bool:
    """Whether NVML sees at least one NVIDIA GPU."""
    return _nvml_reader() is not None


class MemorySampler:
    """Samples every `interval_s` on a daemon thread between start() and stop()."""

    def __init__(self, pid: int | None, interval_s: float = 0.2):
        self.pid = pid
        self.interval_s = interval_s
        self._samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._read: Callable[[], float | None] | None = None
        self._source: Literal["nvml", "rss"] | None = None

    def start(self) -> None:
        nvml = _nvml_reader()
        if nvml is not None:
            self._read, self._source = nvml, "nvml"
        elif self.pid is not None:
            pid = self.pid
            self._read, self._source = (lambda: _tree_rss_mb(pid)), "rss"
        self._samples.clear()
        self._stop.clear()
        if self._read is not None:
            self._sample()  # at least one sample, however short the window
            thread = threading.Thread(target=self._run, name="spectune-memory", daemon=True)
            thread.start()
            self._thread = thread  # only once started: a Ctrl-C inside start() must not leave stop() a thread to join

    def stop(self) -> MemoryStats:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self._sample()
        if not self._samples:
            return MemoryStats(None, None, self._source)
        return MemoryStats(max(self._samples), sum(self._samples) / len(self._samples), self._source)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        value = self._read() if self._read is not None else None
        if value is not None:
            self._samples.append(value)


def _tree_rss_mb(pid: int) -> float | None:
    """RSS of a process and all its descendants, in MiB; None once the process is gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.Error:  # a child that exited between listing and reading
            pass
    return total / 2**20


def _nvml_reader() -> Callable[[], float | None] | None:
    """A function returning used MiB summed over all GPUs, or None without NVML or GPUs."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except pynvml.NVMLError:  # no library, no driver, no device: all mean "no GPU here"
        return None
    if not handles:
        return None

    def read() -> float | None:
        try:
            return sum(pynvml.nvmlDeviceGetMemoryInfo(h).used for h in handles) / 2**20
        except pynvml.NVMLError:
            return None

    return read
