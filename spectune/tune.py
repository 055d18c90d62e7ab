"""Search SGLang adaptive configs with Optuna, scored by simulating them on the sweep's traces or on replayed
traffic; write the tuned configs and tuning.json.

Objectives "throughput" and "latency" score decode rounds (spectune.simulate.simulate): speedup over
target-only, the geometric mean over the traces of tokens/s ratios or of mean-TPOT ratios. Traces: the round
log of the fitted method's largest static step count (embedded engine), a synthetic phase-shifting trace
(acceptance alternating between the best and worst measured workload, or the best and worst stretches of the
round log, while the batch size steps through the measured ones) and, without a round log, a synthetic
closed-loop trace per workload.

Objectives "ttft", "tpot" and "e2e" score what requests experience (spectune.simulate.simulate_requests):
the traffic (default: the sweep's workload, all of it, sent on its arrival_s with at most the sweep's largest
batch size in flight, each request writing the plan's max_tokens) replayed through the embedded engine's
loop on step costs fitted from its round logs (costmodel.fit_serving_cost), with every request-round's
acceptance drawn from its workload phase's (tag's) per-position acceptance, measured on the sweep's streamed
chunks (one chunk per request and round). Score: target-only's mean metric over the policy's, the geometric
mean over REPLAY_SEEDS acceptance draws. Needs an embedded-engine sweep whose round logs hold prefill steps.

Slots route unpadded, as SGLang 0.5.23 does unless launched with --cuda-graph-bs-decode.

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
from spectune.costmodel import (
    CostFit,
    PositionalAcceptance,
    ServingCost,
    breakeven_batch_size,
    fit_positional_acceptance,
    fit_serving_cost,
    fit_sweep,
    prediction_vs_measurement,
    read_step_log,
    recommend,
)
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
    AcceptanceDraws,
    AdaptiveConfigPolicy,
    OraclePolicy,
    Phase,
    Policy,
    RequestSimResult,
    SchedulePolicy,
    SimResult,
    StaticPolicy,
    Trace,
    Traffic,
    draw_acceptance,
    phase_shifting_trace,
    simulate,
    simulate_requests,
    synthesize_trace,
    trace_from_round_log,
    window_profiles,
)
from spectune.store import Run, atomic_write_bytes, cell_id, load_run

OBJECTIVES = ("throughput", "latency", "ttft", "tpot", "e2e")
REQUEST_METRICS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2e": "e2e_ms"}  # replay objectives -> RequestSimResult figure
REPLAY_SEEDS = 3  # acceptance draws per replay: a config must win on more than one draw's luck
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
    method: str | None = None  # the speculative method to tune; None = the one that measured fastest (costmodel.fastest_method)
    traffic: str | None = None  # replay objectives: workload name or file with arrival_s; None = the sweep's
    max_concurrency: int | None = None  # replay objectives: requests in flight and engine slots; None = the sweep's largest batch size


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
    speedup: float  # geometric mean over traces (or acceptance draws), vs target-only
    figures: dict[str, dict[str, float]]  # per trace or replayed traffic: tokens/s, TPOT ms (TTFT ms, e2e ms)


@dataclass(frozen=True, slots=True, eq=False)
class Replay:
    """The replay objectives' bench: traffic, its serving cost and acceptance draws, and the engine's slots."""

    traffic: Traffic
    cost: ServingCost
    profiles: dict[str, PositionalAcceptance]  # per traffic group
    draws: tuple[AcceptanceDraws, ...]
    max_num_seqs: int

    def run(self, policy: Policy) -> dict[str, RequestSimResult]:
        return {f"{self.traffic.name} #{k}": simulate_requests(self.traffic, policy, self.cost, d, max_num_seqs=self.max_num_seqs)
                for k, d in enumerate(self.draws)}


@dataclass(frozen=True, slots=True, eq=False)
class Bench:
    """Everything a trial needs, rebuilt identically (seeded) on every worker."""

    fit: CostFit
    traces: tuple[Trace, ...]  # throughput / latency objectives
    replay: Replay | None  # ttft / tpot / e2e objectives
    baselines: dict[str, SimResult | RequestSimResult]  # target-only per trace or acceptance draw
    objective: str
    space: SearchSpace
    horizon: int  # the largest step count acceptance is known for

    def run(self, policy: Policy) -> dict[str, SimResult | RequestSimResult]:
        if self.replay is not None:
            return self.replay.run(policy)
        return {t.name: simulate(t, policy, self.fit.cost) for t in self.traces}

    def score(self, policy: Policy) -> Score:
        results = self.run(policy)
        ratios = [_gain(self.objective, self.baselines[name], r) for name, r in results.items()]
        if self.replay is None:
            figures = {name: r.figures() for name, r in results.items()}
        else:  # one set of figures: the mean over the acceptance draws
            per_draw = pd.DataFrame([r.figures() for r in results.values()])
            figures = {self.replay.traffic.name: per_draw.mean().to_dict()}
        return Score(math.exp(sum(math.log(x) for x in ratios) / len(ratios)), figures)

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


def _gain(objective: str, base: SimResult | RequestSimResult, result: SimResult | RequestSimResult) -> float:
    """How many times better than target-only `result` is on the objective (> 1: better)."""
    if objective == "throughput":
        return result.tokens_per_s / base.tokens_per_s
    if objective == "latency":
        return base.mean_tpot_ms / result.mean_tpot_ms
    metric = REQUEST_METRICS[objective]
    return getattr(base, metric) / getattr(result, metric)


def tune(options: TuneOptions, log: Callable[[str], None] = print) -> TuneOutcome:
    if options.objective not in OBJECTIVES:
        raise SpectuneError(f"--objective {options.objective!r}: must be one of {', '.join(OBJECTIVES)}")
    run = load_results(options.results_dir)
    bench = make_bench(run, options.objective, options.seed, options.method, options.traffic, options.max_concurrency)
    storage = options.storage or f"sqlite:///{Path(options.results_dir).resolve() / 'study.db'}"
    study_name = f"spectune-{Path(options.results_dir).resolve().name}-{bench.fit.method}-{options.objective}"
    if bench.replay is not None:  # a study's scores hold for one replayed traffic and concurrency only
        study_name += f"-{bench.replay.traffic.name}-c{bench.replay.max_num_seqs}"
    study = open_study(storage, study_name, seed=options.seed + (os.getpid() if options.worker else 0))
    evaluate = lambda cfg: _evaluate(bench, cfg, options.sglang_version)
    if not study.trials:
        enqueue_start_points(study, bench)
    run_trials(study, bench.space, evaluate, options.trials, log)
    outcome = TuneOutcome(study_name, _redact(storage), *_trial_counts(study))
    log(f"study {study_name}: {outcome.num_complete} complete, {outcome.num_failed} failed trials")
    if not options.worker:
        outdir = options.out_dir or Path(options.results_dir) / "tuned"
        outcome.summary, outcome.files = finalize(study, bench, run.cells, run.manifest, options, outdir, outcome, log)
    return outcome


def load_results(results_dir: str | Path) -> Run:
    """A closed-loop sweep's results directory (spectune.store's layout)."""
    run = load_run(results_dir)
    if run.cells.empty:
        raise SpectuneError(f"{results_dir}: no finished cells; run `spectune sweep` first (or let it finish)")
    if run.manifest.get("plan", {}).get("schedule", "closed") != "closed":
        raise SpectuneError(f"{results_dir}/run.json: schedule is {run.manifest['plan']['schedule']!r}, where batch size is only a cap; "
                            "tune from a closed-loop sweep (schedule = \"closed\"), which measures each batch size")
    return run


def make_bench(run: Run, objective: str, seed: int, method: str | None = None, traffic: str | None = None,
               max_concurrency: int | None = None) -> Bench:
    fit = fit_sweep(run.cells, method=method)
    preset_steps = max(s for cfg in PRESETS.values() for slot in cfg.slots.values() for s in slot.candidate_steps)
    horizon = max(fit.max_steps, preset_steps)
    space = SearchSpace(batch_sizes=fit.cost.batch_sizes, steps=tuple(range(fit.max_steps + 1)))
    if objective in REQUEST_METRICS:
        replay = make_replay(run, fit, horizon, seed, traffic, max_concurrency)
        return Bench(fit=fit, traces=(), replay=replay, baselines=replay.run(StaticPolicy(0)), objective=objective, space=space,
                     horizon=horizon)
    traces = _traces(fit, run.cells, run.round_logs, horizon, seed)
    baselines = {t.name: simulate(t, StaticPolicy(0), fit.cost) for t in traces}
    return Bench(fit=fit, traces=tuple(traces), replay=None, baselines=baselines, objective=objective, space=space, horizon=horizon)


def make_replay(run: Run, fit: CostFit, horizon: int, seed: int, traffic_source: str | None = None,
                max_concurrency: int | None = None) -> Replay:
    """The replay bench of a sweep: its traffic, serving cost and acceptance by workload phase (module docstring).
    At most max_concurrency requests in flight (default: the sweep's largest batch size), and as many engine slots:
    a trace-schedule sweep launches the engine with --max-num-seqs = its cap on requests in flight."""
    plan = run.manifest.get("plan", {})
    max_num_seqs = max_concurrency or max(plan.get("batch_sizes") or fit.cost.batch_sizes)
    traffic = replay_traffic(run, traffic_source or plan["workload"], max_num_seqs)
    profiles = phase_acceptance(run, fit)
    pooled = profiles.pop("")
    profiles = {g: profiles.get(g, pooled) for g in set(traffic.groups)}
    draws = tuple(draw_acceptance(traffic, profiles, horizon, seed + k) for k in range(REPLAY_SEEDS))
    return Replay(traffic=traffic, cost=serving_cost(run, fit), profiles=profiles, draws=draws, max_num_seqs=max_num_seqs)


def _prompt_key(request) -> str:
    """The prompt text as the sweep stores it per request (spectune.sweep)."""
    return request.prompt if request.prompt is not None else "\n".join(f"{role}: {text}" for role, text in request.messages or ())


def replay_traffic(run: Run, source: str, max_concurrency: int) -> Traffic:
    """The requests of `source` on their arrival_s, each writing the plan's max_tokens. Prompt tokens are what the
    sweep's server counted for the same prompt; prompts it never saw are estimated from their length in characters
    at the sweep's median tokens per character."""
    from spectune.workload import load_requests

    plan = run.manifest.get("plan", {})
    requests = load_requests(source, max_tokens=plan.get("max_tokens"))
    if any(r.arrival_s is None for r in requests):
        raise SpectuneError(f"traffic {source}: requests without arrival_s; replay objectives need a workload with arrival_s on every line")
    measured = run.requests.dropna(subset=["prompt_tokens"]) if "prompt" in run.requests else pd.DataFrame()
    if measured.empty:
        raise SpectuneError(f"{run.root}: no per-request prompt tokens recorded; sweep again with this spectune version")
    tokens = measured.groupby("prompt")["prompt_tokens"].median()
    per_char = float((tokens / tokens.index.str.len()).median())
    keys = [_prompt_key(r) for r in requests]
    prompt_tokens = [int(tokens[k]) if k in tokens.index else max(1, round(len(k) * per_char)) for k in keys]
    return Traffic(
        name=Path(str(source)).stem,
        arrival_ms=np.array([r.arrival_s * 1000.0 for r in requests]),
        prompt_tokens=np.array(prompt_tokens, dtype=np.int64),
        output_tokens=np.array([r.max_tokens for r in requests], dtype=np.int64),
        groups=tuple(r.tag or "" for r in requests),
        max_concurrency=max_concurrency,
    )


def _static_cells(run: Run, fit: CostFit) -> pd.DataFrame:
    cells = run.cells[(run.cells["status"] == "ok") & (run.cells["engine"] == fit.engine) & run.cells["adaptive_config"].isna()]
    return cells.assign(cell=[cell_id(s, b, r) for s, b, r in zip(cells["server"], cells["batch_size"], cells["repeat"])])


def phase_acceptance(run: Run, fit: CostFit) -> dict[str, PositionalAcceptance]:
    """Per-position acceptance along the output per workload phase (request tag) of the fitted method's static
    cells, from their streamed chunks: the first carries the prefill's token, the last may be cut at max_tokens,
    and every other carries one decode round's accepted drafts + 1. Key "" pools every phase."""
    from spectune.workload import load_requests

    cells = _static_cells(run, fit)
    cells = cells[(cells["method"] == fit.method) & (cells["num_speculative_tokens"] > 0)]
    rows = run.requests[run.requests["cell"].isin(cells["cell"]) & run.requests["error"].isna()]
    tags = {_prompt_key(r): r.tag for r in load_requests(run.manifest["plan"]["workload"])}
    steps_of = cells.set_index("cell")["num_speculative_tokens"].astype(int)
    accepted, steps, positions, groups = [], [], [], []
    for cell, prompt, chunks in zip(rows["cell"], rows["prompt"], rows["chunk_tokens"]):
        chunks = np.asarray(chunks, dtype=np.int64)
        accepted.append(np.clip(chunks[1:-1] - 1, 0, steps_of[cell]))
        steps.append(np.full(len(chunks[1:-1]), steps_of[cell]))
        positions.append(np.cumsum(chunks)[:-2])  # output tokens before each of those rounds
        groups.append(np.full(len(chunks[1:-1]), tags.get(prompt, ""), dtype=object))
    if not accepted:
        raise SpectuneError(f"{run.root}: no streamed requests of static {fit.method} cells to measure acceptance on")
    accepted, steps, positions, groups = map(np.concatenate, (accepted, steps, positions, groups))
    fit_group = lambda rows: fit_positional_acceptance(accepted[rows], steps[rows], positions[rows])
    profiles = {g: fit_group(groups == g) for g in set(groups) if g}
    profiles[""] = fit_group(np.ones(len(groups), dtype=bool))
    return profiles


def serving_cost(run: Run, fit: CostFit) -> ServingCost:
    """Step costs from the round logs of the fitted method's static servers and the target-only servers; request
    overhead from target-only requests at the smallest batch size (the engine idle when each arrives)."""
    cells = _static_cells(run, fit)
    target = cells[~cells["is_speculative"].astype(bool)]
    method = cells[(cells["method"] == fit.method) & (cells["num_speculative_tokens"] > 0)]
    logs = lambda servers: [read_step_log(run.round_logs[s]) for s in sorted(set(servers)) if s in run.round_logs]
    method_logs, target_logs = logs(method["server"]), logs(target["server"])
    if not method_logs or not target_logs:
        raise SpectuneError(f"{run.root}: replay objectives need the embedded engine's round logs of target-only and "
                            f"static {fit.method} servers; use --objective throughput or latency for other engines")
    lowest = target[target["batch_size"] == target["batch_size"].min()]
    first = run.requests[run.requests["cell"].isin(lowest["cell"]) & run.requests["error"].isna()]
    return fit_serving_cost(pd.concat(method_logs), pd.concat(target_logs), fit.cost.batch_sizes, first)


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
        trial.set_user_attr("per_trace", score.figures)
        study.tell(trial, score.speedup)


def _evaluate(bench: Bench, cfg: AdaptiveConfig, sglang_version: str) -> Score:
    validate_sglang_config(cfg.to_dict(), sglang_version)
    return bench.score(bench.adaptive(cfg))


def _trial_counts(study) -> tuple[int, int]:
    from optuna.trial import TrialState

    states = [t.state for t in study.get_trials(deepcopy=False)]
    return states.count(TrialState.COMPLETE), states.count(TrialState.FAIL)


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
        "score": _score_text(options.objective),
        "sglang_version": options.sglang_version,
        "routing": "unpadded batch sizes (SGLang 0.5.23 without --cuda-graph-bs-decode)",
        "study": {"name": outcome.study_name, "storage": outcome.storage, "complete": outcome.num_complete,
                  "failed": outcome.num_failed, "best_trial": best.number, "seed": options.seed},
        "comparisons": summary.to_dict("records"),
        "policies": policies,
        "tuned_launch_steps": sglang_launch_steps(tuned),
        "traces": [{"name": t.name, "rounds": t.num_rounds, "max_steps": t.max_steps,
                    "mean_batch_size": float(t.batch_sizes.mean())} for t in bench.traces],
        **(replay_report(bench.replay) if bench.replay is not None else {}),
        **fit_report(bench.fit, cells, options.objective),
        "files": [p.name for p in files],
        "notes": notes,
    }
    files.append(_write_text(outdir / "tuning.json", json.dumps(_jsonable(report), indent=2, allow_nan=False) + "\n"))
    return summary, files


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
            "request_overhead_ms": c.request_overhead_ms,
        },
        "replay_acceptance": {g or "(untagged)": {"bucket_tokens": p.bucket_tokens, "rates_by_bucket": [list(b.rates) for b in p.by_bucket]}
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
