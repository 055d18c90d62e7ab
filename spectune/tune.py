"""Search SGLang adaptive configs with Optuna, scored by simulating them on the sweep's traces; write the
tuned configs and tuning.json.

Score: speedup over target-only, the geometric mean over the traces of tokens/s ratios (objective
"throughput") or of mean-TPOT ratios ("latency"). Traces: the round log of the fitted method's largest
static step count (embedded engine), a synthetic phase-shifting trace (acceptance alternating between
the best and worst measured workload, or the best and worst stretches of the round log, while the batch
size steps through the measured ones) and, without a round log, a synthetic closed-loop trace per
workload. Slots route unpadded, as SGLang 0.5.23 does unless launched with --cuda-graph-bs-decode.

Scaling out: the study is named after the run, the method and the objective and lives in an Optuna RDB
storage (default sqlite:///<RESULTS_DIR>/study.db). On each node, `spectune tune DIR --storage postgresql://...
--worker --trials N` joins it and only runs trials; afterwards one `spectune tune DIR --storage ...
--trials 0` writes the configs from the best trial of the whole study. Without --worker the command runs
its trials and then writes.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from spectune.adaptive import AGGRESSIVE_PRESET, CONSERVATIVE_PRESET, SGLANG_DEFAULT_CONFIG, AdaptiveConfig, SlotConfig
from spectune.costmodel import CostFit, breakeven_batch_size, fit_sweep, prediction_vs_measurement, recommend
from spectune.emit import (
    MODEL_FREE_METHODS,
    NEEDS_MODEL,
    VLLM_METHODS,
    VllmSpecConfig,
    llamacpp_flags,
    schedule_from_optima,
    sglang_launch_steps,
    validate_sglang_config,
    write_sglang_config,
)
from spectune.errors import SpectuneError
from spectune.simulate import (
    AdaptiveConfigPolicy,
    OraclePolicy,
    Phase,
    Policy,
    SchedulePolicy,
    SimResult,
    StaticPolicy,
    Trace,
    phase_shifting_trace,
    simulate,
    synthesize_trace,
    trace_from_round_log,
    window_profiles,
)
from spectune.store import atomic_write_bytes, load_run

OBJECTIVES = ("throughput", "latency")
CEILINGS = (0.0, 1.2, 1.67, 2.0, 3.0)  # 0 = off; the others as in SGLang's presets
PRESETS = {"sglang_default": SGLANG_DEFAULT_CONFIG, "conservative": CONSERVATIVE_PRESET, "aggressive": AGGRESSIVE_PRESET}


@dataclass(frozen=True, slots=True)
class TuneOptions:
    results_dir: Path
    storage: str | None = None  # Optuna RDB URL; None = sqlite:///<results_dir>/study.db
    trials: int = 100
    objective: str = "throughput"
    worker: bool = False  # only run trials; write nothing
    seed: int = 0  # traces use it as is; a worker's sampler adds its pid so that workers explore apart
    sglang_version: str = "0.5.23"
    out_dir: Path | None = None  # None = <results_dir>/tuned
    draft_model: str | None = None  # for the vLLM / llama.cpp outputs; default: the sweep plan's
    method: str | None = None  # the speculative method to tune; None = the one with most usable cells


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """Slot bounds come from the measured batch sizes, ladders from the step counts 0..the largest measured
    (the traces are exact below their horizon and the round cost is linear in g)."""

    batch_sizes: tuple[int, ...]
    steps: tuple[int, ...]

    def suggest(self, trial) -> AdaptiveConfig:
        bounds = [1] + [b for b in self.batch_sizes[1:] if trial.suggest_categorical(f"split_{b}", [False, True])]
        shared = dict(
            ema_alpha=trial.suggest_float("ema_alpha", 0.05, 0.9),
            update_interval=trial.suggest_int("update_interval", 1, 16),
            warmup_batches=trial.suggest_int("warmup_batches", 0, 20),
            down_hysteresis=trial.suggest_float("down_hysteresis", -1.0, 0.25),
            up_hysteresis=trial.suggest_float("up_hysteresis", -0.25, 1.0),
        )
        slots = {}
        for b in bounds:
            lo, hi = sorted((trial.suggest_categorical(f"lo_{b}", self.steps), trial.suggest_categorical(f"hi_{b}", self.steps)))
            ladder = [g for g in self.steps if lo <= g <= hi]
            if trial.suggest_categorical(f"sparse_{b}", [False, True]):
                ladder = sorted(set(ladder[::2] + ladder[-1:]))
            slots[b] = SlotConfig(candidate_steps=ladder, ceiling_coeff=trial.suggest_categorical(f"ceiling_{b}", CEILINGS), **shared)
        return AdaptiveConfig(slots=slots)

    def params_for(self, steps_by_batch_size: dict[int, int]) -> dict[str, object]:
        """The trial parameters of a config with one fixed step count per batch-size range (a slot where it
        changes), SGLang's default tuning values elsewhere."""
        params: dict[str, object] = dict(ema_alpha=0.2, update_interval=5, warmup_batches=10, down_hysteresis=-0.25, up_hysteresis=0.0)
        previous = None
        for b in self.batch_sizes:
            g = steps_by_batch_size[b]
            if previous is not None:
                params[f"split_{b}"] = g != previous
            if g != previous:
                params.update({f"lo_{b}": g, f"hi_{b}": g, f"sparse_{b}": False, f"ceiling_{b}": 0.0})
            previous = g
        return params


