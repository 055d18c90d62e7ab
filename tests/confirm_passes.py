"""Writes tests/data/confirm_passes.csv: per-pass gains of the tuned server (log-ratios, > 0: tuned better) from
real `spectune confirm` runs, for the stopping-rule tests in test_confirm.py.

    python tests/confirm_passes.py NAME=CONFIRM_DIR:OBJECTIVE [...]

CONFIRM_DIR holds pass-01, pass-02, ... as `spectune confirm` writes them; OBJECTIVE is the tuning objective the
run confirmed (throughput, e2e, ...), which names the metric compared.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from spectune.confirm import METRICS, pass_gains, pass_table

OUT = Path(__file__).parent / "data" / "confirm_passes.csv"


def gains_of(confirm_dir: Path, objective: str) -> pd.DataFrame:
    metric, higher, _ = METRICS[objective]
    passes = len(list(confirm_dir.glob("pass-*")))
    gains = pass_gains(pass_table(confirm_dir, passes, metric), higher)
    return gains.reset_index().assign(objective=objective, higher_is_better=higher)


if __name__ == "__main__":
    frames = []
    for arg in sys.argv[1:]:
        name, rest = arg.split("=", 1)
        path, objective = rest.rsplit(":", 1)
        frames.append(gains_of(Path(path), objective).assign(run=name))
    frame = pd.concat(frames, ignore_index=True)
    frame[["run", "pass", "objective", "higher_is_better", "sglang-default", "static", "target"]].to_csv(OUT, index=False, float_format="%.6f")
    print(f"{OUT}: {len(frame)} passes from {len(frames)} runs")
