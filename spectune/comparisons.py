"""What the tuned config is compared with: target-only, the best static g, the best per-batch-size schedule,
SGLang's built-in config and both presets, and an oracle, all scored on the same bench."""

from __future__ import annotations

import itertools
import math

import pandas as pd

from spectune.adaptive import PRESETS, AdaptiveConfig
from spectune.emit import schedule_from_optima
from spectune.scoring import REQUEST_METRICS, Bench
from spectune.simulate import OraclePolicy, Policy, SchedulePolicy, StaticPolicy, simulate


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


# --- how sure, and how far from the best SGLang config ------------------------------------------------------------

VERDICT_DRAWS = 10  # fresh acceptance draws for a replay bench's simulated verdict
BOOTSTRAP_RESAMPLES = 1000  # window resamples for a trace bench's


def simulated_verdict(bench: Bench, tuned: AdaptiveConfig, best_g: int, seed: int) -> dict[str, object]:
    """tuning.json "verdict" before any measurement: the tuned config against SGLang's default and the best static
    g (g = 0, target-only, included) on the bench, with the uncertainty the simulation itself has: over
    VERDICT_DRAWS fresh acceptance draws of a replay (t-interval of the per-draw log-ratios), or over windows of the
    traces (paired bootstrap). It says nothing of the simulator's own error: `spectune confirm` measures."""
    import numpy as np

    from spectune.confirm import COMPARED, DEFAULT, METRICS, STATIC, TARGET, Difference, difference, to_pct, verdict_text

    metric, higher, words = METRICS[bench.objective]
    policies = {"tuned": bench.adaptive(tuned, "tuned_adaptive"), DEFAULT: bench.adaptive(PRESETS["sglang_default"], "sglang_default"),
                STATIC: StaticPolicy(best_g)}
    if best_g == 0:  # the best static config is target-only
        policies = {TARGET if k == STATIC else k: v for k, v in policies.items()}
    labels = {DEFAULT: COMPARED[DEFAULT], (TARGET if best_g == 0 else STATIC): COMPARED[TARGET if best_g == 0 else STATIC]}
    if bench.replay is not None:
        from spectune.simulate import draw_acceptance, simulate_requests

        r = bench.replay
        figure = REQUEST_METRICS[bench.objective]
        gains = {c: [] for c in labels}
        for k in range(VERDICT_DRAWS):
            draws = draw_acceptance(r.traffic, r.profiles, bench.horizon, seed + 1000 + k)
            value = {name: getattr(simulate_requests(r.traffic, p, r.cost, draws, max_num_seqs=r.max_num_seqs), figure)
                     for name, p in policies.items()}
            for c in labels:
                gains[c].append(math.log(value[c] / value["tuned"]))
        diffs = tuple(difference(c, labels[c], np.array(g), 0.95, False) for c, g in gains.items())
        how = f"{VERDICT_DRAWS} acceptance draws"
    else:
        rng = np.random.default_rng(seed)
        sums = {name: [_window_sums(t, simulate(t, p, bench.fit.cost)) for t in bench.traces] for name, p in policies.items()}
        boot = {c: np.zeros(BOOTSTRAP_RESAMPLES) for c in labels}
        point = {c: 0.0 for c in labels}
        for i, trace in enumerate(bench.traces):
            pick = rng.integers(0, len(sums["tuned"][i][0]), (BOOTSTRAP_RESAMPLES, len(sums["tuned"][i][0])))
            for c in labels:
                boot[c] += _log_gain(sums["tuned"][i], sums[c][i], pick, bench.objective) / len(bench.traces)
                point[c] += _log_gain(sums["tuned"][i], sums[c][i], None, bench.objective) / len(bench.traces)
        pct = lambda g: to_pct(float(g), higher)
        diffs = tuple(Difference(c, labels[c], len(bench.traces), pct(point[c]), pct(np.percentile(boot[c], 2.5)),
                                 pct(np.percentile(boot[c], 97.5)), 0.95) for c in labels)
        how = f"{BOOTSTRAP_RESAMPLES} window resamples of {len(bench.traces)} traces"
    text = verdict_text(diffs, words, 0, "simulated", False, best_g or None).rsplit(" (", 1)[0]
    return {"text": f"{text} (simulated over {how}; not measured: run spectune confirm RESULTS)", "source": "simulated",
            "objective": bench.objective, "metric": metric, "uncertainty": how,
            "comparisons": [{"name": d.name, "label": d.label, "mean_pct": d.mean_pct, "lo_pct": d.lo_pct, "hi_pct": d.hi_pct,
                             "excludes_zero": d.excludes_zero} for d in diffs]}


def _window_sums(trace, result):
    """Per window of a simulated trace: the work (tokens at the horizon), the time the policy needs for it, and its
    TPOT numerator (spectune.simulate.simulate's definitions)."""
    import numpy as np

    from spectune.simulate import WINDOW_ROUNDS, _round_tokens

    tl = result.timeline
    window = tl["round"].to_numpy() // WINDOW_ROUNDS
    tokens = np.bincount(window, tl["tokens"].to_numpy(float))
    ms = np.bincount(window, tl["round_ms"].to_numpy(float))
    seq_ms = np.bincount(window, (tl["batch_size"] * tl["round_ms"]).to_numpy(float))
    work = np.bincount(window, _round_tokens(trace, np.full(trace.num_rounds, trace.max_steps)).astype(float))
    return work, work * ms / tokens, work * seq_ms / tokens


