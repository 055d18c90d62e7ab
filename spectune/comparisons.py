"""What the tuned config is compared with: target-only, the best static g, the best per-batch-size schedule,
SGLang's built-in config and both presets, and an oracle, all scored on the same bench."""

from __future__ import annotations

import itertools

import pandas as pd

from spectune.adaptive import PRESETS, AdaptiveConfig
from spectune.emit import schedule_from_optima
from spectune.scoring import Bench
from spectune.simulate import OraclePolicy, Policy, SchedulePolicy, StaticPolicy


def best_schedule(bench: Bench, start_steps: int) -> dict[int, int]:
    """One g per measured batch-size range [b_i, b_i+1), by coordinate ascent on the score itself,
    starting from the best static g (so it never scores below it)."""
    steps = range(bench.fit.max_steps + 1)
    choice = {b: start_steps for b in bench.fit.cost.batch_sizes}
    score = lambda c: bench.score(SchedulePolicy(tuple(schedule_from_optima(c)))).speedup
    best, improved = score(choice), True
    while improved:
        improved = False
        for b, g in itertools.product(bench.fit.cost.batch_sizes, steps):
            candidate = {**choice, b: g}
            if g != choice[b] and (value := score(candidate)) > best * (1 + 1e-9):
                choice, best, improved = candidate, value, True
    return choice


def compare(bench: Bench, tuned: AdaptiveConfig) -> tuple[pd.DataFrame, dict[str, object]]:
    """Every comparison as a summary frame (name, policy, speedup, figures per trace or replayed traffic) and the
    policies themselves for tuning.json. In a replay the oracle picks each step's g for the most tokens per ms of
    that step: a reference, not a bound on the requests' latency."""
    statics = {g: bench.score(StaticPolicy(g)) for g in range(bench.fit.max_steps + 1)}
    best_g = max(statics, key=lambda g: statics[g].speedup)
    optima = best_schedule(bench, best_g)
    schedule = SchedulePolicy(tuple(schedule_from_optima(optima)))
    entries: list[tuple[str, Policy, object]] = [
        ("target_only", StaticPolicy(0), {"steps": 0}),
        ("best_static", StaticPolicy(best_g), {"steps": best_g}),
        ("best_per_batch_schedule", schedule, {"best_steps_by_batch_size": optima, "schedule": [list(r) for r in schedule.schedule]}),
    ]
    entries += [(name, bench.adaptive(cfg, name), cfg.to_dict()) for name, cfg in PRESETS.items()]
    entries += [
        ("oracle", OraclePolicy(objective="throughput" if bench.objective == "throughput" else "latency"),
         {"candidate_steps": list(range(bench.horizon + 1)),
          "picks": "each step's g for that step's most tokens per ms" if bench.replay else "each window's best g per round"}),
        ("tuned_adaptive", bench.adaptive(tuned, "tuned_adaptive"), tuned.to_dict()),
    ]
    rows, policies = [], {}
    for name, policy, described in entries:
        score = statics[policy.steps] if isinstance(policy, StaticPolicy) else bench.score(policy)
        row = {"name": name, "policy": policy.label, "speedup": score.speedup}
        for trace, figures in score.figures.items():
            row |= {f"{trace}: {k}": v for k, v in figures.items()}
        rows.append(row)
        policies[name] = described
    policies["static_speedups"] = {str(g): s.speedup for g, s in statics.items()}
    policies["static_figures"] = {str(g): s.figures for g, s in statics.items()}
    return pd.DataFrame(rows), policies
