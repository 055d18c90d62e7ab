"""Simulate step policies: on traces of verify rounds (simulate, for throughput) or on replayed traffic through
the embedded engine's loop (simulate_requests, for what requests experience: TTFT, TPOT, e2e).

simulate: a trace holds, per round, the batch and for every request how many drafts WOULD be accepted at the
trace's horizon K (bonus excluded). Chain drafting makes smaller step counts exact: at g <= K a request
accepts min(accepted_K, g) drafts and gains that + 1 tokens; at g = 0 it gains 1.

Traces from the embedded engine's round log are censored: a request that accepted every draft of a
round logged at num_steps = g < K only says "at least g". Such requests are continued to K by sampling
the fitted conditional per-position acceptance (seeded); without a profile they stay at g (a lower
bound). A request that rejected a draft, or whose proposer offered fewer drafts than num_steps
(n-gram found no longer match), is exact at every horizon.

A round's acceptance also depends on the g it runs at, not only on the text: rounds at a larger g more often start
right after a rejection, where drafting is harder, and cover easy stretches in fewer rounds (measured for EAGLE:
S_1 = 0.81 at g = 1, 0.76 at g = 3, 0.72 at g = 7). A trace cut at g < K would give a policy at g the acceptance
of rounds at K. lift_trace gives it the acceptance measured at g instead (Trace.lifted), per workload phase where
the log's requests are labelled (much of the pooled difference is only the phase mix, which windows already weigh):
where the trace rejects
a draft, the round at g accepts it with the probability that raises the conditional rate to g's, and goes on from
there at g's rates (or, where g's rate is lower, drops an acceptance). synthesize_trace draws each g from its
profile's trend the same way.

Figures conserve work, they do not fix the number of rounds: a policy that yields more tokens per round
finishes sooner. The trace is cut into windows of WINDOW_ROUNDS consecutive rounds (short next to a phase
or a batch-size stretch, long enough for a ratio of sums to be a fair rate); a window's work is the
tokens its rounds yield at the horizon K, a fixed amount the policy produces at its own rate in that
window (tokens / ms over the window's rounds). tokens/s = total work / total time; mean TPOT = the
work-weighted mean over windows of sum(batch x round ms) / tokens. Counting rounds instead would charge a
policy for time spent at small batch sizes whatever it yields there. A round costs the cost model's t_round,
with its per-request part (RoundCost.request_ms: the wait for other requests' prefills, the client's turnaround)
paid per token gained rather than once per round (RoundCost.paid_ms). It has no arrivals, queueing or
prefills, so it says nothing of TTFT or e2e: simulate_requests does (its section below).
"""

from __future__ import annotations

import heapq
import json
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from spectune.adaptive import AdaptiveConfig, AdaptivePolicy
from spectune.costmodel import AcceptanceProfile, PositionalAcceptance, RoundCost, ServingCost
from spectune.errors import SpectuneError


@dataclass(frozen=True, slots=True, eq=False)
class Trace:
    """Rounds of a decode run: batch sizes [R] and accepted drafts at horizon max_steps [R, max batch]
    (zero-padded past each round's batch size)."""

    name: str
    max_steps: int
    batch_sizes: np.ndarray  # [R] int
    accepted: np.ndarray  # [R, B] int, 0 beyond batch_sizes[r]
    phases: tuple[str, ...] = ()  # [R] labels, or empty
    # [R, B, K + 1]: accepted drafts of each request in a round run at g = 0..K (module docstring); None: the trace
    # cut at g, min(accepted, g)
    lifted: np.ndarray | None = None
    # [R, B]: each request-round's request, as request_keys (-1 past each round's batch size or where not logged)
    request_ids: np.ndarray | None = None
    # [R, B]: the most drafts that still count, the request's output tokens left at that round of the logged run - 1
    # (a round past max_tokens yields only what is left); None: no cap
    cap: np.ndarray | None = None

    @property
    def num_rounds(self) -> int:
        return len(self.batch_sizes)

    def took(self) -> np.ndarray:
        """[R, B, K + 1]: drafts each request accepts, and that count, in a round run at g = 0..K (0 past each round's
        batch size)."""
        took = self.lifted if self.lifted is not None else np.minimum(self.accepted[:, :, None], np.arange(self.max_steps + 1)[None, None, :])
        return took if self.cap is None else np.minimum(took, self.cap[:, :, None])

    def accepted_at(self, steps: np.ndarray) -> np.ndarray:
        """[R, B]: drafts each request accepts, and that count, in round r run at steps[r]."""
        took = np.minimum(self.accepted, steps[:, None]) if self.lifted is None else self.lifted[np.arange(self.num_rounds), :, steps]
        return took if self.cap is None else np.minimum(took, self.cap)


def trace_from_rows(name: str, max_steps: int, rows: Sequence[Sequence[int]], phases: Sequence[str] = ()) -> Trace:
    """A trace from per-round lists of accepted drafts (each list's length, >= 1, is that round's batch size)."""
    width = max(len(r) for r in rows)
    accepted = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        accepted[i, : len(r)] = np.minimum(r, max_steps)
    sizes = np.array([len(r) for r in rows], dtype=np.int64)
    return Trace(name=name, max_steps=max_steps, batch_sizes=sizes, accepted=accepted, phases=tuple(phases))


