"""The replay's error pooled over independent experiments: each a fit sweep and the passes measured right after it
(the JSON files benchmarks/calibration.py writes, one per experiment and batch size).

    python benchmarks/calibration_pool.py A.json B.json ... [--speed fit|target]

One experiment's error carries the host's speed in that hour (its passes against its fit); over several, the mean
error per server is what the replay gets wrong every time, and the SD between experiments what the host adds.
--speed: the replay at the fit's speed (default, a prediction made before the passes) or at the speed target-only
ran in each pass. Prints, per server and figure (TTFT, TPOT, e2e), the relative error of each experiment and their
mean, SD and largest absolute value, in %.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import pandas as pd

TABLES = {"fit": "after", "target": "after, each pass at the speed target-only ran in it"}
SPEEDS = {"fit": "the fit's speed", "target": "the speed target-only ran at in each pass"}
FIGURES = ("ttft", "tpot", "e2e")


def pooled(paths: list[Path], speed: str) -> pd.DataFrame:
    rows = []
    for path in paths:
        result = json.loads(path.read_text())
        for row in result[TABLES[speed]]:
            rows += [{"experiment": str(path), "server": row["server"], "figure": f, "error_pct": 100 * row[f"{f}_ms_error"],
                      "passes": result["passes"] - len(result.get("not_counted") or [])} for f in FIGURES]
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="benchmarks/calibration.py's JSON files, one per experiment")
    parser.add_argument("--speed", choices=sorted(TABLES), default="fit")
    args = parser.parse_args()
    errors = pooled(args.results, args.speed)
    for path, passes in errors.groupby("experiment")["passes"].first().items():
        print(f"{path}: {passes} counted passes")
    table = errors.pivot_table(index=["server", "figure"], columns="experiment", values="error_pct")
    table.columns = [f"exp {i + 1}" for i in range(len(table.columns))]
    values = table.to_numpy()
    table["mean"] = values.mean(axis=1)
    table["sd"] = [statistics.stdev(v) if len(v) > 1 else float("nan") for v in values]
    table["max abs"] = abs(values).max(axis=1)
    print(f"relative error of the replay at {SPEEDS[args.speed]}, %, per experiment and pooled:")
    print(table.round(1).to_string())


if __name__ == "__main__":
    main()
