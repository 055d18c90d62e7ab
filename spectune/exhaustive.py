"""An exhaustive grid over SGLang's adaptive policy space, scored on the tuning bench: the bound on what any SGLang
config can reach there, to set beside the Optuna search (did it leave anything?) and the hindsight oracle (what
does SGLang's policy leave?).

The grid: slot bounds = every subset of the measured batch sizes that keeps the smallest; per slot every ladder the
search space has (each contiguous run of 0..the largest measured g, and its every-other-rung form) with every
ceiling of search.CEILINGS; and, shared by the slots as in the search space, every combination of a few values of
the continuous parameters (CONTINUOUS), plus the tuned config's own values. That is far too many configs to replay
one by one (about 1e12 on five batch sizes), so it is scored in two stages:

1. Proxy, exact per slot. SGLang's slots do not share state: on a fixed sequence of verify rounds each slot decides
   only from the rounds routed to it. So every (continuous values, batch-size range, ladder, ceiling) is simulated
   once, vectorised over all candidates at a time (simulate_slots: the same decisions as spectune.adaptive, tested),
   on the bench's rounds: its traces, or for a replay bench the decode steps of the tuned config's replays (batch
   sizes and each request's drafts at its position). A candidate gets the time it needs for the work of its rounds
   in each run (trace or replay), as spectune.simulate charges it. For one partition into slots the bench's score
   is the geometric mean over runs of target-only's time over the policy's, so the best picks minimise the sum over
   runs of log(total time), found by majorise-minimise (each step separable over slots, never worse).
2. Exact. The TOP_EXACT best configs of stage 1, the tuned config and the baselines (presets, best static g and
   per-batch schedule as configs) are scored by the bench itself (the objective the search used); the best of them
   is the result. So it never scores below the tuned config.

Stage 1 is a proxy where the rounds depend on the policy (a replay: batch sizes follow the policy's speed; the
objective there is a request latency, here decode time), where a window mixes slots, and in the launch step (each
slot starts at its own middle rung here); stage 2 decides.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd

from spectune.adaptive import AdaptiveConfig, SlotConfig
from spectune.search import CEILINGS

# A few values of each continuous parameter (SGLang's default among them).
CONTINUOUS = {
    "ema_alpha": (0.1, 0.2, 0.5),
    "update_interval": (1, 5, 10),
    "warmup_batches": (0, 10),
    "down_hysteresis": (-0.5, -0.25, 0.0),
    "up_hysteresis": (0.0, 0.5),
}
TOP_EXACT = 30


@dataclass(frozen=True, slots=True, eq=False)
class Rounds:
    """Verify rounds as the proxy sees them, per candidate step count g = 0..H: batch_size [R], tokens [R, H+1],
    ms [R, H+1] (the policy's own time; for the latency objective batch size x ms), obs [R, H+1] (mean accepted
    drafts per request, what the policy is fed); run [R] (a trace or a replay: a policy starts fresh in each) and
    window [R] (spectune.simulate's windows of fixed work, numbered within the run)."""

    batch_size: np.ndarray
    tokens: np.ndarray
    ms: np.ndarray
    obs: np.ndarray
    run: np.ndarray
    window: np.ndarray

    @property
    def horizon(self) -> int:
        return self.tokens.shape[1] - 1

    @property
    def num_runs(self) -> int:
        return int(self.run.max()) + 1


def rounds_from_accepted(batch_sizes: np.ndarray, accepted: np.ndarray, any_drafted: np.ndarray | None, cost, run: int,
                         horizon: int, latency: bool = False) -> Rounds:
    """One run's rounds from per-round accepted drafts at the horizon ([R, B], zero-padded past each round's batch
    size; or [R, B, horizon + 1], accepted drafts at each g: spectune.simulate.Trace.took) and whether any request
    of the round drafted at all ([R] bool, None: all did), on a RoundCost: a round where none drafted runs the
    proposer and verifies no drafts (cost.t_speculative at width 0)."""
    from spectune.simulate import WINDOW_ROUNDS

    g = np.arange(horizon + 1)
    width_mask = np.arange(accepted.shape[1])[None, :] < batch_sizes[:, None]  # [R, B]
    took = accepted if accepted.ndim == 3 else np.minimum(accepted[:, :, None], g[None, None, :])
    took = took * width_mask[:, :, None]  # [R, B, G]
    tokens = batch_sizes[:, None] + took.sum(axis=1)  # [R, G]
    obs = took.sum(axis=1) / batch_sizes[:, None]
    any_drafted = np.ones(len(batch_sizes), dtype=bool) if any_drafted is None else any_drafted
    width = np.where(any_drafted[:, None], g[None, :], 0)
    ms = np.where(g[None, :] == 0, cost.t_round(batch_sizes[:, None], 0 * g[None, :]), cost.t_speculative(batch_sizes[:, None], width))
    ms = cost.paid_ms(batch_sizes[:, None], ms, tokens)
    if latency:
        ms = ms * batch_sizes[:, None]
    n = len(batch_sizes)
    return Rounds(batch_sizes, tokens.astype(float), ms, obs, np.full(n, run), np.arange(n) // WINDOW_ROUNDS)


def concat_rounds(parts: list[Rounds]) -> Rounds:
    return Rounds(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("batch_size", "tokens", "ms", "obs", "run", "window")))


@dataclass(frozen=True, slots=True)
class Candidates:
    """Slot configs, one per row: ladder [C, L] (padded with its last rung), ladder_len [C], ceiling, the
    continuous parameters [C] and combo [C], the index of those in the continuous grid."""

    ladder: np.ndarray
    ladder_len: np.ndarray
    ceiling: np.ndarray
    ema_alpha: np.ndarray
    update_interval: np.ndarray
    warmup_batches: np.ndarray
    down_hysteresis: np.ndarray
    up_hysteresis: np.ndarray
    combo: np.ndarray

    def __len__(self) -> int:
        return len(self.ladder_len)

    def slot(self, i: int) -> SlotConfig:
        return SlotConfig(candidate_steps=[int(s) for s in self.ladder[i, : self.ladder_len[i]]],
                          ema_alpha=float(self.ema_alpha[i]), update_interval=int(self.update_interval[i]),
                          warmup_batches=int(self.warmup_batches[i]), down_hysteresis=float(self.down_hysteresis[i]),
                          up_hysteresis=float(self.up_hysteresis[i]), ceiling_coeff=float(self.ceiling[i]))


def ladders(max_steps: int) -> list[tuple[int, ...]]:
    """Every ladder of the search space: contiguous runs lo..hi of 0..max_steps, and each one's every-other-rung form."""
    out = []
    for lo, hi in itertools.combinations_with_replacement(range(max_steps + 1), 2):
        run = list(range(lo, hi + 1))
        out.append(tuple(run))
        sparse = tuple(sorted(set(run[::2] + run[-1:])))
        if sparse != tuple(run):
            out.append(sparse)
    return out


def make_candidates(slot_options: list[tuple[tuple[int, ...], float]], continuous: list[dict[str, float]]) -> Candidates:
    """Every (ladder, ceiling) with every continuous combination; a one-rung ladder takes only the first
    combination (nothing else changes what it does)."""
    rows = []
    for ladder, ceiling in slot_options:
        for k, values in enumerate(continuous):
            if len(ladder) == 1 and k > 0:
                break
            rows.append((ladder, ceiling, values, k))
    width = max(len(r[0]) for r in rows)
    ladder_arr = np.array([list(r[0]) + [r[0][-1]] * (width - len(r[0])) for r in rows], dtype=np.int64)
    col = lambda key: np.array([r[2][key] for r in rows], dtype=float)
    return Candidates(ladder=ladder_arr, ladder_len=np.array([len(r[0]) for r in rows]), ceiling=np.array([r[1] for r in rows], dtype=float),
                      ema_alpha=col("ema_alpha"), update_interval=col("update_interval").astype(np.int64),
                      warmup_batches=col("warmup_batches").astype(np.int64), down_hysteresis=col("down_hysteresis"),
                      up_hysteresis=col("up_hysteresis"), combo=np.array([r[3] for r in rows]))


def simulate_slots(cands: Candidates, rounds: Rounds, mask: np.ndarray, launch_steps: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Run every candidate as one SGLang slot over the rounds where mask is True (the rounds routed to it), starting
    fresh in every run. Returns, per candidate and run ([C, runs]), the time it needs for the work of its rounds
    (per window: work x ms / tokens, as spectune.simulate charges; the part of a window in other slots counts apart),
    and the step chosen per masked round [C, R_masked] (for tests). Decisions are spectune.adaptive.SlotState's,
    vectorised: a slot starts at launch_steps if in its ladder (default: none is) else at its middle rung, with
    EMA = steps - 1."""
    n = len(cands)
    rows = np.arange(n)
    lad, length = cands.ladder, cands.ladder_len
    idx0 = length // 2
    if launch_steps is not None:
        hit = (lad == launch_steps[:, None]) & (np.arange(lad.shape[1])[None, :] < length[:, None])
        idx0 = np.where(hit.any(axis=1), np.argmax(hit, axis=1), idx0)
    time = np.zeros((n, rounds.num_runs))
    chosen = []
    idx = ema = count = None
    key = None  # (run, window) of the accumulators
    tok_acc, ms_acc, work_acc = np.zeros(n), np.zeros(n), 0.0
    horizon = rounds.horizon
    for r in np.flatnonzero(mask):
        run, window = int(rounds.run[r]), int(rounds.window[r])
        if key is not None and key != (run, window):
            time[:, key[0]] += work_acc * ms_acc / tok_acc
            tok_acc, ms_acc, work_acc = np.zeros(n), np.zeros(n), 0.0
        if key is None or key[0] != run:  # a fresh policy in every run
            idx = idx0.copy()
            ema = lad[rows, idx].astype(float) - 1.0
            count = np.zeros(n, dtype=np.int64)
        key = (run, window)
        g = lad[rows, idx]
        chosen.append(g)
        tok_acc += rounds.tokens[r, g]
        ms_acc += rounds.ms[r, g]
        work_acc += rounds.tokens[r, horizon]
        drafting = g > 0
        ema = np.where(drafting, (1 - cands.ema_alpha) * ema + cands.ema_alpha * rounds.obs[r, g], ema)
        count += 1
        since = count - cands.warmup_batches
        decide = (since > 0) & (since % cands.update_interval == 0)
        if decide.any():
            idx, ema = _decide(cands, idx, ema, decide)
    if key is not None:
        time[:, key[0]] += work_acc * ms_acc / tok_acc
    return time, np.array(chosen).T if chosen else np.zeros((n, 0), dtype=np.int64)


def _decide(c: Candidates, idx: np.ndarray, ema: np.ndarray, decide: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """SlotState._next_steps for the rows where decide is True (computed on those rows only)."""
    sel = np.flatnonzero(decide)
    lad, last = c.ladder[sel], c.ladder_len[sel] - 1
    rows = np.arange(len(sel))
    cur, e = idx[sel], ema[sel]
    old = lad[rows, cur]
    at_zero = old == 0
    up_one = np.minimum(cur + 1, last)
    target = lad[rows, up_one]
    e = np.where(at_zero & (target > 0) & (e < 0), target - 1.0, e)
    new = np.where(at_zero, up_one, cur)
    walking = ~at_zero
    moved = np.zeros(len(sel), dtype=bool)
    down_h, up_h, coeff = c.down_hysteresis[sel], c.up_hysteresis[sel], c.ceiling[sel]
    while walking.any():  # step down while the EMA would not fill the rung below
        below = lad[rows, np.maximum(new - 1, 0)]
        go = walking & (new > 0) & (e <= np.where(below == 0, 0.5, below - 0.5) + down_h)
        new -= go
        moved |= go
        walking = go
    walking = ~at_zero & ~moved
    while walking.any():  # else step up while the EMA fills the rung
        go = walking & (new < last) & (e > lad[rows, new] - 0.5 + up_h)
        new += go
        walking = go
    capped = ~at_zero & (coeff > 0)
    if capped.any():  # the ceiling caps a stay or a step down, never a step up
        ceiling = np.maximum(1, np.ceil(e * coeff))
        capped &= (ceiling < lad[rows, new]) & (lad[rows, new] <= old)
        while capped.any():
            go = capped & (new > 0) & (lad[rows, new] > ceiling)
            new -= go
            capped = go
    idx, ema = idx.copy(), ema.copy()
    idx[sel], ema[sel] = new, e
    return idx, ema


def continuous_grid(extra: list[dict[str, float]] = ()) -> list[dict[str, float]]:
    keys = list(CONTINUOUS)
    grid = [dict(zip(keys, values)) for values in itertools.product(*(CONTINUOUS[k] for k in keys))]
    return grid + [e for e in extra if e not in grid]


@dataclass(frozen=True, slots=True, eq=False)
class GridResult:
    best: AdaptiveConfig
    best_speedup: float
    grid_size: float  # configs the grid holds
    proxy_candidates: int  # slot configs simulated per batch-size range
    exact: pd.DataFrame  # the configs scored by the bench: proxy ratio, speedup, config
    seconds: float


def partitions(batch_sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Slot bounds: the smallest measured batch size always starts a slot (SGLang routes anything below the smallest
    bound to it), every other one may."""
    rest = batch_sizes[1:]
    return [tuple([batch_sizes[0], *(b for b, on in zip(rest, keep) if on)]) for keep in itertools.product([False, True], repeat=len(rest))]


def grid_search(rounds: Rounds, batch_sizes: tuple[int, ...], max_steps: int, score, tuned: AdaptiveConfig,
                also: list[AdaptiveConfig] = (), top_exact: int = TOP_EXACT) -> GridResult:
    """Stages 1 and 2 of the module docstring. score(AdaptiveConfig) -> the bench's speedup; `also`: more configs to
    score exactly (the presets, the best static g and schedule as configs)."""
    started = time.perf_counter()
    tuned_slot = next(iter(tuned.slots.values()))
    continuous = continuous_grid([{k: getattr(tuned_slot, k) for k in CONTINUOUS}])
    options = [(ladder, ceiling) for ladder in ladders(max_steps) for ceiling in (CEILINGS if len(ladder) > 1 else (0.0,))]
    options += [(tuple(s.candidate_steps), s.ceiling_coeff) for s in tuned.slots.values() if (tuple(s.candidate_steps), s.ceiling_coeff) not in options]
    cands = make_candidates(options, continuous)
    # Per batch-size range [bounds[i], bounds[j]): every candidate's time as that slot, per run.
    edges = list(batch_sizes) + [math.inf]
    ranges = {}
    for i, j in itertools.combinations(range(len(edges)), 2):
        mask = (rounds.batch_size < edges[j]) & ((rounds.batch_size >= edges[i]) if i > 0 else True)
        ranges[(i, j)] = simulate_slots(cands, rounds, mask)[0]
    proposals = []
    for bounds in partitions(batch_sizes):
        cut = [batch_sizes.index(b) for b in bounds] + [len(batch_sizes)]
        slots = [ranges[(cut[k], cut[k + 1])] for k in range(len(bounds))]
        for k in range(len(continuous)):
            usable = (cands.combo == k) | (cands.ladder_len == 1)
            value, picks = _least_log_time(slots, usable)
            proposals.append((value, bounds, tuple(picks)))
    proposals.sort(key=lambda p: p[0])
    seen, exact_rows = set(), []
    for value, bounds, picks in proposals:
        cfg = AdaptiveConfig(slots={b: cands.slot(p) for b, p in zip(bounds, picks)})
        key = str(cfg.to_dict())
        if key not in seen:
            seen.add(key)
            exact_rows.append({"source": "grid", "proxy_log_time": value, "config": cfg})
        if len(exact_rows) >= top_exact:
            break
    exact_rows += [{"source": "tuned", "proxy_log_time": math.nan, "config": tuned}]
    exact_rows += [{"source": "baseline", "proxy_log_time": math.nan, "config": c} for c in also]
    for row in exact_rows:
        row["speedup"] = score(row["config"])
    exact = pd.DataFrame(exact_rows)
    best = exact.loc[exact["speedup"].idxmax()]
    per_slot = sum(len(continuous) if len(lad) > 1 else 1 for lad, _ in options)
    grid_size = len(continuous) * sum(float(len(options)) ** len(b) for b in partitions(batch_sizes))  # continuous values shared
    return GridResult(best=best["config"], best_speedup=float(best["speedup"]), grid_size=grid_size, proxy_candidates=per_slot,
                      exact=exact.assign(config=exact["config"].map(lambda c: c.to_dict())), seconds=time.perf_counter() - started)


def _least_log_time(slots: list[np.ndarray], usable: np.ndarray, iterations: int = 20) -> tuple[float, list[int]]:
    """The candidate per slot (among usable ones) minimising sum over runs of log(total time of the run) (the bench's
    geometric mean over runs), by majorise-minimise: log is concave, so each step minimises its tangent, the sum
    over runs of time / current time, which is separable over slots; the objective never rises."""
    runs = slots[0].shape[1]
    weights = np.ones(runs)
    picks: list[int] = []
    best = math.inf
    for _ in range(iterations):
        new = [int(np.argmin(np.where(usable, t @ weights, np.inf))) for t in slots]
        total = sum(t[p] for t, p in zip(slots, new))  # [runs]
        value = float(np.log(np.maximum(total, 1e-12)).sum())
        if value >= best - 1e-12:
            break
        best, picks, weights = value, new, 1.0 / np.maximum(total, 1e-12)
    return best, picks
