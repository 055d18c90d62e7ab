"""The throughput objective's trace simulator beside the engine, per batch size: the speedup over target-only of each
static server a sweep measured and of each server `spectune confirm` measured, against what the tuning bench's
round-log trace simulates for that policy (its rounds at the batch size's range, (previous batch size, batch size]).

    python benchmarks/trace_fidelity.py RESULTS [--method eagle]

RESULTS: a closed-loop embedded-engine sweep with round logs; the passes of its latest measured verdict (those
`spectune confirm` counted, RESULTS/tuned/tuning.json: RESULTS/confirm, or RESULTS/confirm-<k> after a refinement) are
used when present. Prints a Markdown table; nothing is written.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from spectune.adaptive import AdaptiveConfig
from spectune.analysis import speedup_table
from spectune.scoring import make_bench
from spectune.simulate import StaticPolicy, Trace, simulate
from spectune.store import load_run


def rounds_at(trace: Trace, low: int, high: int) -> Trace:
    keep = (trace.batch_sizes > low) & (trace.batch_sizes <= high)
    per_round = {f: a[keep] for f in ("lifted", "request_ids", "cap") if (a := getattr(trace, f, None)) is not None}  # (older versions lack them)
    return replace(trace, batch_sizes=trace.batch_sizes[keep], accepted=trace.accepted[keep], phases=(), **per_round)


def measured_speedups(cells: pd.DataFrame) -> pd.DataFrame:
    """[server x batch size]: output tokens/s over target-only's, paired by repeat (spectune.analysis.speedup_table)."""
    return speedup_table(cells).pivot(index="server", columns="batch_size", values="speedup")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--method", default=None)
    args = parser.parse_args()
    run = load_run(args.results)
    bench = make_bench(run, "throughput", seed=0, method=args.method)
    trace = bench.traces[0]
    sizes = sorted(int(b) for b in run.cells["batch_size"].unique())
    servers: dict[str, tuple[object, pd.Series]] = {}
    static = measured_speedups(run.cells)
    for server, g in run.cells.drop_duplicates("server").set_index("server")["num_speculative_tokens"].items():
        if g and g > 0 and server in static.index:
            servers[f"{server} (sweep)"] = (StaticPolicy(int(g)), static.loc[server])
    tuning = args.results / "tuned" / "tuning.json"
    verdict = json.loads(tuning.read_text()).get("verdict", {}) if tuning.exists() else {}
    if verdict.get("source") == "measured":
        skipped = set(verdict.get("passes_not_counted", []))
        confirm_dir = Path(verdict.get("confirm_dir") or args.results / "confirm")
        passes = sorted(p for p in confirm_dir.glob("pass-*") if int(p.name.split("-")[1]) not in skipped)
        measured_config = confirm_dir / "tuned-adaptive.json"  # the config these passes measured (tuned/ may be refined since)
        # a pass is one repeat of every server: pair by pass
        cells = pd.concat([pd.read_parquet(p / "cells.parquet").assign(repeat=i) for i, p in enumerate(passes)])
        measured = measured_speedups(cells)
        for server, row in cells.drop_duplicates("server").set_index("server").iterrows():
            if isinstance(row["adaptive_config"], str):
                path = measured_config if server == "tuned" and measured_config.exists() else Path(row["adaptive_config"])
                policy = bench.adaptive(AdaptiveConfig.from_file(path), server)
            elif row["num_speculative_tokens"] > 0:
                policy = StaticPolicy(int(row["num_speculative_tokens"]))
            else:
                continue
            servers[f"{server} (confirm, {len(passes)} passes)"] = (policy, measured.loc[server])
    print(f"{args.results}: trace {trace.name}, {trace.num_rounds} rounds; speedup over target-only, output tokens/s\n")
    print("| server | " + " | ".join(f"bs {b}: measured / simulated" for b in sizes) + " | mean abs error |")
    print("|---|" + "---|" * (len(sizes) + 1))
    errors_all = []
    for name, (policy, measured) in servers.items():
        cols, errors = [], []
        for low, high in zip([0, *sizes[:-1]], sizes):
            part = rounds_at(trace, low, high)
            simulated = simulate(part, policy, bench.fit.cost).tokens_per_s / simulate(part, StaticPolicy(0), bench.fit.cost).tokens_per_s
            errors.append(simulated / measured[high] - 1)
            cols.append(f"{measured[high]:.3f} / {simulated:.3f} ({errors[-1]:+.1%})")
        errors_all += errors
        print(f"| {name} | " + " | ".join(cols) + f" | {np.mean(np.abs(errors)):.1%} |")
    print(f"\nmean abs error over every server and batch size: {np.mean(np.abs(errors_all)):.1%}")


if __name__ == "__main__":
    main()
