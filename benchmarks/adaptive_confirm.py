"""Issue 4 end to end on the embedded engine: sweep the phase workload, tune an SGLang adaptive config for
n-gram speculation, then run that config on the engine against the alternatives on the same traffic, and
print what the simulator predicted next to what the engine measured.

    python benchmarks/adaptive_confirm.py [--out DIR] [--trials 100] [--passes 5] [--from-sweep DIR]

1. `spectune sweep configs/phase-tune.toml --out DIR/tune` (closed loop, batch 1-16, n-gram g = 1, 2, 3, 5);
   --from-sweep uses a finished one instead.
2. `spectune tune DIR/tune --method ngram --trials N`; the tuned file is copied to
   configs/tuned-phase-adaptive.json and SGLang's built-in config written to configs/sglang-default-adaptive.json.
3. configs/phase-confirm.toml (the phase set replayed on its arrival times, at most 16 in flight) with
   ngram-static set to the tuning run's best static g >= 1. Run as `passes` sweeps of one repeat each, the
   server order rotated every pass: another process loading this machine then hits every server alike
   (one plan with repeats measures each server in one block of time).

Measured tokens/s of a replayed trace is bound by the arrival rate (the set's tokens over its ~16 s) for
every server that keeps up, so the policies differ in latency: TTFT, TPOT and the time a request takes
(e2e). The simulator's figure, time per token with the prefills' share (the cost is fitted from closed-loop
tokens/s), compares with e2e / output tokens; its speedup with target e2e / e2e. Simulated: the tuning
traces (tuning.json) and the confirm traffic itself (the rounds the ngram-static server logged, replayed
through each policy with the fitted cost). Writes DIR/summary.json. Takes about 10 minutes here (5 passes).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import shutil
import statistics
import subprocess
import sys
import tomllib
from pathlib import Path

import pandas as pd

from spectune.adaptive import SGLANG_DEFAULT_CONFIG, AdaptiveConfig
from spectune.emit import write_sglang_config
from spectune.plan import plan_from_dict
from spectune.simulate import StaticPolicy, simulate, trace_from_round_log
from spectune.store import load_run
from spectune.sweep import run_sweep
from spectune.tune import load_results, make_bench
from spectune.workload import load_requests

REPO = Path(__file__).resolve().parent.parent
TUNE_PLAN = REPO / "configs" / "phase-tune.toml"
CONFIRM_PLAN = REPO / "configs" / "phase-confirm.toml"
TUNED_FILE = REPO / "configs" / "tuned-phase-adaptive.json"
DEFAULT_FILE = REPO / "configs" / "sglang-default-adaptive.json"
STATIC_SERVER = "ngram-static"
# confirm server -> the tuning.json comparison that predicts it
COMPARISON = {"target": "target_only", STATIC_SERVER: "static", "ngram-tuned": "tuned_adaptive", "ngram-sglang-default": "sglang_default"}
MEASURED = {"tokens_per_s": "output_throughput_tps", "ttft_ms": "ttft_ms_mean", "tpot_ms": "tpot_ms_mean", "e2e_ms": "e2e_ms_mean"}


def spectune(*args: str) -> None:
    print("$ spectune " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "spectune.cli", *args], check=True)


def tune_step(tune_dir: Path, trials: int, sweep: bool) -> dict:
    if sweep:
        spectune("sweep", str(TUNE_PLAN), "--out", str(tune_dir))
    spectune("tune", str(tune_dir), "--method", "ngram", "--trials", str(trials))
    shutil.copyfile(tune_dir / "tuned" / "adaptive_spec.json", TUNED_FILE)
    write_sglang_config(SGLANG_DEFAULT_CONFIG, DEFAULT_FILE)
    return json.loads((tune_dir / "tuned" / "tuning.json").read_text())


def best_speculative_g(tuning: dict) -> int:
    speedups = {int(g): s for g, s in tuning["policies"]["static_speedups"].items() if int(g) > 0}
    return max(speedups, key=speedups.get)


def confirm_step(out: Path, static_g: int, passes: int) -> list[Path]:
    raw = tomllib.loads(CONFIRM_PLAN.read_text())
    for server in raw["servers"]:
        if server["name"] == STATIC_SERVER:
            server["num_speculative_tokens"] = static_g
    servers = raw["servers"]
    dirs = []
    for i in range(passes):
        order = servers[i % len(servers):] + servers[: i % len(servers)]
        plan = plan_from_dict({**raw, "repeats": 1, "servers": order}, source=str(CONFIRM_PLAN))
        print(f"confirm pass {i + 1}/{passes}: {', '.join(s['name'] for s in order)}", flush=True)
        dirs.append(out / f"confirm-{i + 1}")
        outcome = run_sweep(plan, dirs[-1])
        if outcome.failed or outcome.interrupted:
            raise SystemExit(f"{dirs[-1]}: {outcome.failed} cell(s) failed; see its cells/*.json")
    return dirs


def measured(dirs: list[Path]) -> tuple[pd.DataFrame, pd.DataFrame, set[str]]:
    """Cells of every pass, requests with their burst size, and the traffic digests seen."""
    phase = load_requests("phase")
    arrivals = pd.Series([r.arrival_s for r in phase])
    burst = arrivals.map(arrivals.value_counts())  # requests arriving together
    cells, requests = [], []
    for i, d in enumerate(dirs):
        run = load_run(d)
        cells.append(run.cells.assign(run=i))
        requests.append(run.requests.assign(run=i, server=run.requests["cell"].str.split("__").str[0]))
    requests = pd.concat(requests, ignore_index=True)
    requests["burst"] = requests["index"].map(burst)
    cells = pd.concat(cells, ignore_index=True)
    return cells, requests, set(cells["traffic_digest"])


def simulated_on_confirm(tune_dir: Path, dirs: list[Path], static_g: int) -> dict[str, float]:
    """ms per token of each policy replayed through the rounds ngram-static logged in the confirm runs, with
    the cost fitted from the tuning sweep."""
    cells, _, round_logs = load_results(tune_dir)
    bench = make_bench(cells, round_logs, "throughput", 0, "ngram")
    policies = {
        "target": StaticPolicy(0),
        STATIC_SERVER: StaticPolicy(static_g),
        "ngram-tuned": bench.adaptive(AdaptiveConfig.from_file(TUNED_FILE)),
        "ngram-sglang-default": bench.adaptive(AdaptiveConfig.from_file(DEFAULT_FILE)),
    }
    horizon = bench.traces[0].max_steps
    traces = [trace_from_round_log(d / "rounds" / f"{STATIC_SERVER}.jsonl", max_steps=horizon, acceptance=bench.fit.pooled) for d in dirs]
    out = {}
    for name, policy in policies.items():
        results = [simulate(t, policy, bench.fit.cost) for t in traces]
        out[name] = sum(r.mean_tpot_ms * r.work_tokens for r in results) / sum(r.work_tokens for r in results)
    return out


def report(tuning: dict, static_g: int, cells: pd.DataFrame, requests: pd.DataFrame, sim_confirm: dict[str, float]) -> dict:
    comparisons = {c["name"]: c for c in tuning["comparisons"]}
    static_speedups = tuning["policies"]["static_speedups"]
    target = cells[cells["server"] == "target"]
    rows = []
    for server, name in COMPARISON.items():
        mine = cells[cells["server"] == server]
        by_burst = requests[requests["server"] == server].groupby("burst")["tpot_ms"].mean()
        rows.append({
            "server": server,
            "policy": f"static g={static_g}" if name == "static" else comparisons[name]["policy"],
            "sim_speedup_tuning_traces": static_speedups[str(static_g)] if name == "static" else comparisons[name]["speedup"],
            "sim_confirm_ms_per_token": sim_confirm[server],
            "sim_confirm_speedup": sim_confirm["target"] / sim_confirm[server],
            **{f"measured_{m}": mine[c].tolist() for m, c in MEASURED.items()},
            "measured_e2e_speedup": paired_ratios(target, mine, "e2e_ms_mean"),
            "measured_tpot_speedup": paired_ratios(target, mine, "tpot_ms_mean"),
            "measured_tpot_ms_by_burst": {int(b): v for b, v in by_burst.items()},
        })
    return {"best_static": tuning["policies"]["best_static"], "best_speculative_static_g": static_g,
            "tuned_config": tuning["policies"]["tuned_adaptive"], "policies": rows}


def paired_ratios(target: pd.DataFrame, mine: pd.DataFrame, column: str) -> list[float]:
    """target / this server, per pass: the two ran minutes apart, not hours, so load drift cancels more."""
    return (target.set_index("run")[column] / mine.set_index("run")[column]).tolist()


def mean_sd(values: list[float], digits: int = 1) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else math.nan
    return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"


def print_table(summary: dict) -> None:
    print(f"\nbest static g (simulated): {summary['best_static']['steps']}; ngram-static runs g={summary['best_speculative_static_g']}")
    print("simulated: speedup over target-only on the tuning traces (tokens/s ratio) and on the confirm rounds "
          "(ms per token ratio), and ms per token there")
    print("measured (mean ± sd over passes): output tokens/s, TTFT / TPOT / e2e ms, e2e and TPOT speedup over target-only "
          "(per pass), TPOT ms for requests arriving in bursts of 1 / 4 / 16")
    head = (f"{'server':21s} {'sim x':>6s} {'sim x':>6s} {'ms/tok':>6s} | {'tok/s':>12s} {'TTFT ms':>12s} {'TPOT ms':>12s} "
            f"{'e2e ms':>12s} {'e2e x':>13s} {'TPOT x':>13s} | TPOT by burst")
    print(head + "\n" + "-" * len(head))
    for row in summary["policies"]:
        burst = " / ".join(f"{v:.2f}" for v in row["measured_tpot_ms_by_burst"].values())
        print(f"{row['server']:21s} {row['sim_speedup_tuning_traces']:6.3f} {row['sim_confirm_speedup']:6.3f} "
              f"{row['sim_confirm_ms_per_token']:6.2f} | {mean_sd(row['measured_tokens_per_s']):>12s} "
              f"{mean_sd(row['measured_ttft_ms']):>12s} {mean_sd(row['measured_tpot_ms'], 2):>12s} {mean_sd(row['measured_e2e_ms']):>12s} "
              f"{mean_sd(row['measured_e2e_speedup'], 3):>13s} {mean_sd(row['measured_tpot_speedup'], 3):>13s} | {burst}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "results" / f"adaptive-confirm-{dt.datetime.now():%Y%m%d-%H%M%S}")
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--from-sweep", type=Path, help="a finished sweep of configs/phase-tune.toml to tune instead of a new one")
    args = parser.parse_args()
    tune_dir = args.from_sweep or args.out / "tune"
    tuning = tune_step(tune_dir, args.trials, sweep=args.from_sweep is None)
    static_g = best_speculative_g(tuning)
    dirs = confirm_step(args.out, static_g, args.passes)
    cells, requests, digests = measured(dirs)
    if len(digests) != 1:
        raise SystemExit(f"the confirm passes sent different traffic (digests {sorted(digests)})")
    summary = report(tuning, static_g, cells, requests, simulated_on_confirm(tune_dir, dirs, static_g))
    summary["traffic_digest"] = digests.pop()
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print_table(summary)
    print(f"\n{args.out / 'summary.json'}; tuned config: {TUNED_FILE.relative_to(REPO)}")


if __name__ == "__main__":
    main()
