"""MemorySampler on real processes: RSS of the whole process tree when there is no GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from spectune.servers.memory import MemorySampler, gpu_present

# A parent that starts a child holding 150 MiB, says so, and waits to be told to exit.
TREE = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c",
    "import sys; b = bytearray(150 * 2**20); b[::4096] = b'x' * len(b[::4096]); print('held', flush=True); sys.stdin.read()"],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
print(child.stdout.readline().strip(), flush=True)
sys.stdin.read()
child.stdin.close(); child.wait()
"""

pytestmark = pytest.mark.skipif(gpu_present(), reason="with a GPU the sampler reads NVML, not process RSS")


def test_counts_children_of_the_server_process():
    parent = subprocess.Popen([sys.executable, "-c", TREE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "held"  # the child has touched all its pages
        own = MemorySampler(parent.pid, interval_s=0.05)
        own.start()
        stats = own.stop()
    finally:
        parent.stdin.close()
        parent.wait(timeout=30)
    assert stats.source == "rss"
    assert stats.peak_mb >= 150  # the parent alone holds a few MiB: the child's memory was counted
    assert stats.mean_mb <= stats.peak_mb


def test_nothing_to_sample():
    no_pid = MemorySampler(None)
    no_pid.start()
    stats = no_pid.stop()
    assert (stats.peak_mb, stats.mean_mb, stats.source) == (None, None, None)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    sampler = MemorySampler(gone.pid)
    sampler.start()
    stats = sampler.stop()
    assert (stats.peak_mb, stats.mean_mb, stats.source) == (None, None, "rss")