# --- policies -----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StaticPolicy:
    """One step count for every round."""

    steps: int

    @property
    def label(self) -> str:
        return f"static g={self.steps}"


@dataclass(frozen=True, slots=True)
class SchedulePolicy:
    """vLLM's num_speculative_tokens_per_batch_size: inclusive [start, end, k] ranges; a gap carries the
    previous k and the last k runs to any larger batch size."""

    schedule: tuple[tuple[int, int, int], ...]

    @property
    def label(self) -> str:
        return "schedule " + " ".join(f"{s}-{e}:{k}" for s, e, k in self.schedule)

    def steps_for_batch(self, batch_size: int) -> int:
        k = self.schedule[0][2]
        for start, _, steps in self.schedule:
            if batch_size >= start:
                k = steps
        return k


@dataclass(frozen=True, slots=True, eq=False)
class AdaptiveConfigPolicy:
    """SGLang's adaptive policy with this config, launched at initial_steps. cuda_graph_bs: None pads like
    SGLang on a GPU with the default capture list; [] routes unpadded (the embedded engine)."""

    config: AdaptiveConfig
    initial_steps: int
    cuda_graph_bs: tuple[int, ...] | None = None
    name: str = "adaptive"

    @property
    def label(self) -> str:
        return self.name


@dataclass(frozen=True, slots=True)
class OraclePolicy:
    """Knows every round's acceptance and picks each round's step count from `candidate_steps` (default
    0..max_steps) so that every window's rate is the best possible (or its TPOT the least)."""

    candidate_steps: tuple[int, ...] | None = None
    objective: str = "throughput"

    @property
    def label(self) -> str:
        return "oracle"


Policy = StaticPolicy | SchedulePolicy | AdaptiveConfigPolicy | OraclePolicy


# --- simulation --------------------------------------------------------------------------------------------


WINDOW_ROUNDS = 32


@dataclass(frozen=True, slots=True, eq=False)
class SimResult:
    policy: str
    tokens_per_s: float  # all sequences together: work / time
    mean_tpot_ms: float  # time a sequence waits per token it receives (work-weighted over windows)
    work_tokens: int  # the trace's work: tokens at horizon K, the same for every policy
    time_ms: float  # time the policy needs for that work
    timeline: pd.DataFrame  # per round: round, batch_size, steps, tokens, round_ms, phase

    def figures(self) -> dict[str, float]:
        return {"tokens/s": self.tokens_per_s, "TPOT ms": self.mean_tpot_ms}


def simulate(trace: Trace, policy: Policy, cost: RoundCost) -> SimResult:
    """Run `policy` over `trace`; pure: a fresh policy state every call."""
    steps = _choose_steps(trace, policy, cost)
    if steps.max(initial=0) > trace.max_steps:
        raise SpectuneError(
            f"trace {trace.name}: acceptance is known up to {trace.max_steps} steps but {policy.label} chose {int(steps.max())}; "
            "build the trace with a larger max_steps"
        )
    tokens = _round_tokens(trace, steps)
    round_ms = cost.paid_ms(trace.batch_sizes, cost.t_round(trace.batch_sizes, steps), tokens)
    window = np.arange(trace.num_rounds) // WINDOW_ROUNDS
    win_tokens = np.bincount(window, tokens)
    win_ms = np.bincount(window, round_ms)
    win_seq_ms = np.bincount(window, trace.batch_sizes * round_ms)
    win_work = np.bincount(window, _round_tokens(trace, np.full(trace.num_rounds, trace.max_steps)))
    time_ms = float((win_work * win_ms / win_tokens).sum())
    timeline = pd.DataFrame(
        {
            "round": np.arange(trace.num_rounds),
            "batch_size": trace.batch_sizes,
            "steps": steps,
            "tokens": tokens,
            "round_ms": round_ms,
            "phase": list(trace.phases) if trace.phases else "",
        }
    )
    return SimResult(
        policy=policy.label,
        tokens_per_s=win_work.sum() * 1000.0 / time_ms,
        mean_tpot_ms=float((win_work * win_seq_ms / win_tokens).sum() / win_work.sum()),
        work_tokens=int(win_work.sum()),
        time_ms=time_ms,
        timeline=timeline,
    )


def _round_tokens(trace: Trace, steps: np.ndarray) -> np.ndarray:
    """[R] tokens: per request the drafts accepted at g + 1 (the zero padding adds nothing)."""
    return trace.batch_sizes + trace.accepted_at(steps).sum(axis=1)


def _choose_steps(trace: Trace, policy: Policy, cost: RoundCost) -> np.ndarray:
    match policy:
        case StaticPolicy(steps=g):
            return np.full(trace.num_rounds, g, dtype=np.int64)
        case SchedulePolicy():
            lookup = {int(b): policy.steps_for_batch(int(b)) for b in np.unique(trace.batch_sizes)}
            return np.array([lookup[int(b)] for b in trace.batch_sizes], dtype=np.int64)
        case AdaptiveConfigPolicy():
            return _adaptive_steps(trace, policy)
        case OraclePolicy():
            return _oracle_steps(trace, policy, cost)
    raise TypeError(f"not a policy: {policy!r}")


