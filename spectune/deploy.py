"""The outputs of a tuning run: the deployable configs (SGLang adaptive_spec.json, vLLM speculative config,
llama.cpp flags) and tuning.json with every comparison, the fit and the recommendations."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from spectune.adaptive import AdaptiveConfig
from spectune.comparisons import compare, exhaustive_report, simulated_verdict
from spectune.costmodel import CostFit, breakeven_batch_size, prediction_vs_measurement, recommend
from spectune.deploy_engines import ENGINE_NAMES, Deployment, TunedMethod, write_deployments
from spectune.emit import ADAPTIVE_ALGORITHMS, describe_sglang_config, never_drafts, sglang_launch_steps
from spectune.errors import SpectuneError
from spectune.guided import expected_tps
from spectune.holdout import holdout_report
from spectune.scoring import REPLAY_SEEDS, REQUEST_METRICS, Bench, Replay
from spectune.store import atomic_write_bytes

if TYPE_CHECKING:
    from spectune.tune import TuneOptions, TuneOutcome

def finalize(study, bench: Bench, cells: pd.DataFrame, manifest: dict, options: TuneOptions, outdir: Path,
             outcome: TuneOutcome, log: Callable[[str], None] = print, tuned: AdaptiveConfig | None = None,
             refined: dict | None = None) -> tuple[pd.DataFrame, list[Path]]:
    """Compare the study's best config (or `tuned`, a refined one: spectune.refine) with the baselines; write the
    configs and tuning.json."""
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not complete:
        raise SpectuneError(f"study {outcome.study_name}: no completed trial to write configs from; run more --trials")
    best = max(complete, key=lambda t: t.value)
    tuned = tuned or AdaptiveConfig.from_dict(best.user_attrs["config"], source=f"trial {best.number}")
    summary, policies = compare(bench, tuned)
    assessed = assess(bench, tuned, summary, policies, options, manifest)
    deployments = write_configs(tuned, policies, bench, cells, manifest, options, outdir)
    files = [d.file for d in deployments if d.file] + [outdir.resolve() / "deploy.md"]
    notes = [f"{d.engine}: {d.note}" for d in deployments]
    log_tuned(bench, tuned, policies, options.method, log)
    if (unmeasured := unmeasured_steps(bench.fit, tuned, cells)) is not None:
        log(unmeasured)
    for d in deployments:
        log(f"{ENGINE_NAMES[d.engine]} ({d.method or 'no equivalent'}): {d.file or 'no file'}\n  {d.note}")
    report = {
        "results_dir": str(options.results_dir),
        "objective": options.objective,
        "score": _score_text(options.objective),
        "sglang_version": options.sglang_version,
        "routing": "unpadded batch sizes (SGLang 0.5.23 without --cuda-graph-bs-decode)",
        "study": {"name": outcome.study_name, "storage": outcome.storage, "complete": outcome.num_complete,
                  "failed": outcome.num_failed, "best_trial": best.number, "seed": options.seed},
        "comparisons": summary.to_dict("records"),
        "policies": policies,
        "tuned_launch_steps": None if never_drafts(tuned) else sglang_launch_steps(tuned),
        "traces": [{"name": t.name, "rounds": t.num_rounds, "max_steps": t.max_steps,
                    "mean_batch_size": float(t.batch_sizes.mean())} for t in bench.traces],
        **(replay_report(bench.replay) if bench.replay is not None else {}),
        **({"traffic_source": options.traffic or manifest.get("plan", {}).get("workload"),
            "acceptance_from": str(options.acceptance_from) if options.acceptance_from else None} if bench.replay is not None else {}),
        **assessed,
        **fit_report(bench.fit, cells, options.objective),
        "holdout": holdout_report(cells, bench.speeds),
        **({"refined": refined} if refined else {}),
        "files": [p.name for p in files],
        "notes": notes,
        "unmeasured_steps": unmeasured,
        "deploy": [d.to_dict() for d in deployments],
    }
    files.append(_write_text(outdir / "tuning.json", json.dumps(_jsonable(report), indent=2, allow_nan=False) + "\n"))
    return summary, files


def log_tuned(bench: Bench, tuned: AdaptiveConfig, policies: dict, chosen: str | None, log: Callable[[str], None]) -> None:
    """The method tuned and its steps per batch size, as the console shows them."""
    if chosen:
        why = "chosen with --method"
    elif bench.fit.method.upper() in ADAPTIVE_ALGORITHMS:
        why = f"the fastest measured over target-only of those SGLang runs adaptive steps with: {'/'.join(ADAPTIVE_ALGORITHMS)}"
    else:
        why = "the fastest measured over target-only"
    log(f"tuned method: {bench.fit.method} on the {bench.fit.engine} engine ({why})")
    steps = policies["best_per_batch_schedule"]["best_steps_by_batch_size"]
    log("steps per batch size (best per-batch-size schedule, simulated): "
        + ", ".join(f"batch {b}: {g}" for b, g in sorted((int(b), int(g)) for b, g in steps.items())))
    log(f"tuned adaptive config: {describe_sglang_config(tuned)}")


def unmeasured_steps(fit: CostFit, tuned: AdaptiveConfig, cells: pd.DataFrame) -> str | None:
    """A note when the tuned config runs step counts the sweep never measured for its method: there it deploys the
    model's prediction (its held-out error says how far to trust that)."""
    ok = cells[(cells["status"] == "ok") & (cells["engine"] == fit.engine) & (cells["method"] == fit.method)]
    if "adaptive_config" in ok:
        ok = ok[ok["adaptive_config"].isna()]
    measured = sorted({int(g) for g in ok["num_speculative_tokens"].dropna() if g > 0})
    used = sorted({g for slot in tuned.slots.values() for g in slot.candidate_steps if g > 0})
    missing = [g for g in used if g not in measured]
    if not missing or not measured:
        return None
    listed = ", ".join(map(str, missing))
    return (f"the tuned config runs {fit.method} at g = {listed}, which the sweep never measured (it measured g = "
            f"{', '.join(map(str, measured))}): there it rests on the model's prediction; add {listed} to the plan's "
            "num_speculative_tokens and sweep again before relying on it")


