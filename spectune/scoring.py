"""What a tuning trial is scored on: a bench of simulated traces or replayed traffic, rebuilt identically (seeded)
on every worker, and the speedup of a step policy over target-only on it.

Objectives "throughput" and "latency" score decode rounds (spectune.simulate.simulate): speedup over
target-only, the geometric mean over the traces of tokens/s ratios or of mean-TPOT ratios. Traces: the round
log of the fitted method's largest static step count (embedded engine), its rounds at a smaller g given the
acceptance measured at g by the other static servers' round logs (simulate.lift_trace), a synthetic phase-shifting trace
(acceptance alternating between the best and worst measured workload, or the best and worst stretches of the
round log, while the batch size steps through the measured ones) and, without a round log, a synthetic
closed-loop trace per workload.

Objectives "ttft", "tpot" and "e2e" score what requests experience (spectune.simulate.simulate_requests):
the traffic (default: the sweep's workload, all of it, sent on its arrival_s with at most the sweep's largest
batch size in flight, each request writing the plan's max_tokens) replayed through the embedded engine's
loop on step costs fitted from its round logs (costmodel.fit_serving_cost), with every request-round's
acceptance drawn from its workload phase's (tag's) per-position acceptance, measured on the sweep's streamed
chunks (one chunk per request and round), or on another run's static servers (make_bench's acceptance_run: static
servers measured on the traffic's own prompts, whose acceptance other prompts of their tag do not carry).
Score: target-only's mean metric over the policy's, the geometric mean over REPLAY_SEEDS acceptance draws.
Needs an embedded-engine sweep whose round logs hold prefill steps.

Slots route unpadded, as SGLang 0.5.23 does unless launched with --cuda-graph-bs-decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from spectune.adaptive import PRESETS, AdaptiveConfig
from spectune.costmodel import (
    CostFit,
    PositionalAcceptance,
    ServingCost,
    fit_positional_acceptance,
    fit_serving_cost,
    read_step_log,
)
from spectune.drain import Speeds, fit_steady, request_speeds
from spectune.emit import never_drafts, sglang_launch_steps
from spectune.errors import SpectuneError
from spectune.search import SearchSpace
from spectune.simulate import (
    AcceptanceDraws,
    AdaptiveConfigPolicy,
    Phase,
    Policy,
    RequestSimResult,
    SimResult,
    StaticPolicy,
    Trace,
    Traffic,
    draw_acceptance,
    lift_trace,
    phase_shifting_trace,
    read_round_log,
    request_keys,
    simulate,
    simulate_requests,
    survival_by_steps,
    synthesize_trace,
    trace_from_round_log,
    window_profiles,
)
from spectune.store import Run, cell_id

REQUEST_METRICS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2e": "e2e_ms"}  # replay objectives -> RequestSimResult figure


REPLAY_SEEDS = 3  # acceptance draws per replay: a config must win on more than one draw's luck


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
    speeds: Speeds  # the sweep's per-request speeds, for its closed-loop cells' drain (spectune.drain)

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
        steps = 0 if never_drafts(cfg) else sglang_launch_steps(cfg)
        return AdaptiveConfigPolicy(cfg, initial_steps=steps, cuda_graph_bs=(), name=name)


def _gain(objective: str, base: SimResult | RequestSimResult, result: SimResult | RequestSimResult) -> float:
    """How many times better than target-only `result` is on the objective (> 1: better)."""
    if objective == "throughput":
        return result.tokens_per_s / base.tokens_per_s
    if objective == "latency":
        return base.mean_tpot_ms / result.mean_tpot_ms
    metric = REQUEST_METRICS[objective]
    return getattr(base, metric) / getattr(result, metric)


def make_bench(run: Run, objective: str, seed: int, method: str | None = None, traffic: str | None = None,
               max_concurrency: int | None = None, acceptance_run: Run | None = None) -> Bench:
    """acceptance_run: a run of static servers of the method measured on the traffic's prompts; the replay then
    draws their acceptance instead of the sweep's (replay objectives only)."""
    speeds = request_speeds(run.requests)
    fit, _ = fit_steady(run.cells, speeds, method=method)
    preset_steps = max(s for cfg in PRESETS.values() for slot in cfg.slots.values() for s in slot.candidate_steps)
    horizon = max(fit.max_steps, preset_steps)
    space = SearchSpace(batch_sizes=fit.cost.batch_sizes, steps=tuple(range(fit.max_steps + 1)))
    if objective in REQUEST_METRICS:
        from spectune.calibration import served_acceptance

        served = None if acceptance_run is None else served_acceptance(acceptance_run, fit.engine, fit.method)
        replay = make_replay(run, fit, horizon, seed, traffic, max_concurrency, acceptance=served)
        return Bench(fit=fit, traces=(), replay=replay, baselines=replay.run(StaticPolicy(0)), objective=objective, space=space,
                     horizon=horizon, speeds=speeds)
    traces = _traces(run, fit, horizon, seed)
    baselines = {t.name: simulate(t, StaticPolicy(0), fit.cost) for t in traces}
    return Bench(fit=fit, traces=tuple(traces), replay=None, baselines=baselines, objective=objective, space=space, horizon=horizon,
                 speeds=speeds)


