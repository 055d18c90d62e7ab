"""How steady is this machine? A fixed single-thread compute loop timed for a while, nothing else changed.

    python benchmarks/host_speed.py [--seconds 120]

A cell of a sweep is a few seconds of the engine's compute. When the machine's own speed moves (a shared VM's
neighbours, frequency changes), a cell's tokens/s moves with it whatever the model, and a held-out error cannot fall
below it. This prints how far the mean speed over a window of L seconds is from the run's overall mean (mean absolute
% deviation of the windows, consecutive and non-overlapping), for windows as long as a cell. If it falls with L,
longer cells (plan keys prompts_per_slot, min_prompts, max_tokens) steady a sweep; if it hardly falls, the speed
wanders over tens of seconds and only repeats and interleave = true help (benchmarks/README.md, issue 12). Also the
CPU time the hypervisor stole (/proc/stat), which a VM's own process list does not show.
Run it alone (under the same lock as the sweeps): other work on the machine shows up as the machine's speed.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def cpu_jiffies() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs so far, from /proc/stat: steal is time the hypervisor gave to others."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields[7], sum(fields)


def per_second(seconds: int) -> tuple[np.ndarray, np.ndarray]:
    """Median ms of a fixed batch of 256 x 256 matmuls (one thread), and % CPU stolen, in each second of the run."""
    torch.set_num_threads(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    start = time.perf_counter()
    stamps, times, jiffies = [], [], [cpu_jiffies()]
    while (now := time.perf_counter()) < start + seconds:
        if int(now - start) >= len(jiffies):
            jiffies.append(cpu_jiffies())
        for _ in range(20):
            a @ b
        stamps.append(now - start)
        times.append((time.perf_counter() - now) * 1000)
    jiffies.append(cpu_jiffies())
    second = np.asarray(stamps).astype(int)
    ms = np.asarray(times)
    steal, total = np.diff(np.asarray(jiffies), axis=0).T
    stolen = 100 * steal / np.maximum(total, 1)
    return np.array([np.median(ms[second == s]) for s in range(seconds)]), stolen[:seconds]


def window_deviation(speed: np.ndarray, length: int) -> float:
    """Mean absolute % deviation from the overall mean of speed's means over consecutive windows of `length` s."""
    windows = speed[: len(speed) // length * length].reshape(-1, length).mean(axis=1)
    return float(100 * np.mean(np.abs(windows / speed.mean() - 1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=120, help="how long to measure (s)")
    args = parser.parse_args()
    ms, stolen = per_second(args.seconds)
    speed = 1000 / ms  # work per second, so a window's mean speed is what a cell's tokens/s would see
    print(f"{args.seconds} s of one-thread 256x256 matmuls: median per second {ms.min():.2f}-{ms.max():.2f} ms "
          f"(slowest second {ms.max() / ms.min():.2f}x the fastest)")
    varies = stolen.std() > 0
    print(f"CPU stolen by the hypervisor: {stolen.mean():.1f}% of the run, at most {stolen.max():.1f}% in a second"
          + (f"; correlation of a second's steal with its ms: {np.corrcoef(stolen, ms)[0, 1]:+.2f}" if varies else ""))
    print("| window (s, like a cell this long) | windows | mean abs deviation of a window's speed from the run's |")
    print("|---|---|---|")
    for length in (1, 2, 5, 10, 20, 30):
        if args.seconds // length >= 3:
            print(f"| {length} | {args.seconds // length} | {window_deviation(speed, length):.1f}% |")


if __name__ == "__main__":
    main()