def assess(bench: Bench, tuned: AdaptiveConfig, summary: pd.DataFrame, policies: dict, options: TuneOptions,
           manifest: dict) -> dict[str, object]:
    """tuning.json "verdict" (simulated, until `spectune confirm` measures; a measured one already there is kept
    when the tuned config did not change) and "exhaustive"."""
    from spectune.confirm import attached_servers

    verdict = simulated_verdict(bench, tuned, int(policies["best_static"]["steps"]), options.seed)
    if attached := attached_servers(manifest.get("plan") or {}, bench.fit.engine, bench.fit.method):
        verdict["text"] = str(verdict["text"]).replace(
            "not measured: run spectune confirm RESULTS", f"not measured: spectune confirm launches servers of its own, and this "
            f"sweep attached {' and '.join(attached)}; to measure it, sweep with servers spectune launches")
    previous = _previous(options, "verdict")
    if previous and previous.get("source") == "measured" and _previous(options, "policies", {}).get("tuned_adaptive") == tuned.to_dict():
        verdict = previous
    if not options.exhaustive:
        return {"verdict": verdict}
    return {"verdict": verdict, "exhaustive": exhaustive_report(bench, tuned, summary, policies)}


def _previous(options: TuneOptions, key: str, default=None):
    path = (options.out_dir or Path(options.results_dir) / "tuned") / "tuning.json"
    try:
        return json.loads(path.read_text()).get(key, default)
    except (OSError, ValueError):
        return default


def _score_text(objective: str) -> str:
    if objective in REQUEST_METRICS:
        return (f"speedup over target-only on the replayed traffic: target-only's mean {REQUEST_METRICS[objective]} / the "
                f"policy's, geometric mean over {REPLAY_SEEDS} acceptance draws")
    return "speedup over target-only: geometric mean over traces of " + ("tokens/s ratios" if objective == "throughput" else "mean TPOT ratios")