def make_replay(run: Run, fit: CostFit, horizon: int, seed: int, traffic_source: str | None = None,
                max_concurrency: int | None = None, calibrated: bool = True, closed_loop: ClosedLoop | None = None,
                acceptance: dict[str, PositionalAcceptance] | None = None) -> Replay:
    """The replay bench of a sweep: its traffic, serving cost and acceptance by workload phase (module docstring).
    At most max_concurrency requests in flight (default: the sweep's largest batch size), and as many engine slots:
    a trace-schedule sweep launches the engine with --max-num-seqs = its cap on requests in flight. closed_loop: the
    requests of a closed-loop cell instead, all ready at 0 (replay_traffic). acceptance: per tag ("" pools all), in
    place of the sweep's (calibration.served_acceptance)."""
    plan = run.manifest.get("plan", {})
    max_num_seqs = max_concurrency or max(plan.get("batch_sizes") or fit.cost.batch_sizes)
    traffic = replay_traffic(run, traffic_source or plan["workload"], max_num_seqs, closed_loop)
    cost, profiles = replay_terms(run, fit, calibrated)
    profiles = dict(acceptance) if acceptance is not None else profiles
    pooled = profiles.pop("")
    profiles = {g: profiles.get(g, pooled) for g in set(traffic.groups)}
    draws = tuple(draw_acceptance(traffic, profiles, horizon, seed + k) for k in range(REPLAY_SEEDS))
    return Replay(traffic=traffic, cost=cost, profiles=profiles, draws=draws, max_num_seqs=max_num_seqs)


def replay_terms(run: Run, fit: CostFit, calibrated: bool = True) -> tuple[ServingCost, dict[str, PositionalAcceptance]]:
    """Serving cost and acceptance per workload phase ("" pools all): fitted from the engine's step clocks and its
    own record of every request-round (spectune.calibration) when the round logs have them, else from round-log
    gaps and the streamed chunks (serving_cost, phase_acceptance)."""
    from spectune.calibration import calibrate
    from spectune.steplog import has_step_clocks

    if calibrated and has_step_clocks(run):
        c = calibrate(run, fit.engine, fit.method)
        return c.cost, dict(c.profiles)
    return serving_cost(run, fit), phase_acceptance(run, fit)


def _prompt_key(request) -> str:
    """The prompt text as the sweep stores it per request (spectune.sweep)."""
    return request.prompt if request.prompt is not None else "\n".join(f"{role}: {text}" for role, text in request.messages or ())


@dataclass(frozen=True, slots=True)
class ClosedLoop:
    """What a closed-loop cell sent: the first num_prompts requests of its workload (cycled past its end, as the
    sweep does), each writing max_tokens, a new one sent as soon as one of the batch size's slots frees."""

    num_prompts: int
    max_tokens: int | None
    seed: int = 0  # the order of the passes past the set's end (spectune.workload.load_requests)