@dataclass(frozen=True, slots=True, eq=False)
class Score:
    speedup: float  # geometric mean over traces, vs target-only
    results: dict[str, SimResult]  # per trace


@dataclass(frozen=True, slots=True, eq=False)
class Bench:
    """Everything a trial needs, rebuilt identically (seeded) on every worker."""

    fit: CostFit
    traces: tuple[Trace, ...]
    baselines: dict[str, SimResult]  # target-only per trace
    objective: str
    space: SearchSpace

    def score(self, policy: Policy) -> Score:
        results = {t.name: simulate(t, policy, self.fit.cost) for t in self.traces}
        ratios = [
            r.tokens_per_s / self.baselines[name].tokens_per_s if self.objective == "throughput" else self.baselines[name].mean_tpot_ms / r.mean_tpot_ms
            for name, r in results.items()
        ]
        return Score(math.exp(sum(math.log(x) for x in ratios) / len(ratios)), results)

    def adaptive(self, cfg: AdaptiveConfig, name: str = "adaptive") -> AdaptiveConfigPolicy:
        return AdaptiveConfigPolicy(cfg, initial_steps=sglang_launch_steps(cfg), cuda_graph_bs=(), name=name)


@dataclass(slots=True)
class TuneOutcome:
    study_name: str
    storage: str
    num_complete: int
    num_failed: int
    summary: pd.DataFrame | None = None  # comparisons (None for a worker)
    files: list[Path] = field(default_factory=list)


def tune(options: TuneOptions, log: Callable[[str], None] = print) -> TuneOutcome:
    if options.objective not in OBJECTIVES:
        raise SpectuneError(f"--objective {options.objective!r}: must be one of {', '.join(OBJECTIVES)}")
    cells, manifest, round_logs = load_results(options.results_dir)
    bench = make_bench(cells, round_logs, options.objective, options.seed, options.method)
    storage = options.storage or f"sqlite:///{Path(options.results_dir).resolve() / 'study.db'}"
    study_name = f"spectune-{Path(options.results_dir).resolve().name}-{bench.fit.method}-{options.objective}"
    study = open_study(storage, study_name, seed=options.seed + (os.getpid() if options.worker else 0))
    evaluate = lambda cfg: _evaluate(bench, cfg, options.sglang_version)
    if not study.trials:
        enqueue_start_points(study, bench)
    run_trials(study, bench.space, evaluate, options.trials, log)
    outcome = TuneOutcome(study_name, _redact(storage), *_trial_counts(study))
    log(f"study {study_name}: {outcome.num_complete} complete, {outcome.num_failed} failed trials")
    if not options.worker:
        outdir = options.out_dir or Path(options.results_dir) / "tuned"
        outcome.summary, outcome.files = finalize(study, bench, cells, manifest, options, outdir, outcome, log)
    return outcome


def load_results(results_dir: str | Path) -> tuple[pd.DataFrame, dict, dict[str, Path]]:
    """cells, manifest and round logs of a results directory (spectune.store's layout)."""
    run = load_run(results_dir)
    if run.cells.empty:
        raise SpectuneError(f"{results_dir}: no finished cells; run `spectune sweep` first (or let it finish)")
    if run.manifest.get("plan", {}).get("schedule", "closed") != "closed":
        raise SpectuneError(f"{results_dir}/run.json: schedule is {run.manifest['plan']['schedule']!r}, where batch size is only a cap; "
                            "tune from a closed-loop sweep (schedule = \"closed\"), which measures each batch size")
    return run.cells, run.manifest, run.round_logs