def _adaptive_steps(trace: Trace, policy: AdaptiveConfigPolicy) -> np.ndarray:
    graph_bs = None if policy.cuda_graph_bs is None else list(policy.cuda_graph_bs)
    live = AdaptivePolicy.from_config(policy.config, policy.initial_steps, cuda_graph_bs=graph_bs)
    steps = np.empty(trace.num_rounds, dtype=np.int64)
    took = trace.took()
    for r, bs in enumerate(trace.batch_sizes.tolist()):
        g = live.steps_for_batch(bs)
        steps[r] = g
        # What the server sees: drafts accepted at the step it ran (0 at g = 0), bonus excluded.
        live.on_verify_complete(took[r, :bs, g].tolist(), bs)
    return steps


def _oracle_steps(trace: Trace, policy: OraclePolicy, cost: RoundCost) -> np.ndarray:
    candidates = np.array(policy.candidate_steps or range(trace.max_steps + 1), dtype=np.int64)  # [G]
    tokens = np.stack([_round_tokens(trace, np.full(trace.num_rounds, g)) for g in candidates], axis=1)  # [R, G]
    weight = cost.paid_ms(trace.batch_sizes[:, None], cost.t_round(trace.batch_sizes[:, None], candidates[None, :]), tokens)  # [R, G] ms
    if policy.objective == "latency":  # a window's TPOT = sum(batch x ms) / tokens
        weight = weight * trace.batch_sizes[:, None]
    choice = np.empty(trace.num_rounds, dtype=np.int64)
    for start in range(0, trace.num_rounds, WINDOW_ROUNDS):  # windows are independent (fixed work each)
        rows = slice(start, start + WINDOW_ROUNDS)
        choice[rows] = _best_choices(tokens[rows], weight[rows])
    return candidates[choice]


