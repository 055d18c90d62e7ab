"""Issue 4 end to end on the embedded engine: sweep the phase workload, tune an SGLang adaptive config for
n-gram speculation on the latency of the replayed traffic, then run that config on the engine against the
alternatives on the same traffic, and print what the simulator predicted next to what the engine measured.

    python benchmarks/adaptive_confirm.py [--out DIR] [--trials 100] [--passes 5] [--objective e2e]
        [--from-sweep DIR] [--tune-plan TOML] [--save-configs]

1. `spectune sweep configs/phase-tune.toml --out DIR/tune` (closed loop, batch 1-16, n-gram g = 1, 2, 3, 5);
   --from-sweep uses a finished one instead (from a spectune whose engine logs prefill steps), --tune-plan
   another plan (a smaller one for a quick run).
2. `spectune tune DIR/tune --method ngram --objective e2e --trials N`: configs scored by the request-level
   replay of the phase set on its arrival times, at most 16 in flight (spectune.simulate.simulate_requests);
   the tuned file and SGLang's built-in config are written to DIR (and with --save-configs copied to
   configs/tuned-phase-adaptive.json and configs/sglang-default-adaptive.json).
3. configs/phase-confirm.toml (the same traffic) with ngram-static at the tuning run's best static g >= 1 and the
   adaptive servers on DIR's files. Run as `passes` sweeps of one repeat each, the server order rotated every
   pass: another process loading this machine then hits every server alike (one plan with repeats measures
   each server in one block of time).

Printed per server: the simulated TTFT / TPOT / e2e (tuning.json: the mean over its acceptance draws) next to
the measured ones (mean ± sd over passes), and both rankings by the objective. Writes DIR/summary.json. Takes
about 10 minutes here with the defaults (5 passes); `--trials 5 --passes 1 --tune-plan <small plan>` checks the
loop end to end in about 3.
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

from spectune.adaptive import SGLANG_DEFAULT_CONFIG
from spectune.emit import write_sglang_config
from spectune.plan import plan_from_dict
from spectune.store import load_run
from spectune.sweep import run_sweep

REPO = Path(__file__).resolve().parent.parent
TUNE_PLAN = REPO / "configs" / "phase-tune.toml"
CONFIRM_PLAN = REPO / "configs" / "phase-confirm.toml"
SAVED = {"ngram-tuned": REPO / "configs" / "tuned-phase-adaptive.json", "ngram-sglang-default": REPO / "configs" / "sglang-default-adaptive.json"}
STATIC_SERVER = "ngram-static"
# confirm server -> the tuning.json comparison that predicts it
COMPARISON = {"target": "target_only", STATIC_SERVER: "static", "ngram-tuned": "tuned_adaptive", "ngram-sglang-default": "sglang_default"}
FIGURES = {"TTFT ms": "ttft_ms_mean", "TPOT ms": "tpot_ms_mean", "e2e ms": "e2e_ms_mean", "tokens/s": "output_throughput_tps"}
OBJECTIVE_FIGURE = {"ttft": "TTFT ms", "tpot": "TPOT ms", "e2e": "e2e ms"}


def spectune(*args: str) -> None:
    print("$ spectune " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "spectune.cli", *args], check=True)


def tune_step(tune_dir: Path, out: Path, trials: int, objective: str, plan: Path | None) -> tuple[dict, dict[str, Path]]:
    """Tune; returns tuning.json and the adaptive config file of each adaptive confirm server."""
    if plan is not None:
        spectune("sweep", str(plan), "--out", str(tune_dir))
    spectune("tune", str(tune_dir), "--method", "ngram", "--objective", objective, "--trials", str(trials), "--out", str(out / "tuned"))
    files = {"ngram-tuned": out / "tuned-phase-adaptive.json", "ngram-sglang-default": out / "sglang-default-adaptive.json"}
    shutil.copyfile(out / "tuned" / "adaptive_spec.json", files["ngram-tuned"])
    write_sglang_config(SGLANG_DEFAULT_CONFIG, files["ngram-sglang-default"])
    return json.loads((out / "tuned" / "tuning.json").read_text()), files


def best_speculative_g(tuning: dict) -> int:
    speedups = {int(g): s for g, s in tuning["policies"]["static_speedups"].items() if int(g) > 0}
    return max(speedups, key=speedups.get)


def confirm_step(out: Path, static_g: int, files: dict[str, Path], passes: int) -> list[Path]:
    raw = tomllib.loads(CONFIRM_PLAN.read_text())
    for server in raw["servers"]:
        if server["name"] == STATIC_SERVER:
            server["num_speculative_tokens"] = static_g
        if server["name"] in files:
            server["adaptive_config"] = str(files[server["name"]])
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


def measured(dirs: list[Path]) -> tuple[pd.DataFrame, set[str]]:
    """Cells of every pass and the traffic digests seen."""
    cells = pd.concat([load_run(d).cells.assign(run=i) for i, d in enumerate(dirs)], ignore_index=True)
    return cells, set(cells["traffic_digest"])


def simulated(tuning: dict, name: str, static_g: int) -> dict[str, float]:
    """The figures tune predicted for one confirm server, on the replayed traffic."""
    if name == "static":
        (figures,) = tuning["policies"]["static_figures"][str(static_g)].values()
        return figures
    row = next(c for c in tuning["comparisons"] if c["name"] == name)
    return {k: row[f"{tuning['traffic']['name']}: {k}"] for k in FIGURES}


def report(tuning: dict, static_g: int, cells: pd.DataFrame, objective: str) -> dict:
    comparisons = {c["name"]: c for c in tuning["comparisons"]}
    rows = []
    for server, name in COMPARISON.items():
        mine = cells[cells["server"] == server]
        rows.append({
            "server": server,
            "policy": f"static g={static_g}" if name == "static" else comparisons[name]["policy"],
            "sim_speedup": tuning["policies"]["static_speedups"][str(static_g)] if name == "static" else comparisons[name]["speedup"],
            "simulated": simulated(tuning, name, static_g),
            "measured": {k: mine[c].tolist() for k, c in FIGURES.items()},
        })
    key = OBJECTIVE_FIGURE[objective]
    rank = lambda value: [r["server"] for r in sorted(rows, key=value)]
    return {
        "objective": objective,
        "best_static": tuning["policies"]["best_static"],
        "best_speculative_static_g": static_g,
        "tuned_config": tuning["policies"]["tuned_adaptive"],
        "serving_cost": tuning["serving_cost"],
        "policies": rows,
        "ranking_simulated": rank(lambda r: r["simulated"][key]),
        "ranking_measured": rank(lambda r: statistics.mean(r["measured"][key])),
    }


def mean_sd(values: list[float], digits: int = 1) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else math.nan
    return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"


def print_table(summary: dict) -> None:
    print(f"\nbest static g (simulated, {summary['objective']}): {summary['best_static']['steps']}; "
          f"ngram-static runs g={summary['best_speculative_static_g']}")
    print("simulated: tune's request-level replay of the confirm traffic (mean over acceptance draws); "
          "measured: mean ± sd over passes")
    head = f"{'server':21s} {'sim x':>6s} |" + "".join(f" {k + ' sim':>11s} {k + ' measured':>16s} |" for k in FIGURES)
    print(head + "\n" + "-" * len(head))
    for row in summary["policies"]:
        cells = "".join(f" {row['simulated'][k]:11.{2 if k == 'TPOT ms' else 1}f} {mean_sd(row['measured'][k], 2 if k == 'TPOT ms' else 1):>16s} |"
                        for k in FIGURES)
        print(f"{row['server']:21s} {row['sim_speedup']:6.3f} |{cells}")
    key = OBJECTIVE_FIGURE[summary["objective"]]
    print(f"by {key}, best first: simulated {' < '.join(summary['ranking_simulated'])}")
    print(f"by {key}, best first: measured  {' < '.join(summary['ranking_measured'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "results" / f"adaptive-confirm-{dt.datetime.now():%Y%m%d-%H%M%S}")
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--objective", choices=sorted(OBJECTIVE_FIGURE), default="e2e")
    parser.add_argument("--from-sweep", type=Path, help="a finished sweep of configs/phase-tune.toml to tune instead of a new one")
    parser.add_argument("--tune-plan", type=Path, default=TUNE_PLAN, help="the closed-loop plan to sweep and tune from")
    parser.add_argument("--save-configs", action="store_true", help="copy the tuned and SGLang default configs into configs/")
    args = parser.parse_args()
    tune_dir = args.from_sweep or args.out / "tune"
    tuning, files = tune_step(tune_dir, args.out, args.trials, args.objective, None if args.from_sweep else args.tune_plan)
    static_g = best_speculative_g(tuning)
    dirs = confirm_step(args.out, static_g, files, args.passes)
    cells, digests = measured(dirs)
    if len(digests) != 1:
        raise SystemExit(f"the confirm passes sent different traffic (digests {sorted(digests)})")
    summary = report(tuning, static_g, cells, args.objective)
    summary["traffic_digest"] = digests.pop()
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print_table(summary)
    if args.save_configs:
        for server, path in files.items():
            shutil.copyfile(path, SAVED[server])
    print(f"\n{args.out / 'summary.json'}; tuned config: {files['ngram-tuned']}" + (" (saved to configs/)" if args.save_configs else ""))


if __name__ == "__main__":
    main()