def make_bench(cells: pd.DataFrame, round_logs: dict[str, Path], objective: str, seed: int, method: str | None = None) -> Bench:
    fit = fit_sweep(cells, method=method)
    preset_steps = max(s for cfg in PRESETS.values() for slot in cfg.slots.values() for s in slot.candidate_steps)
    horizon = max(fit.max_steps, preset_steps)
    traces = _traces(fit, cells, round_logs, horizon, seed)
    baselines = {t.name: simulate(t, StaticPolicy(0), fit.cost) for t in traces}
    space = SearchSpace(batch_sizes=fit.cost.batch_sizes, steps=tuple(range(fit.max_steps + 1)))
    return Bench(fit=fit, traces=tuple(traces), baselines=baselines, objective=objective, space=space)


def _traces(fit: CostFit, cells: pd.DataFrame, round_logs: dict[str, Path], horizon: int, seed: int) -> list[Trace]:
    family = cells[(cells["engine"] == fit.engine) & (cells["method"] == fit.method) & cells["adaptive_config"].isna()]
    logged = family[family["server"].isin(list(round_logs))].sort_values("num_speculative_tokens")
    traces = []
    if not logged.empty:
        server = logged["server"].iloc[-1]
        traces.append(trace_from_round_log(round_logs[server], max_steps=horizon, acceptance=fit.pooled, seed=seed))
    if len(fit.acceptance) >= 2:
        by_tokens = sorted(fit.acceptance.values(), key=lambda p: p.expected_tokens(horizon))
        high, low = by_tokens[-1], by_tokens[0]
    elif traces:
        stretches = sorted(window_profiles(traces[0]), key=lambda p: p.expected_tokens(horizon)) or [fit.pooled]
        quartile = len(stretches) // 4
        high, low = stretches[-1 - quartile], stretches[quartile]
    else:
        high = low = fit.pooled
    traces.append(phase_shifting_trace(high, low, fit.cost.batch_sizes, max_steps=horizon, seed=seed))
    if not logged.empty:
        return traces
    for i, (workload, profile) in enumerate(sorted(fit.acceptance.items())):
        phases = [Phase(workload, 200, bs, profile) for bs in fit.cost.batch_sizes]
        traces.append(synthesize_trace(phases, max_steps=horizon, seed=seed + 1 + i, name=f"closed-loop {workload}"))
    return traces


def open_study(storage: str, name: str, seed: int):
    """Create or join the study `name` in an Optuna RDB storage URL."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=seed)
    return optuna.create_study(storage=storage_for(storage), study_name=name, direction="maximize", sampler=sampler, load_if_exists=True)


def storage_for(url: str):
    """An Optuna storage for a URL. SQLite runs in WAL mode without an fsync per commit: Optuna commits
    every suggested parameter, which otherwise costs ~15 ms each here (a trial took 0.7 s). A plain
    postgresql:// URL gets the driver that is installed (SQLAlchemy 2.1 assumes psycopg 3)."""
    import importlib.util
    import sqlite3

    import optuna

    if url.startswith("postgresql://"):
        driver = "psycopg" if importlib.util.find_spec("psycopg") else "psycopg2"
        url = url.replace("postgresql://", f"postgresql+{driver}://", 1)
    if not url.startswith("sqlite:///"):
        return _shared_rdb(url)
    path = url.removeprefix("sqlite:///")

    def connect() -> sqlite3.Connection:
        conn = sqlite3.connect(path, timeout=60, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    return optuna.storages.RDBStorage(url, engine_kwargs={"creator": connect})


def _shared_rdb(url: str, attempts: int = 5):
    """Workers that start together race to create Optuna's tables in an empty database; the loser's
    CREATE fails on what the winner just made. Retrying finds the tables there."""
    import optuna
    import sqlalchemy.exc

    for attempt in range(attempts):
        try:
            return optuna.storages.RDBStorage(url)
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError):
            if attempt == attempts - 1:
                raise
            time.sleep(0.2 * (attempt + 1))  # let the other worker finish creating the schema


def enqueue_start_points(study, bench: Bench) -> None:
    """A fresh study's first trials: the best static speculative g and the best per-batch-size schedule, as
    adaptive configs. The search space is large and the configs that beat a static g are a small corner of
    it (measured: 100 TPE trials from scratch scored below target-only), so the study starts from them and
    the tuned config never scores below the best static g >= 1 or the schedule (a schedule that never
    speculates is no adaptive config and is skipped)."""
    sizes = bench.fit.cost.batch_sizes
    statics = {g: bench.score(StaticPolicy(g)).speedup for g in range(1, bench.fit.max_steps + 1)}
    best_g = max(statics, key=statics.get)
    starts = [dict.fromkeys(sizes, best_g), best_schedule(bench, best_g)]
    for steps in starts:
        if any(steps.values()):
            study.enqueue_trial(bench.space.params_for(steps), skip_if_exists=True)