def _best_choices(tokens: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """One column per row of [n, G] tables that maximises sum(tokens) / sum(weight) over all rows
    (Dinkelbach: pick max tokens - ratio x weight per row, update the ratio, repeat until it stops rising)."""
    rows = np.arange(len(tokens))
    ratio = 0.0
    for _ in range(100):
        choice = np.argmax(tokens - ratio * weight, axis=1)
        new_ratio = tokens[rows, choice].sum() / weight[rows, choice].sum()
        if new_ratio <= ratio * (1 + 1e-12):
            break
        ratio = new_ratio
    return choice


# --- traces -------------------------------------------------------------------------------------------------


def request_keys(rows: Sequence[dict]) -> list[list[int]]:
    """Per round-log row, its requests as keys unique over the whole log: each engine (a sweep restarts it) numbers
    its requests from 0, so a prefill step of request 0 starts a new engine's ids (as spectune.steplog reads them).
    -1 where a row names no requests."""
    engine, keys, out = -1, {}, []
    for row in rows:
        ids = row.get("request_ids")
        if ids is None:
            out.append([-1] * len(row.get("accepted") or row.get("prompt_tokens") or []))
            continue
        if row.get("prefill") and 0 in ids:
            engine += 1
        out.append([keys.setdefault((engine, int(i)), len(keys)) for i in ids])
    return out


def read_round_log(path: str | Path) -> list[dict]:
    """The rows of an embedded engine's round log (JSON lines: decode rounds and prefill steps)."""
    rows = []
    with Path(path).open() as f:
        for number, line in enumerate(f, 1):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise SpectuneError(f"{path}:{number}: not a round record ({e}); expected num_steps, proposed, accepted") from None
    return rows


def trace_from_round_log(
    path: str | Path,
    *,
    max_steps: int | None = None,
    acceptance: AcceptanceProfile | None = None,
    seed: int = 0,
    output_tokens: int | None = None,
) -> Trace:
    """The embedded engine's per-round log as a trace at horizon max_steps (default: the largest logged
    num_steps); censored requests are continued with `acceptance` (see the module docstring). With output_tokens
    (the sweep's max_tokens), a request's rounds count only the tokens it had left (Trace.cap): the engine logs
    every accepted draft, also those past the end of the output. Trace.request_ids holds request_keys."""
    path = Path(path)
    rows = read_round_log(path)
    rounds = []
    for number, (row, keys) in enumerate(zip(rows, request_keys(rows)), 1):
        if row.get("prefill"):  # a prefill step (spectune.costmodel.read_step_log reads those)
            continue
        try:
            rounds.append((int(row["num_steps"]), list(row["proposed"]), list(row["accepted"]), keys))
        except (KeyError, TypeError, ValueError) as e:
            raise SpectuneError(f"{path}:{number}: not a round record ({e!r}); expected num_steps, proposed, accepted") from None
    rounds = [r for r in rounds if r[2]]
    if not rounds:
        raise SpectuneError(f"{path}: no decode rounds logged; run the sweep with the embedded engine")
    horizon = max_steps if max_steps is not None else max(r[0] for r in rounds)
    rng = np.random.default_rng(seed)
    rows = []
    for num_steps, proposed, accepted, _ in rounds:
        acc = np.asarray(accepted, dtype=np.int64)
        censored = (acc >= np.asarray(proposed)) & (np.asarray(proposed) >= num_steps) & (num_steps < horizon)
        if acceptance is not None and censored.any():
            acc[censored] = _continue_chains(acc[censored], horizon, acceptance, rng)
        rows.append(acc)
    trace = trace_from_rows(path.stem, horizon, rows)
    ids = np.full(trace.accepted.shape, -1, dtype=np.int64)
    for r, (*_, row_ids) in enumerate(rounds):
        ids[r, : len(row_ids)] = row_ids
    cap = None
    if output_tokens is not None and (ids >= 0).any():
        cap = np.full(trace.accepted.shape, trace.max_steps, dtype=np.int64)
        made: dict[int, int] = {}  # output tokens so far per request: the prefill's one, then each round's
        for r, (_, _, accepted, row_ids) in enumerate(rounds):
            for b, (i, a) in enumerate(zip(row_ids, accepted)):
                left = output_tokens - made.get(i, 1)
                cap[r, b] = max(left - 1, 0)
                made[i] = made.get(i, 1) + min(a + 1, left)
    return replace(trace, request_ids=ids, cap=cap)


def _continue_chains(accepted: np.ndarray, horizon: int, profile: AcceptanceProfile, rng: np.random.Generator) -> np.ndarray:
    """Requests known to accept at least `accepted` drafts: draw positions accepted+1..horizon from the
    conditional rates and stop at the first rejection."""
    draws = rng.random((len(accepted), horizon)) < profile.rate_vector(horizon)  # [n, K]
    draws |= np.arange(horizon)[None, :] < accepted[:, None]  # the known-accepted prefix
    return np.cumprod(draws, axis=1).sum(axis=1)


def survival_by_steps(path: str | Path, labels: dict[int, str] | None = None) -> dict[str, dict[int, np.ndarray]]:
    """Per label (labels: request key (request_keys) -> e.g. its workload phase; without, or unlabelled: "") and per
    step count a round log's rounds ran at: S_1..S_g, the share of request-rounds that accepted at least i drafts
    (every request of every decode round, whether its proposer drafted or not)."""
    labels = labels or {}
    rows = read_round_log(path)
    parts: dict[tuple[str, int], list[int]] = {}
    for row, keys in zip(rows, request_keys(rows)):
        if not row.get("prefill") and row.get("accepted") and int(row["num_steps"]) > 0:
            for key, a in zip(keys, row["accepted"]):
                parts.setdefault((labels.get(key, ""), int(row["num_steps"])), []).append(a)
    out: dict[str, dict[int, np.ndarray]] = {}
    for (label, g), values in parts.items():
        accepted = np.asarray(values, dtype=np.int64)
        out.setdefault(label, {})[g] = (accepted[:, None] >= np.arange(1, g + 1)[None, :]).mean(axis=0)
    return out


def rates_at(survival: dict[int, np.ndarray], g: int) -> np.ndarray:
    """Conditional acceptance a_1..a_g of a round run at g ([g]), from survivals measured at some step counts: each
    position's rate interpolated linearly in g over the step counts that measured it (held flat past the ends)."""
    measured = sorted(survival)
    rates = {k: _rates(survival[k]) for k in measured}
    out = np.empty(g)
    for i in range(g):
        at = [k for k in measured if k > i]
        out[i] = np.interp(g, at, [rates[k][i] for k in at]) if at else out[i - 1]
    return out.clip(0.0, 1.0)


def lift_trace(trace: Trace, survival: dict[str, dict[int, np.ndarray]], seed: int, labels: dict[int, str] | None = None) -> Trace:
    """The trace with Trace.lifted: a round run at g accepts drafts at the conditional rates measured at g
    (rates_at) instead of the trace's own at its horizon, changing as few of the trace's outcomes as that takes
    (module docstring). survival: per label, per step count (survival_by_steps); labels: request key (request_keys) ->
    label (e.g. its workload phase), each label's request-rounds lifted from their own rates at the horizon to
    that label's at g; unlabelled ones take label "". A label without survival is left as cut. Seeded; every g
    draws on the same uniforms."""
    k = trace.max_steps
    real = np.arange(trace.accepted.shape[1])[None, :] < trace.batch_sizes[:, None]  # [R, B]
    ids = trace.request_ids if trace.request_ids is not None else np.full(trace.accepted.shape, -1)
    labels = labels or {}
    groups = np.vectorize(lambda i: labels.get(int(i), ""), otypes=[object])(ids) if labels else np.full(ids.shape, "", dtype=object)
    u = np.random.default_rng(seed).random((k, *trace.accepted.shape))  # [K, R, B]
    lifted = np.minimum(trace.accepted[:, :, None], np.arange(k + 1)[None, None, :]) * real[:, :, None]
    for label, by_steps in survival.items():
        rows = real & (groups == label)
        if rows.any() and by_steps:
            lifted[rows] = _lifted_rows(trace.accepted[rows], u[:, rows], by_steps, k)
    return replace(trace, lifted=lifted)


def _lifted_rows(acc: np.ndarray, u: np.ndarray, survival: dict[int, np.ndarray], k: int) -> np.ndarray:
    """[n, K + 1] drafts accepted at g = 0..K by n request-rounds that accept `acc` ([n]) at K, on uniforms u [K, n]."""
    own = _rates((acc[:, None] >= np.arange(1, k + 1)[None, :]).mean(axis=0))  # the rows' rates at K
    out = np.zeros((len(acc), k + 1), dtype=np.int64)
    for g in range(1, k + 1):
        want = rates_at(survival, g) if g < k else own
        on_trace = np.ones(len(acc), dtype=bool)  # still following the trace's outcomes
        alive = np.ones(len(acc), dtype=bool)
        for i in range(g):
            keep = min(1.0, want[i] / own[i]) if own[i] > 0 else 0.0
            flip = max(0.0, (want[i] - own[i]) / (1.0 - own[i])) if own[i] < 1 else 0.0
            trace_accepts = acc > i
            alive &= np.where(on_trace, np.where(trace_accepts, u[i] < keep, u[i] < flip), u[i] < want[i])
            on_trace &= trace_accepts
            out[:, g] += alive
    return out


@dataclass(frozen=True, slots=True)
class Phase:
    """A stretch of a synthetic trace: num_rounds rounds at one batch size and acceptance."""

    name: str
    num_rounds: int
    batch_size: int
    profile: AcceptanceProfile


def synthesize_trace(phases: Sequence[Phase], *, max_steps: int, seed: int, name: str = "synthetic") -> Trace:
    """Seeded trace: each request's accepted drafts drawn from its phase's per-position acceptance."""
    rng = np.random.default_rng(seed)
    width = max(p.batch_size for p in phases)
    trended = any(p.profile.trend for p in phases)  # then a round at g draws at the profile's acceptance at g
    steps = range(max_steps + 1) if trended else (max_steps,)
    blocks, sizes, labels = [], [], []
    for p in phases:
        u = rng.random((p.num_rounds, p.batch_size, max_steps))  # [R, B, K]
        block = np.zeros((p.num_rounds, width, max_steps + 1), dtype=np.int64)
        for g in steps:
            rates = _rates(p.profile.survival_at(g)) if trended else p.profile.rate_vector(g)
            block[:, : p.batch_size, g] = np.cumprod(u[:, :, :g] < rates, axis=2).sum(axis=2)
        blocks.append(block)
        sizes.append(np.full(p.num_rounds, p.batch_size, dtype=np.int64))
        labels += [p.name] * p.num_rounds
    took = np.concatenate(blocks)
    return Trace(name=name, max_steps=max_steps, batch_sizes=np.concatenate(sizes), accepted=took[:, :, max_steps],
                 phases=tuple(labels), lifted=took if trended else None)


def _rates(survival: np.ndarray) -> np.ndarray:
    """Conditional rates a_i = S_i / S_(i-1) of a survival curve."""
    return np.divide(survival, np.concatenate([[1.0], survival[:-1]]), out=np.zeros_like(survival), where=np.concatenate([[1.0], survival[:-1]]) > 0)


def phase_shifting_trace(
    high: AcceptanceProfile,
    low: AcceptanceProfile,
    batch_sizes: Sequence[int],
    *,
    max_steps: int,
    seed: int,
    phase_rounds: int = 150,
    batch_rounds: int = 250,
    num_rounds: int = 3000,
) -> Trace:
    """Acceptance alternates high/low every phase_rounds while the batch size steps through batch_sizes
    (up, then back down) every batch_rounds, so the two shifts fall out of step."""
    ladder = list(batch_sizes) + list(batch_sizes)[-2:0:-1]
    phases = []
    start = 0
    while start < num_rounds:
        acc_index, bs_index = start // phase_rounds, start // batch_rounds
        end = min(num_rounds, (acc_index + 1) * phase_rounds, (bs_index + 1) * batch_rounds)
        is_high = acc_index % 2 == 0
        phases.append(Phase("high" if is_high else "low", end - start, ladder[bs_index % len(ladder)], high if is_high else low))
        start = end
    return synthesize_trace(phases, max_steps=max_steps, seed=seed, name="phase-shifting")


def window_profiles(trace: Trace, window: int = 50) -> list[AcceptanceProfile]:
    """Per-position acceptance of each `window` consecutive rounds of a trace (how acceptance drifts)."""
    out = []
    for start in range(0, trace.num_rounds - window + 1, window):
        sizes = trace.batch_sizes[start : start + window]
        acc = trace.accepted[start : start + window]
        mask = np.arange(acc.shape[1])[None, :] < sizes[:, None]
        values = acc[mask]  # [requests]
        survival = np.array([(values >= i).mean() for i in range(1, trace.max_steps + 1)])
        out.append(AcceptanceProfile(tuple(float(r) for r in _rates(survival))))
    return out


# --- request-level replay -----------------------------------------------------------------------------------
#
# What a request experiences: the traffic is sent as the load generator sends it and the embedded engine's loop
# (spectune/engine: EngineThread._run, Scheduler.schedule) is replayed step by step on the fitted step costs.
# - Client: requests go in list order, each at its arrival offset and only while fewer than max_concurrency are
#   in flight (else when one finishes). TTFT and e2e count from the arrival, as the load generator's do for trace
#   and Poisson traffic (time queued in the client included: the objectives see overload); ttft_from_send_ms and
#   e2e_from_send_ms count from the send, queue_delay_ms is send - arrival.
# - The server takes requests in one at a time (one event loop parses and tokenizes them), request_overhead_ms
#   each: a request reaches the engine that long after its send or after the one before it reached the engine,
#   whichever is later; so a burst trickles in and the engine prefills its first request alone. Before every step
#   the engine takes in all that have reached it; with nothing waiting or running it idles until the next one does.
# - A step either prefills or decodes. Prefill: while requests wait and fewer than max_num_seqs run, admit
#   them first come first served (after the first, only while the next prompt fits in what is left of
#   max_prefill_tokens); each gains its first token when the step ends. Otherwise every running request decodes:
#   the policy picks g for the batch; a request that has p output tokens accepts min(accepted at the horizon at p, g)
#   drafts and gains that + 1 tokens (cut at its output length); the policy is fed the accepted drafts, as the
#   engine does. The step costs the drafts the engine verifies: g, or the most any request of the batch was offered
#   (an n-gram match's continuation can run out; AcceptanceDraws.offered), or 0 when none drafted (an n-gram
#   proposer that found no match; AcceptanceDraws.drafted). Step costs are walls, start to next start (the
#   tokens are handed out at the end of a wall: measured, chunks reach the client then, spectune.calibration).
# - A request finishes (frees its engine slot and its client slot) at the end of the step that completes it.


@dataclass(frozen=True, slots=True, eq=False)
class Traffic:
    """What the load generator sends: per request its arrival offset, prompt and output tokens, and the group
    (workload phase) whose acceptance it draws from; max_concurrency caps the requests in flight (None: no cap)."""

    name: str
    arrival_ms: np.ndarray  # [N] float, non-decreasing
    prompt_tokens: np.ndarray  # [N] int >= 1
    output_tokens: np.ndarray  # [N] int >= 1
    groups: tuple[str, ...]  # [N]
    max_concurrency: int | None = None

    @property
    def num_requests(self) -> int:
        return len(self.arrival_ms)


@dataclass(frozen=True, slots=True, eq=False)
class AcceptanceDraws:
    """accepted[i, p]: drafts request i accepts in a round that starts after p output tokens, at `horizon` drafts
    (chain drafting: min(accepted, g) at g <= horizon). Indexed by output position, not by round, so that every
    policy meets the same requests: under greedy decoding the text, and so what drafts match, is the same."""

    horizon: int
    accepted: np.ndarray  # [N, P] int, P >= the largest output length
    drafted: np.ndarray | None = None  # [N, P] bool: the proposer offered drafts (None: always); accepted is 0 where not
    offered: np.ndarray | None = None  # [N, P] int: the most drafts the proposer offers there (None: all asked); accepted <= it


def draw_acceptance(traffic: Traffic, profiles: dict[str, PositionalAcceptance], horizon: int, seed: int) -> AcceptanceDraws:
    """Every request's accepted drafts at every output position, drawn (seeded) from its group's acceptance there
    (and, where the profiles say how often the proposer drafts at all, whether it did)."""
    missing = sorted(set(traffic.groups) - set(profiles))
    if missing:
        raise SpectuneError(f"traffic {traffic.name}: no acceptance for group(s) {', '.join(missing)}; give a profile for each")
    rng = np.random.default_rng(seed)
    positions = int(traffic.output_tokens.max())
    draws = rng.random((traffic.num_requests, positions, horizon))  # [N, P, H]
    by_group = {g: profiles[g].rate_matrix(positions, horizon) for g in set(traffic.groups)}  # [P, H] each
    rates = np.stack([by_group[g] for g in traffic.groups])  # [N, P, H]
    if any(profiles[g].request_offsets for g in set(traffic.groups)):  # each request as easy as one measured request
        theta = np.array([rng.choice(profiles[g].request_offsets) if profiles[g].request_offsets else 0.0 for g in traffic.groups])
        clipped = np.clip(rates, 1e-4, 1 - 1e-4)
        rates = 1 / (1 + np.exp(-(np.log(clipped / (1 - clipped)) + theta[:, None, None])))
    accepted = np.cumprod(draws < rates, axis=2).sum(axis=2)  # [N, P]: leading accepted drafts
    offered = None
    if any(profiles[g].offered for g in set(traffic.groups)):  # an n-gram match's continuation can run out before g
        more = np.stack([profiles[g].offered_rates(horizon) for g in traffic.groups])  # [N, H - 1]
        offered = 1 + np.cumprod(rng.random((traffic.num_requests, positions, horizon - 1)) < more[:, None, :], axis=2).sum(axis=2)
        accepted = np.minimum(accepted, offered)
    if not any(profiles[g].drafted for g in set(traffic.groups)):
        return AcceptanceDraws(horizon=horizon, accepted=accepted, offered=offered)
    shares = np.stack([profiles[g].drafted_vector(positions) for g in traffic.groups])  # [N, P]
    drafted = rng.random((traffic.num_requests, positions)) < shares
    return AcceptanceDraws(horizon=horizon, accepted=accepted * drafted, drafted=drafted, offered=offered)


@dataclass(frozen=True, slots=True, eq=False)
class RequestSimResult:
    policy: str
    requests: pd.DataFrame  # per request: group, arrival/send/first_token/finish ms, ttft/tpot/e2e ms (from arrival),
    # ttft/e2e_from_send_ms, queue_delay_ms, tokens, rounds
    steps: pd.DataFrame  # per engine step: start_ms, kind, batch_size, steps, tokens, ms; decode: at_horizon, drafted

    @property
    def ttft_ms(self) -> float:
        return float(self.requests["ttft_ms"].mean())

    @property
    def tpot_ms(self) -> float:
        """Mean over requests of (e2e - TTFT) / (output tokens - 1), as spectune.analysis computes it."""
        return float(self.requests["tpot_ms"].mean())

    @property
    def e2e_ms(self) -> float:
        return float(self.requests["e2e_ms"].mean())

    @property
    def tokens_per_s(self) -> float:
        """Output tokens / (last finish - first send), as spectune.analysis's output_throughput_tps."""
        span = self.requests["finish_ms"].max() - self.requests["send_ms"].min()
        return float(self.requests["output_tokens"].sum() * 1000.0 / span)

    def figures(self) -> dict[str, float]:
        return {"TTFT ms": self.ttft_ms, "TPOT ms": self.tpot_ms, "e2e ms": self.e2e_ms, "tokens/s": self.tokens_per_s}


def simulate_requests(
    traffic: Traffic,
    policy: Policy,
    cost: ServingCost,
    draws: AcceptanceDraws,
    *,
    max_num_seqs: int,
    max_prefill_tokens: int = 8192,
) -> RequestSimResult:
    """Replay `traffic` through the engine loop under `policy` (see the section comment); pure and deterministic."""
    n = traffic.num_requests
    prompt, output = traffic.prompt_tokens, traffic.output_tokens
    live = _LiveSteps(policy, cost.decode, draws.horizon)
    send, ready, first, finish = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
    generated, rounds = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    client_free = [0.0] * traffic.max_concurrency if traffic.max_concurrency else None  # heap: when each slot frees
    inbox: deque[int] = deque()  # sent, not yet taken in by the engine
    waiting: deque[int] = deque()
    running: list[int] = []
    steps: list[tuple] = []
    free_slots = list(range(max_num_seqs))  # heap: the scheduler hands out the lowest free KV-cache slot
    slot = np.zeros(n, dtype=np.int64)
    next_send, done, t, just_finished = 0, 0, 0.0, 0

    def end(i: int) -> None:
        nonlocal just_finished
        finish[i] = t
        running.remove(i)
        heapq.heappush(free_slots, int(slot[i]))
        just_finished += 1
        if client_free is not None:
            heapq.heappush(client_free, t + cost.stream_end_ms)

    def wall(start: float, ms: float, per_intake: float, finish_ms: float) -> float:
        """A step's end: its own cost, the stream ends of the requests finished at the step before (finish_ms each),
        and every request the server takes in meanwhile (ServingCost)."""
        ms += finish_ms * just_finished
        if per_intake:
            ms += per_intake * sum(1 for i in inbox if start < ready[i] <= start + ms)
        return start + ms

    while done < n:
        while next_send < n and (client_free is None or client_free):  # the client sends all it may by now
            at = max(traffic.arrival_ms[next_send], send[next_send - 1] if next_send else 0.0)
            send[next_send] = max(at, heapq.heappop(client_free)) if client_free is not None else at
            ready[next_send] = max(send[next_send], ready[next_send - 1] if next_send else 0.0) + cost.request_overhead_ms
            inbox.append(next_send)
            next_send += 1
        while inbox and ready[inbox[0]] <= t:
            waiting.append(inbox.popleft())
        if not waiting and not running:
            t = ready[inbox[0]]  # idle until the next request reaches the engine
            continue
        start = t
        admitted: list[int] = []
        budget = max_prefill_tokens
        while waiting and len(running) < max_num_seqs and (not admitted or prompt[waiting[0]] <= budget):
            admitted.append(waiting.popleft())
            budget -= prompt[admitted[-1]]
            running.append(admitted[-1])
        if admitted:
            for i in admitted:
                slot[i] = heapq.heappop(free_slots)
            # the stream ends slow the decode steps they overlap (fitted there); a prefill's tensor work leaves the
            # interpreter free for them (calibration.predicted_walls charges them to decode steps alone too)
            t = wall(start, cost.t_prefill(prompt[admitted].tolist()), cost.prefill_intake_ms, 0.0)
            just_finished = 0
            first[admitted] = t
            generated[admitted] = 1
            steps.append((start, "prefill", len(admitted), 0, len(admitted), t - start, (), False))
            for i in admitted:
                if output[i] <= 1:
                    end(i)
                    done += 1
            continue
        batch = np.array(running)  # [B]
        at_horizon = draws.accepted[batch, generated[batch]]  # [B]
        drafting = np.ones(len(batch), dtype=bool) if draws.drafted is None else draws.drafted[batch, generated[batch]]
        remaining = output[batch] - generated[batch]
        g = live.choose(at_horizon, remaining)
        accepted = np.minimum(at_horizon, g)
        gained = np.minimum(accepted + 1, remaining)
        # The engine verifies as many drafts as the most generous request was offered (0 when none drafted), and reads
        # the KV cache through a view only when the batch's slots are one run (else it gathers the rows).
        drafted = bool(drafting.any())
        width = 0 if not drafted else g if draws.offered is None else min(g, int(draws.offered[batch, generated[batch]][drafting].max()))
        ms = cost.decode.t_round(len(batch), 0) if g == 0 else cost.decode.t_speculative(len(batch), width)
        if np.ptp(slot[batch]) + 1 != len(batch):
            ms += cost.gather_ms_per_seq * len(batch)
        t = wall(start, ms, cost.intake_interference_ms, cost.finish_ms)
        just_finished = 0
        generated[batch] += gained
        rounds[batch] += 1
        live.feedback(accepted.tolist(), len(batch))
        steps.append((start, "decode", len(batch), g, int(gained.sum()), t - start, tuple(at_horizon.tolist()), drafted))
        for i in batch[generated[batch] >= output[batch]].tolist():
            end(i)
            done += 1
    first, finish = first + cost.delivery_ms, finish + cost.delivery_ms  # when the client sees the chunks
    arrival = traffic.arrival_ms
    ttft, e2e = first - arrival, finish - arrival
    requests = pd.DataFrame({
        "group": list(traffic.groups),
        "arrival_ms": traffic.arrival_ms,
        "send_ms": send,
        "ready_ms": ready,  # taken in by the server, handed to the engine
        "first_token_ms": first,
        "finish_ms": finish,
        "ttft_ms": ttft,
        "tpot_ms": np.where(output > 1, (e2e - ttft) / np.maximum(output - 1, 1), np.nan),
        "e2e_ms": e2e,
        "ttft_from_send_ms": first - send,
        "e2e_from_send_ms": finish - send,
        "queue_delay_ms": send - arrival,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "decode_rounds": rounds,
    })
    timeline = pd.DataFrame(steps, columns=["start_ms", "kind", "batch_size", "steps", "tokens", "ms", "at_horizon", "drafted"])
    return RequestSimResult(policy=policy.label, requests=requests, steps=timeline)


class _LiveSteps:
    """A policy's step choice during one replay: fresh state (the adaptive policy's EMA and counters) per replay."""

    def __init__(self, policy: Policy, cost: RoundCost, horizon: int):
        self.policy, self.cost, self.horizon = policy, cost, horizon
        self.adaptive = None
        if isinstance(policy, AdaptiveConfigPolicy):
            graph_bs = None if policy.cuda_graph_bs is None else list(policy.cuda_graph_bs)
            self.adaptive = AdaptivePolicy.from_config(policy.config, policy.initial_steps, cuda_graph_bs=graph_bs)

    def choose(self, at_horizon: np.ndarray, remaining: np.ndarray) -> int:
        bs = len(at_horizon)
        match self.policy:
            case StaticPolicy(steps=g):
                pass
            case SchedulePolicy():
                g = self.policy.steps_for_batch(bs)
            case AdaptiveConfigPolicy():
                g = self.adaptive.steps_for_batch(bs)
            case OraclePolicy(candidate_steps=candidates):
                g = self._greedy(at_horizon, remaining, candidates or tuple(range(self.horizon + 1)))
            case _:
                raise TypeError(f"not a policy: {self.policy!r}")
        if g > self.horizon:
            raise SpectuneError(f"acceptance is drawn up to {self.horizon} steps but {self.policy.label} chose {g}; "
                                "draw it with a larger horizon")
        return g

    def feedback(self, accepted: list[int], batch_size: int) -> None:
        if self.adaptive is not None:
            self.adaptive.on_verify_complete(accepted, batch_size)

    def _greedy(self, at_horizon: np.ndarray, remaining: np.ndarray, candidates: tuple[int, ...]) -> int:
        """The oracle of a replay: the g that yields the most tokens per ms in this step (a reference, not a bound:
        with queueing no choice of one step is best for the requests' latency)."""
        steps = np.array(candidates)  # [G]
        tokens = np.minimum(np.minimum(at_horizon[None, :], steps[:, None]) + 1, remaining[None, :]).sum(axis=1)  # [G]
        return int(steps[np.argmax(tokens / self.cost.t_round(len(at_horizon), steps))])
