"""A closed-loop cell's drain: the share of its steady throughput that its measured window keeps.

A closed-loop cell sends its N requests through batch-size slots and is measured from the first send to the last
end. Target-only requests of one output length run in lockstep and finish together; speculative ones do not (each
prompt is accepted at its own rate), so once the prompts run out the slots empty one by one and the window ends in a
tail at smaller batches. What that tail costs depends on the cell: nothing at batch 1, most where throughput still
grows with the batch (batch 4-8 here: 4-9% at g >= 3 on the embedded engine), little where the engine is saturated.
A line through neighbouring batch sizes cannot know it (benchmarks/README.md, issue 12), so the model is fitted on
steady throughput (each speculative cell's measured tok/s over its simulated share) and a predicted cell's steady
tok/s is multiplied by its own.

The simulation is a fluid closed loop: request i gains s_i tokens per round (its measured output tokens per streamed
chunk after the first: one chunk per request and round), a round with b requests running costs the fit's
t_round(b, g), and a slot takes the next request, in send order, the moment one ends (prefills and turnaround left
out: they cost the same in the tail as before it). Only the speeds' ratios matter, so a cell not measured takes the
relative speeds its prompts had in the nearest measured cell of the method: the same batch size at the nearest step
count, else the same step count at the nearest batch size (a closed loop sends every batch size the same first
prompts, in the same order).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import pandas as pd

from spectune.costmodel import CostFit, RoundCost, fit_sweep

Speeds = Mapping[str, np.ndarray]  # per cell name: its measured requests' tokens per round, in send order


def request_speeds(requests: pd.DataFrame) -> dict[str, np.ndarray]:
    """Per cell: each successful measured request's output tokens per chunk after the first, in send order. Empty
    where the requests frame lacks the columns (an older results directory)."""
    if requests.empty or not {"cell", "index", "output_tokens", "num_chunks", "error"} <= set(requests.columns):
        return {}
    ok = requests[requests["error"].isna() & (requests["num_chunks"] > 1)]
    speed = (ok["output_tokens"] - 1) / (ok["num_chunks"] - 1)
    return {str(cell): group.sort_values("index")["s"].to_numpy(float)
            for cell, group in ok.assign(s=speed)[["cell", "index", "s"]].groupby("cell")}


@dataclass(frozen=True, slots=True)
class Drain:
    share: float  # measured over steady output tokens/s
    occupancy: float  # the window's time-averaged share of slots running a request


def closed_loop(speeds: np.ndarray, batch_size: int, round_ms: Callable[[int], float]) -> Drain:
    """A closed loop of these requests (equal lengths) on batch_size slots. share: total tokens / window, over
    batch_size x the round-weighted mean tokens per round / round_ms(batch_size); occupancy: the requests' summed
    lifetimes over batch_size x the window (a request's time per token over the window's ms per token)."""
    speeds = np.asarray(speeds, dtype=float)
    speeds = speeds[speeds > 0]
    if len(speeds) == 0 or batch_size <= 1:
        return Drain(1.0, 1.0)
    queue = iter(range(len(speeds)))
    left = {i: 1.0 for _, i in zip(range(batch_size), queue)}  # share of each running request still to generate
    window = busy = 0.0
    while left:
        rounds = min(share / speeds[i] for i, share in left.items())
        window += rounds * round_ms(len(left))
        busy += rounds * round_ms(len(left)) * len(left)
        for i in list(left):
            left[i] -= rounds * speeds[i]
            if left[i] <= 1e-9:
                del left[i]
                if (j := next(queue, None)) is not None:
                    left[j] = 1.0
    steady = batch_size * len(speeds) / np.sum(1.0 / speeds) / round_ms(batch_size)
    return Drain(float(len(speeds) / window / steady), float(busy / (batch_size * window)))


def closed_speculative(cells: pd.DataFrame) -> pd.Series:
    """Which cells are closed-loop static speculative ones (those a drain applies to)."""
    schedule = cells["schedule"] if "schedule" in cells else pd.Series("closed", index=cells.index)
    return schedule.fillna("closed").eq("closed") & cells["is_speculative"].astype(bool) & (cells["num_speculative_tokens"].fillna(0) > 0)


def cell_drains(cells: pd.DataFrame, speeds: Speeds, cost: RoundCost) -> dict[object, Drain]:
    """By index, the drain of each closed-loop speculative cell whose requests' speeds are known, simulated from them
    with this round cost."""
    drains = {}
    for i in cells.index[closed_speculative(cells) & cells["cell"].isin(list(speeds))]:
        g, bs = int(cells.at[i, "num_speculative_tokens"]), int(cells.at[i, "batch_size"])
        drains[i] = closed_loop(speeds[cells.at[i, "cell"]], bs, lambda b: cost.t_round(b, g))
    return drains


def steady_cells(cells: pd.DataFrame, speeds: Speeds, cost: RoundCost) -> pd.DataFrame:
    """cells with each closed-loop speculative cell's output tokens/s divided by its simulated share (others as they
    are)."""
    out = cells.copy()
    for i, drain in cell_drains(out, speeds, cost).items():
        out.at[i, "output_throughput_tps"] /= drain.share
    return out


STEADY_PASSES = 2  # the drain is simulated with the round cost of the fit before; on synthetic cells the second pass
# brings the round cost within 0.1% of the truth (0.5% after one)


def fit_steady(cells: pd.DataFrame, speeds: Speeds, **kwargs) -> tuple[CostFit, pd.DataFrame]:
    """fit_sweep on steady_cells, the drain simulated with the round cost of the fit before (the first on the measured
    cells): the fit and the cells it saw."""
    fit, steady = fit_sweep(cells, **kwargs), cells
    kwargs = {k: v for k, v in kwargs.items() if k not in ("engine", "method")}
    for _ in range(STEADY_PASSES if speeds else 0):
        steady = steady_cells(cells, speeds, fit.cost)
        fit = fit_sweep(steady, engine=fit.engine, method=fit.method, **kwargs)
    return fit, steady


def predicted_drain(fit: CostFit, cells: pd.DataFrame, speeds: Speeds, batch_size: int, g: int, num_requests: int) -> Drain:
    """The drain of a closed-loop cell of the fit's method at (batch_size, g) with num_requests requests, its prompts'
    relative speeds from the nearest measured cells (module docstring); none (share and occupancy 1) where no cell has
    speeds."""
    spec = cells[closed_speculative(cells) & (cells["engine"] == fit.engine) & (cells["method"] == fit.method) & cells["cell"].isin(list(speeds))]
    if spec.empty or batch_size <= 1 or num_requests < 1:
        return Drain(1.0, 1.0)
    same_bs = spec[spec["batch_size"] == batch_size]
    if len(same_bs):
        distance = (same_bs["num_speculative_tokens"] - g).abs()
        near = same_bs[distance == distance.min()]
    else:
        same_g = spec[spec["num_speculative_tokens"] == g]
        pool = same_g if len(same_g) else spec
        distance = (np.log2(pool["batch_size"].astype(float)) - math.log2(batch_size)).abs()
        near = pool[distance == distance.min()]
    relative = [pd.Series(s / (len(s) / np.sum(1.0 / s))) for s in (speeds[c] for c in near["cell"]) if len(s)]
    if not relative:
        return Drain(1.0, 1.0)
    mean = pd.concat(relative).groupby(level=0).mean()
    return closed_loop(mean.reindex(range(num_requests)).fillna(1.0).to_numpy(), batch_size, lambda b: fit.cost.t_round(b, g))