def replay_report(replay: Replay) -> dict[str, object]:
    """The replayed traffic and the serving cost it is charged, for tuning.json."""
    t, c = replay.traffic, replay.cost
    return {
        "traffic": {"name": t.name, "requests": t.num_requests, "max_concurrency": t.max_concurrency, "max_num_seqs": replay.max_num_seqs,
                    "duration_s": float(t.arrival_ms.max() / 1000.0), "mean_prompt_tokens": float(t.prompt_tokens.mean()),
                    "mean_output_tokens": float(t.output_tokens.mean()), "acceptance_draws": len(replay.draws)},
        "serving_cost": {
            "decode": [{"batch_size": b, "target_ms": t0, "draft_fixed_ms": f, "per_step_ms": s}
                       for b, t0, f, s in zip(c.decode.batch_sizes, c.decode.target_ms, c.decode.draft_fixed_ms, c.decode.per_step_ms)],
            "prefill_fixed_ms": c.prefill_fixed_ms, "prefill_per_token_ms": c.prefill_per_token_ms,
            "prefill_per_token2_ms": c.prefill_per_token2_ms,
            "request_overhead_ms": c.request_overhead_ms,
            "source": c.source, "gather_ms_per_seq": c.gather_ms_per_seq, "intake_interference_ms": c.intake_interference_ms,
            "prefill_intake_ms": c.prefill_intake_ms, "finish_ms": c.finish_ms,
        },
        "replay_acceptance": {g or "(untagged)": {"bucket_tokens": p.bucket_tokens, "rates_by_bucket": [list(b.rates) for b in p.by_bucket],
                                                  "drafted_by_bucket": list(p.drafted)}
                              for g, p in sorted(replay.profiles.items())},
    }


def fit_report(fit: CostFit, cells: pd.DataFrame, objective: str) -> dict[str, object]:
    """The fitted model for tuning.json: cost and acceptance, recommended g, fit error, excluded cells."""
    rec = recommend(fit, "throughput" if objective == "throughput" else "latency")
    error = prediction_vs_measurement(fit, cells)["tpot_rel_error"].abs()
    excluded = fit.excluded[[c for c in ("server", "workload", "batch_size", "repeat", "status", "failure_rate", "error", "reason")
                             if c in fit.excluded]]
    return {
        "engine": fit.engine,
        "method": fit.method,
        "cost_fit": fit.table.to_dict("records"),
        "cost_fit_tpot_abs_rel_error": {"median": error.median(), "max": error.max(), "cells": len(error)},
        "acceptance": {w: {"rates": list(p.rates), "source": p.source, "survival_se": list(p.survival_se)} for w, p in fit.acceptance.items()},
        "acceptance_pooled": {"rates": list(fit.pooled.rates), "source": fit.pooled.source, "survival_se": list(fit.pooled.survival_se)},
        "recommended_steps": rec.to_dict("records"),
        "breakeven_batch_size": {w: breakeven_batch_size(rec, w) for w in fit.acceptance},
        "excluded_cells": excluded.to_dict("records"),
    }


def write_configs(tuned: AdaptiveConfig, policies: dict, bench: Bench, cells: pd.DataFrame, manifest: dict, options: TuneOptions,
                  outdir: Path) -> list[Deployment]:
    """All three engines' configs, each for the fastest measured method that engine can run (deploy_engines)."""
    speculative = {int(g): s for g, s in policies["static_speedups"].items() if int(g) > 0}
    method = TunedMethod(engine=bench.fit.engine, method=bench.fit.method, config=tuned,
                         steps_by_batch_size=policies["best_per_batch_schedule"]["best_steps_by_batch_size"],
                         best_static=max(speculative, key=speculative.get))
    return write_deployments(method, cells, manifest, outdir, sglang_version=options.sglang_version, draft_model=options.draft_model,
                             expected=expected_tps(cells, bench.speeds))


def _write_text(path: Path, text: str) -> Path:
    atomic_write_bytes(path, text.encode())
    return path.resolve()


def _jsonable(obj: object) -> object:
    """Plain JSON: numpy scalars to Python, NaN to null."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