def _log_gain(tuned, other, pick, objective: str):
    """log(tuned / other) tokens/s (throughput) or log(other / tuned) mean TPOT (latency), on windows `pick` ([B, W]
    resamples; None: all windows once)."""
    def rate(sums):
        work, time_ms, tpot_num = (s if pick is None else s[pick] for s in sums)
        axis = None if pick is None else 1
        return work.sum(axis=axis) / time_ms.sum(axis=axis) if objective == "throughput" else tpot_num.sum(axis=axis) / work.sum(axis=axis)

    import numpy as np

    ratio = rate(tuned) / rate(other)
    return np.log(ratio) if objective == "throughput" else -np.log(ratio)


def exhaustive_report(bench: Bench, tuned: AdaptiveConfig, summary: pd.DataFrame, policies: dict[str, object]) -> dict[str, object]:
    """tuning.json "exhaustive": the best config of an exhaustive grid over SGLang's policy space on the same bench
    (spectune.exhaustive), and the shares: of the gain over target-only SGLang's policy can reach, how much the search
    found; of the oracle's gain, how much SGLang's policy reaches."""
    from spectune.adaptive import SlotConfig
    from spectune.exhaustive import grid_search

    sizes = bench.fit.cost.batch_sizes
    as_config = lambda steps: AdaptiveConfig(slots={b: SlotConfig(candidate_steps=[int(steps[b])]) for b in sizes})
    schedule = {int(b): g for b, g in policies["best_per_batch_schedule"]["best_steps_by_batch_size"].items()}
    also = [*PRESETS.values(), as_config(schedule)]
    best_g = int(policies["best_static"]["steps"])
    if best_g > 0:
        also.append(as_config(dict.fromkeys(sizes, best_g)))
    also = [c for c in also if any(s > 0 for slot in c.slots.values() for s in slot.candidate_steps)]
    result = grid_search(proxy_rounds(bench, tuned), sizes, bench.fit.max_steps, lambda cfg: bench.score(bench.adaptive(cfg)).speedup,
                         tuned, also)
    speedups = dict(zip(summary["name"], summary["speedup"]))
    tuned_x, oracle_x, best_x = float(speedups["tuned_adaptive"]), float(speedups["oracle"]), result.best_speedup
    share = lambda a, b: (a - 1.0) / (b - 1.0) if b > 1.0 else math.nan
    search_share, oracle_share = share(tuned_x, best_x), share(best_x, oracle_x)
    what = "a replay's per-step greedy choice, a reference rather than a bound" if bench.replay is not None else "the best g of every window in hindsight"
    if best_x <= 1.0:
        text = (f"no SGLang config in an exhaustive grid of {result.grid_size:.1e} beats target-only on this bench "
                f"(best {best_x:.3f}x; tuned {tuned_x:.3f}x)")
    else:
        text = (f"the search found {search_share:.0%} of what SGLang's policy can reach here (tuned {tuned_x:.3f}x vs {best_x:.3f}x, the best "
                f"of an exhaustive grid of {result.grid_size:.1e} configs), and SGLang's policy reaches "
                + (f"{oracle_share:.0%} of the hindsight oracle's gain ({oracle_x:.3f}x: {what})" if oracle_x >= best_x else
                   f"past the oracle ({oracle_x:.3f}x: {what})")
                + "; speedups over target-only on the tuning bench, simulated")
    return {"best_speedup": best_x, "search_share": search_share, "oracle_share": oracle_share, "text": text,
            "tuned_speedup": tuned_x, "oracle_speedup": oracle_x, "best_config": result.best.to_dict(),
            "best_source": str(result.exact.loc[result.exact["speedup"].idxmax(), "source"]),
            "grid_size": result.grid_size, "slot_configs_per_range": result.proxy_candidates, "rescored": len(result.exact),
            "seconds": result.seconds}


def proxy_rounds(bench: Bench, tuned: AdaptiveConfig):
    """The verify rounds the grid's first stage scores slots on: the bench's traces, or the decode steps of the tuned
    config's replays (one run per acceptance draw)."""
    import numpy as np

    from spectune.exhaustive import concat_rounds, rounds_from_accepted

    latency = bench.objective == "latency"
    parts = []
    if bench.replay is None:
        for k, t in enumerate(bench.traces):
            parts.append(rounds_from_accepted(t.batch_sizes, t.took(), None, bench.fit.cost, k, bench.horizon, latency))
    else:
        for k, result in enumerate(bench.run(bench.adaptive(tuned)).values()):
            steps = result.steps[result.steps["kind"] == "decode"]
            sizes = steps["batch_size"].to_numpy(np.int64)
            accepted = np.zeros((len(steps), int(sizes.max())), dtype=np.int64)
            for i, row in enumerate(steps["at_horizon"]):
                accepted[i, : len(row)] = row
            parts.append(rounds_from_accepted(sizes, accepted, steps["drafted"].to_numpy(bool), bench.replay.cost.decode, k,
                                              bench.horizon))
    return concat_rounds(parts)