def replay_traffic(run: Run, source: str, max_concurrency: int, closed_loop: ClosedLoop | None = None) -> Traffic:
    """The requests of `source` on their arrival_s, each writing the plan's max_tokens; or, for a closed loop, the
    requests its cell sent, all arriving at 0 (the cap on requests in flight then paces them). Prompt tokens are
    what the sweep's server counted for the same prompt; prompts it never saw are tokenized with the embedded
    engine's tokenizer (an embedded-engine sweep), else estimated from their length in characters at the sweep's
    median tokens per character."""
    from spectune.workload import load_requests

    plan = run.manifest.get("plan", {})
    if closed_loop is not None:
        requests = load_requests(source, num_prompts=closed_loop.num_prompts, max_tokens=closed_loop.max_tokens or plan.get("max_tokens"),
                                 seed=closed_loop.seed)
        requests = [replace(r, arrival_s=0.0) for r in requests]
    else:
        requests = load_requests(source, max_tokens=plan.get("max_tokens"))
    if any(r.arrival_s is None for r in requests):
        raise SpectuneError(f"traffic {source}: requests without arrival_s; replay objectives need a workload with arrival_s on every line")
    measured = run.requests.dropna(subset=["prompt_tokens"]) if "prompt" in run.requests else pd.DataFrame()
    if measured.empty:
        raise SpectuneError(f"{run.root}: no per-request prompt tokens recorded; sweep again with this spectune version")
    tokens = measured.groupby("prompt")["prompt_tokens"].median()
    per_char = float((tokens / tokens.index.str.len()).median())
    keys = [_prompt_key(r) for r in requests]
    encode = _engine_tokenizer(plan)
    unseen = lambda r, k: len(encode(r)) if encode is not None else max(1, round(len(k) * per_char))
    prompt_tokens = [int(tokens[k]) if k in tokens.index else unseen(r, k) for r, k in zip(requests, keys)]
    return Traffic(
        name=Path(str(source)).stem,
        arrival_ms=np.array([r.arrival_s * 1000.0 for r in requests]),
        prompt_tokens=np.array(prompt_tokens, dtype=np.int64),
        output_tokens=np.array([r.max_tokens for r in requests], dtype=np.int64),
        groups=tuple(r.tag or "" for r in requests),
        max_concurrency=max_concurrency,
    )


def prompts_not_swept(run: Run, source: str) -> tuple[int, int]:
    """How many of the prompts of `source` no request of the sweep sent, of how many: the replay draws their
    acceptance from the sweep's prompts of the same tag."""
    from spectune.workload import load_requests

    swept = set(run.requests["prompt"].dropna()) if "prompt" in run.requests else set()
    keys = {_prompt_key(r) for r in load_requests(source)}
    return len(keys - swept), len(keys)


def _engine_tokenizer(plan: dict):
    """request -> the prompt token ids the embedded engine would see (spectune.engine.server), when every server of
    the plan is the embedded engine on one model; else None."""
    servers = plan.get("servers", [])
    models = {s.get("model") for s in servers}
    if not servers or any(s.get("engine", "embedded") != "embedded" for s in servers) or len(models) != 1:
        return None
    from tokenizers import Tokenizer

    from spectune.engine.shipped import target_path

    model = models.pop()
    file = (Path(model) if model else target_path()) / "tokenizer.json"
    if not file.is_file():
        return None
    tokenizer = Tokenizer.from_file(str(file))
    text = lambda r: r.prompt if r.prompt is not None else "".join(f"{role}: {content}\n" for role, content in r.messages) + "assistant:"
    return lambda r: tokenizer.encode(text(r)).ids


def _static_cells(run: Run, fit: CostFit) -> pd.DataFrame:
    cells = run.cells[(run.cells["status"] == "ok") & (run.cells["engine"] == fit.engine) & run.cells["adaptive_config"].isna()]
    if "cell" in cells:  # as the sweep wrote it (batch_size may since have become the batch size the server ran)
        return cells
    return cells.assign(cell=[cell_id(s, b, r) for s, b, r in zip(cells["server"], cells["batch_size"], cells["repeat"])])


def phase_acceptance(run: Run, fit: CostFit) -> dict[str, PositionalAcceptance]:
    """Per-position acceptance along the output per workload phase (request tag) of the fitted method's static
    cells, from their streamed chunks: the first carries the prefill's token, the last may be cut at max_tokens,
    and every other carries one decode round's accepted drafts + 1. Key "" pools every phase."""
    cells = _static_cells(run, fit)
    cells = cells[(cells["method"] == fit.method) & (cells["num_speculative_tokens"] > 0)]
    rows = run.requests[run.requests["cell"].isin(cells["cell"]) & run.requests["error"].isna()]
    tags = _workload_tags(run)
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