def run_trials(study, space: SearchSpace, evaluate: Callable[[AdaptiveConfig], Score], n_trials: int, log: Callable[[str], None]) -> None:
    """Ask/tell loop. A trial whose config is invalid or whose simulation fails is told FAIL, with the
    cause in its user attribute "error"; the study goes on."""
    from optuna.trial import TrialState

    worker = f"{socket.gethostname()}:{os.getpid()}"
    for _ in range(n_trials):
        trial = study.ask()
        trial.set_user_attr("worker", worker)
        try:
            cfg = space.suggest(trial)
            trial.set_user_attr("config", cfg.to_dict())
            score = evaluate(cfg)
        except Exception as e:  # one bad trial must not end the study; its cause is kept
            trial.set_user_attr("error", f"{type(e).__name__}: {e}")
            study.tell(trial, state=TrialState.FAIL)
            log(f"trial {trial.number} failed: {type(e).__name__}: {e}")
            continue
        trial.set_user_attr("per_trace", _figures(score))
        study.tell(trial, score.speedup)


def _evaluate(bench: Bench, cfg: AdaptiveConfig, sglang_version: str) -> Score:
    validate_sglang_config(cfg.to_dict(), sglang_version)
    return bench.score(bench.adaptive(cfg))


def _trial_counts(study) -> tuple[int, int]:
    from optuna.trial import TrialState

    states = [t.state for t in study.get_trials(deepcopy=False)]
    return states.count(TrialState.COMPLETE), states.count(TrialState.FAIL)


def _figures(score: Score) -> dict[str, dict[str, float]]:
    return {name: {"tokens_per_s": r.tokens_per_s, "mean_tpot_ms": r.mean_tpot_ms} for name, r in score.results.items()}


# --- comparisons and outputs --------------------------------------------------------------------------------


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
    """Every comparison as a summary frame (name, policy, speedup, per-trace tokens/s and TPOT) and the
    policies themselves for tuning.json."""
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
        ("oracle", OraclePolicy(objective=bench.objective), {"candidate_steps": list(range(bench.traces[0].max_steps + 1))}),
        ("tuned_adaptive", bench.adaptive(tuned, "tuned_adaptive"), tuned.to_dict()),
    ]
    rows, policies = [], {}
    for name, policy, described in entries:
        score = statics[policy.steps] if isinstance(policy, StaticPolicy) else bench.score(policy)
        row = {"name": name, "policy": policy.label, "speedup": score.speedup}
        for trace, r in score.results.items():
            row[f"{trace}: tokens/s"] = r.tokens_per_s
            row[f"{trace}: TPOT ms"] = r.mean_tpot_ms
        rows.append(row)
        policies[name] = described
    policies["static_speedups"] = {str(g): s.speedup for g, s in statics.items()}
    return pd.DataFrame(rows), policies


def finalize(study, bench: Bench, cells: pd.DataFrame, manifest: dict, options: TuneOptions, outdir: Path,
             outcome: TuneOutcome, log: Callable[[str], None] = print) -> tuple[pd.DataFrame, list[Path]]:
    """Compare the study's best config with the baselines; write the configs and tuning.json."""
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not complete:
        raise SpectuneError(f"study {outcome.study_name}: no completed trial to write configs from; run more --trials")
    best = max(complete, key=lambda t: t.value)
    tuned = AdaptiveConfig.from_dict(best.user_attrs["config"], source=f"trial {best.number}")
    summary, policies = compare(bench, tuned)
    files, notes = write_configs(tuned, policies, bench.fit.method, manifest, options, outdir)
    for note in notes:
        log(note)
    report = {
        "results_dir": str(options.results_dir),
        "objective": options.objective,
        "score": "speedup over target-only: geometric mean over traces of "
                 + ("tokens/s ratios" if options.objective == "throughput" else "mean TPOT ratios"),
        "sglang_version": options.sglang_version,
        "routing": "unpadded batch sizes (SGLang 0.5.23 without --cuda-graph-bs-decode)",
        "study": {"name": outcome.study_name, "storage": outcome.storage, "complete": outcome.num_complete,
                  "failed": outcome.num_failed, "best_trial": best.number, "seed": options.seed},
        "comparisons": summary.to_dict("records"),
        "policies": policies,
        "tuned_launch_steps": sglang_launch_steps(tuned),
        "traces": [{"name": t.name, "rounds": t.num_rounds, "max_steps": t.max_steps,
                    "mean_batch_size": float(t.batch_sizes.mean())} for t in bench.traces],
        **fit_report(bench.fit, cells, options.objective),
        "files": [p.name for p in files],
        "notes": notes,
    }
    files.append(_write_text(outdir / "tuning.json", json.dumps(_jsonable(report), indent=2, allow_nan=False) + "\n"))
    return summary, files


