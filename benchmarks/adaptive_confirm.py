"""Tune on the embedded engine, then confirm on it, measured, with the same code a user runs: sweep a closed-loop plan,
`spectune tune` (request-level replay objective by default), `spectune confirm` (paired passes of the tuned config,
SGLang's default config, the best static g and target-only on the replayed traffic, server order rotated, until the
paired intervals settle; spectune.confirm), then print what the replay predicted for every server next to what the
engine measured.

    python benchmarks/adaptive_confirm.py [--out DIR] [--plan configs/phase-tune.toml] [--from-sweep DIR]
        [--method ngram] [--objective e2e] [--trials 100] [--max-passes 20] [--run-passes N] [--save-configs]

Resumable: with --from-sweep DIR (a finished sweep) and the tuned files already in DIR/tuned, it only runs the
passes still missing (--run-passes N: at most N now). Writes DIR/summary.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd

from spectune.calibration import replay_vs_measured
from spectune.confirm import METRICS, best_static_steps
from spectune.store import load_run

REPO = Path(__file__).resolve().parent.parent
SAVED = REPO / "configs" / "tuned-phase-adaptive.json"


def spectune(*args: str) -> None:
    print("$ spectune " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "spectune.cli", *args], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "results" / f"adaptive-confirm-{dt.datetime.now():%Y%m%d-%H%M%S}")
    parser.add_argument("--plan", type=Path, default=REPO / "configs" / "phase-tune.toml", help="closed-loop plan to sweep and tune from")
    parser.add_argument("--from-sweep", type=Path, help="a finished sweep to tune and confirm instead of a new one")
    parser.add_argument("--method", default="ngram")
    parser.add_argument("--objective", choices=sorted(METRICS), default="e2e")
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--max-passes", type=int, default=20)
    parser.add_argument("--run-passes", type=int)
    parser.add_argument("--save-configs", action="store_true", help=f"copy the tuned config to {SAVED.relative_to(REPO)}")
    args = parser.parse_args()
    sweep = args.from_sweep or args.out / "sweep"
    if args.from_sweep is None and not (sweep / "run.json").exists():
        spectune("sweep", str(args.plan), "--out", str(sweep))
    if not (sweep / "tuned" / "tuning.json").exists():
        spectune("tune", str(sweep), "--method", args.method, "--objective", args.objective, "--trials", str(args.trials))
    confirm = ["confirm", str(sweep), "--max-passes", str(args.max_passes)]
    spectune(*confirm, *(["--run-passes", str(args.run_passes)] if args.run_passes else []))
    tuning = json.loads((sweep / "tuned" / "tuning.json").read_text())
    passes = sorted(p for p in (sweep / "confirm").glob("pass-*") if (p / "run.json").exists())
    table = replay_vs_measured(load_run(sweep), [load_run(p) for p in passes], calibrated=True, method=tuning["method"])
    summary = {"verdict": tuning.get("verdict"), "exhaustive": tuning.get("exhaustive"), "best_static_g": best_static_steps(tuning),
               "replay_vs_measured": table.to_dict("records")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    pd.set_option("display.width", 200)
    cols = [c for c in table.columns if c.endswith(("_predicted", "_measured", "_error"))]
    print(table[["server", "passes", *cols]].to_string(index=False, float_format="%.3f"))
    print(f"\n{tuning['verdict']['text']}\n{tuning.get('exhaustive', {}).get('text', '')}")
    if args.save_configs:
        shutil.copyfile(sweep / "tuned" / "adaptive_spec.json", SAVED)
    print(f"\n{args.out / 'summary.json'}")


if __name__ == "__main__":
    main()