def _workload_tags(run: Run) -> dict[str, str]:
    """The sweep's prompts (as stored per request) -> their workload phase (request tag)."""
    from spectune.workload import load_requests

    return {_prompt_key(r): r.tag for r in load_requests(run.manifest["plan"]["workload"])}


def request_phases(run: Run, server: str) -> dict[int, str]:
    """Request key (simulate.request_keys) -> workload phase (request tag) for one server's round log. The log does not name the
    requests, so each is matched by its accepted drafts per round to a streamed request of that server (one chunk
    per round: chunk tokens - 1, the prefill's chunk and the last, possibly cut, left out); a sequence that several
    requests streamed takes the phase most of them had. Unmatched keys are left out."""
    from collections import Counter

    try:
        tags = _workload_tags(run)
    except (KeyError, SpectuneError):
        return {}
    if not {"prompt", "chunk_tokens", "cell"} <= set(run.requests.columns):
        return {}
    cells = run.cells.loc[run.cells["server"] == server, "cell"]
    rows = run.requests[run.requests["cell"].isin(cells) & run.requests["error"].isna()]
    by_sequence: dict[tuple[int, ...], Counter] = {}
    for prompt, chunks in zip(rows["prompt"], rows["chunk_tokens"]):
        if (tag := tags.get(prompt, "")) and chunks is not None and len(chunks) >= 2:
            by_sequence.setdefault(tuple(int(c) - 1 for c in chunks[1:-1]), Counter())[tag] += 1
    rows = read_round_log(run.round_logs[server])
    rounds: dict[int, list[int]] = {}
    for row, keys in zip(rows, request_keys(rows)):
        if not row.get("prefill") and row.get("accepted"):
            for key, a in zip(keys, row["accepted"]):
                rounds.setdefault(key, []).append(int(a))
    return {i: by_sequence[key].most_common(1)[0][0] for i, seq in rounds.items() if (key := tuple(seq[:-1])) in by_sequence}


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
    if "ttft_from_send_ms" in first:  # the engine's own time, without any wait in the client (trace sweeps)
        first = first.assign(ttft_ms=first["ttft_from_send_ms"])
    return fit_serving_cost(pd.concat(method_logs), pd.concat(target_logs), fit.cost.batch_sizes, first)


def _traces(run: Run, fit: CostFit, horizon: int, seed: int) -> list[Trace]:
    cells = run.cells
    family = cells[(cells["engine"] == fit.engine) & (cells["method"] == fit.method) & cells["adaptive_config"].isna()]
    logged = family[family["server"].isin(list(run.round_logs))].sort_values("num_speculative_tokens")
    traces = []
    if not logged.empty:
        server = logged["server"].iloc[-1]
        max_tokens = run.manifest.get("plan", {}).get("max_tokens")
        trace = trace_from_round_log(run.round_logs[server], max_steps=horizon, acceptance=fit.pooled, seed=seed, output_tokens=max_tokens)
        phases = {name: request_phases(run, name) for name in logged["server"].unique()}
        survival: dict[str, dict[int, np.ndarray]] = {}
        for name in phases:
            for label, by_steps in survival_by_steps(run.round_logs[name], phases[name]).items():
                survival.setdefault(label, {}).update(by_steps)
        traces.append(lift_trace(trace, survival, seed, phases[server]))
    if len(fit.acceptance) >= 2:
        by_tokens = sorted(fit.acceptance.values(), key=lambda p: p.expected_tokens(horizon))
        high, low = by_tokens[-1], by_tokens[0]
    elif traces:
        # measured at the trace's horizon: moved to smaller g by the fitted trend, as the round log is by lift_trace
        stretches = [replace(p, trend=fit.pooled.trend, trend_ref_g=horizon) for p in window_profiles(traces[0])]
        stretches = sorted(stretches, key=lambda p: p.expected_tokens(horizon)) or [fit.pooled]
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
