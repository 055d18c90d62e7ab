"""SYNTHETIC sweep results made from a known cost and acceptance model (not measurements).

The tests of the cost model, the simulator and the tuner fit these and check that they get the known
model back. Files are written exactly as a sweep writes them (run.json, cells/*.json, cells.parquet,
rounds/<server>.jsonl) so the real loaders read them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from spectune.costmodel import AcceptanceProfile, RoundCost
from spectune.store import RunStore

# Known truth. Speculation pays at small batch and stops paying at large batch (the draft and verify
# terms grow with the batch); "quote" is easy to draft, "random" is hard.
SYNTHETIC_COST = RoundCost(
    batch_sizes=(1, 2, 4, 8, 16),
    target_ms=(10.0, 10.6, 11.8, 14.5, 20.0),
    draft_fixed_ms=(0.8, 0.9, 1.1, 1.6, 2.5),
    per_step_ms=(1.2, 1.6, 2.4, 4.4, 9.0),
)
# Draft terms exactly the model's joint form (costmodel._joint_columns): ms per round and per draft position, plus
# shares of target-only's round (itself a quadratic in log batch size), per step a line in log batch size. A held-out
# batch size's terms, inside the range or beyond it, are predicted without error.
_SHARE_TARGET = tuple(3.0 * math.exp(0.15 * math.log(b) + 0.09 * math.log(b) ** 2) for b in (1, 2, 4, 8, 16))
SHARE_COST = RoundCost(batch_sizes=(1, 2, 4, 8, 16), target_ms=_SHARE_TARGET,
                       draft_fixed_ms=tuple(0.4 + 0.25 * t for t in _SHARE_TARGET),
                       per_step_ms=tuple(0.15 + t * (0.06 + 0.05 * math.log2(b)) for b, t in zip((1, 2, 4, 8, 16), _SHARE_TARGET)))
SYNTHETIC_PROFILES = {
    "quote": AcceptanceProfile((0.95, 0.93, 0.92, 0.9, 0.9, 0.88, 0.88, 0.86)),
    "random": AcceptanceProfile((0.35, 0.3, 0.3, 0.25, 0.25, 0.2, 0.2, 0.2)),
}
SYNTHETIC_STEPS = (1, 2, 3, 4, 6, 8)


def synthetic_cells(
    cost: RoundCost = SYNTHETIC_COST,
    profiles: dict[str, AcceptanceProfile] = SYNTHETIC_PROFILES,
    steps: tuple[int, ...] = SYNTHETIC_STEPS,
    repeats: int = 3,
    noise: float = 0.02,
    seed: int = 0,
    with_accept_pos: bool = True,
) -> pd.DataFrame:
    """One row per cell, with the column set of a real sweep; TPOT and acceptance carry seeded noise.
    Adds two failing cells whose figures are nonsense: a fit that used them would be far off."""
    rng = np.random.default_rng(seed)
    k_max = max(steps)
    rows = []
    for workload, profile in profiles.items():
        for g in (0, *steps):
            server = (f"draft-g{g}" if g else "target") + f"-{workload}"
            for bs in cost.batch_sizes:
                for repeat in range(repeats):
                    tokens = profile.expected_tokens(g) * (1 + noise * rng.standard_normal()) if g else 1.0
                    tpot = cost.t_round(bs, g) / profile.expected_tokens(g) * (1 + noise * rng.standard_normal())
                    survival = profile.survival_at(g) if g else np.zeros(0)
                    row = {
                        "server": server,
                        "engine": "embedded",
                        "method": "draft_model" if g else None,
                        "is_speculative": g > 0,
                        "num_speculative_tokens": g,
                        "adaptive_config": None,
                        "batch_size": bs,
                        "repeat": repeat,
                        "status": "ok",
                        "error": None,
                        "workload": workload,
                        "tpot_ms_mean": tpot,
                        "itl_ms_mean": tpot * tokens,
                        "ttft_ms_mean": 30.0,
                        "output_throughput_tps": bs * 1000.0 / tpot,
                        "num_requests": 4 * bs,
                        "num_failed": 0,
                        "failure_rate": 0.0,
                        "acceptance_rate": (tokens - 1) / g if g else math.nan,
                        "acceptance_length": tokens if g else math.nan,
                    }
                    for i in range(1, k_max + 1):
                        row[f"accept_pos_{i}"] = float(survival[i - 1]) if (with_accept_pos and i <= g) else math.nan
                    rows.append(row)
    bad = dict(rows[-1], repeat=99, status="failed", error="server crashed", tpot_ms_mean=500.0)
    flaky = dict(rows[-2], repeat=98, num_failed=3, failure_rate=0.25, tpot_ms_mean=400.0)
    return pd.DataFrame(rows + [bad, flaky])


def synthetic_round_log(
    path: Path,
    profile_by_phase: list[tuple[AcceptanceProfile, int, int]],
    num_steps: int,
    cost: RoundCost = SYNTHETIC_COST,
    seed: int = 0,
) -> None:
    """An embedded-engine round log at a static num_steps: (profile, batch size, rounds) stretches."""
    rng = np.random.default_rng(seed)
    t = 0.0
    with path.open("w") as f:
        for profile, bs, num_rounds in profile_by_phase:
            for _ in range(num_rounds):
                draws = rng.random((bs, num_steps)) < profile.rate_vector(num_steps)
                accepted = np.cumprod(draws, axis=1).sum(axis=1)
                round_ms = cost.t_round(bs, num_steps)
                t += round_ms / 1000
                record = {"t_s": t, "batch_size": bs, "num_steps": num_steps, "proposed": [num_steps] * bs,
                          "accepted": accepted.tolist(), "round_ms": round_ms}
                f.write(json.dumps(record) + "\n")


def write_synthetic_results(root: Path, *, seed: int = 0, profiles: dict[str, AcceptanceProfile] = SYNTHETIC_PROFILES) -> Path:
    """A results directory holding the synthetic cells and, for the largest-g server of the first workload,
    a round log that alternates quote and random phases while the batch size changes."""
    cells = synthetic_cells(profiles=profiles, seed=seed)
    store = RunStore.create(root, {"name": root.name, "plan": {"workload": "synthetic"}})
    for row in cells.to_dict("records"):
        store.write_cell({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}, None)
    cells.to_parquet(root / "cells.parquet", index=False)
    quote, random = SYNTHETIC_PROFILES["quote"], SYNTHETIC_PROFILES["random"]
    stretches = [(p, bs, 120) for bs in (1, 4, 16, 2, 8) for p in (quote, random)]
    server = f"draft-g{max(SYNTHETIC_STEPS)}-{next(iter(profiles))}"
    synthetic_round_log(store.round_log_path(server), stretches, max(SYNTHETIC_STEPS), seed=seed)
    return root