def fit_report(fit: CostFit, cells: pd.DataFrame, objective: str) -> dict[str, object]:
    """The fitted model for tuning.json: cost and acceptance, recommended g, fit error, excluded cells."""
    rec = recommend(fit, objective)
    error = prediction_vs_measurement(fit, cells)["tpot_rel_error"].abs()
    excluded = fit.excluded[[c for c in ("server", "workload", "batch_size", "repeat", "status", "failure_rate", "error", "reason")
                             if c in fit.excluded]]
    return {
        "engine": fit.engine,
        "method": fit.method,
        "cost_fit": fit.table.to_dict("records"),
        "cost_fit_tpot_abs_rel_error": {"median": error.median(), "max": error.max(), "cells": len(error)},
        "acceptance": {w: {"rates": list(p.rates), "source": p.source} for w, p in fit.acceptance.items()},
        "acceptance_pooled": {"rates": list(fit.pooled.rates), "source": fit.pooled.source},
        "recommended_steps": rec.to_dict("records"),
        "breakeven_batch_size": {w: breakeven_batch_size(rec, w) for w in fit.acceptance},
        "excluded_cells": excluded.to_dict("records"),
    }


def write_configs(tuned: AdaptiveConfig, policies: dict, method: str | None, manifest: dict, options: TuneOptions,
                  outdir: Path) -> tuple[list[Path], list[str]]:
    """adaptive_spec.json, and where the method and draft model allow, the vLLM config (per-batch-size
    schedule) and llama.cpp flags (best static g >= 1). Returns the files and notes on what was skipped."""
    outdir.mkdir(parents=True, exist_ok=True)
    files = [write_sglang_config(tuned, outdir / "adaptive_spec.json", options.sglang_version)]
    notes = []
    spec = _server_spec(manifest, method)
    draft_model = options.draft_model or spec.get("draft_model")
    if not draft_model and method == "draft_model" and spec.get("engine", "embedded") == "embedded":
        from spectune.engine.shipped import draft_path  # the embedded engine's default draft

        draft_model = str(draft_path())
    missing_model = "not written: pass --draft-model PATH (the sweep plan names no draft model)"
    optima = policies["best_per_batch_schedule"]["best_steps_by_batch_size"]
    if method not in VLLM_METHODS:
        notes.append(f"vllm_speculative_config.json not written: vLLM has no method {method!r}")
    elif method in NEEDS_MODEL and not draft_model:
        notes.append(f"vllm_speculative_config.json {missing_model}")
    else:
        schedule = schedule_from_optima(optima)
        vllm = VllmSpecConfig(
            method=method,
            num_speculative_tokens=max(1, max(k for _, _, k in schedule)),
            model=None if method in MODEL_FREE_METHODS else draft_model,
            prompt_lookup_min=spec.get("prompt_lookup_min"),
            prompt_lookup_max=spec.get("prompt_lookup_max"),
            num_speculative_tokens_per_batch_size=schedule,
        )
        files.append(_write_text(outdir / "vllm_speculative_config.json", vllm.to_json() + "\n"))
    speculative = {int(g): s for g, s in policies["static_speedups"].items() if int(g) > 0}
    best_g = max(speculative, key=speculative.get)  # llama.cpp drafts on every round: g >= 1
    if method == "ngram":
        files.append(_write_text(outdir / "llamacpp_flags.txt", " ".join(llamacpp_flags(best_g, ngram=True)) + "\n"))
    elif draft_model:
        files.append(_write_text(outdir / "llamacpp_flags.txt", " ".join(llamacpp_flags(best_g, draft_model_path=draft_model)) + "\n"))
    else:
        notes.append(f"llamacpp_flags.txt {missing_model}")
    return files, notes


def _server_spec(manifest: dict, method: str | None) -> dict:
    """The plan's server entry for this method (draft model path, n-gram lookup sizes), if recorded."""
    for server in manifest.get("plan", {}).get("servers", []):
        if server.get("method") == method:
            return server
    return {}


def _write_text(path: Path, text: str) -> Path:
    atomic_write_bytes(path, text.encode())
    return path


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


def _redact(url: str) -> str:
    """The storage URL without its password, for files and logs."""
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    credentials, _, host = rest.rpartition("@")
    return f"{scheme}{sep}{credentials.split(':')[0]}:***@{host}"
