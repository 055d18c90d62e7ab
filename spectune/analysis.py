"""Per-request records -> per-cell metrics, acceptance from scrapes, and speedups vs target-only.

Metrics (times in ms, from perf_counter_ns stamps taken by the load generator; a "token chunk" is a
streamed chunk that carried >= 1 output token, so role-only and empty chunks never count). A request's clock
starts at its intended send time: its arrival offset under trace and Poisson schedules (what a user waits,
queueing in the client included), its actual send in closed loop (where the two are the same):
- ttft_ms          intended send -> first token chunk.
- icl_ms           inter-chunk latency: one value per gap between consecutive token chunks (what vLLM's
                   bench calls ITL). Under speculative decoding one chunk carries several tokens.
- itl_ms           inter-token latency: each gap between token chunks split evenly over the tokens of the
                   later chunk (a 30 ms gap bringing 3 tokens gives three values of 10 ms; SGLang's bench).
                   Extra tokens in the first chunk add no value (they arrive with TTFT). Unknown (NaN, with
                   per_token_unknown counting the requests) when a server sent no per-chunk counts, no tokenizer
                   was given and its total does not confirm one token per chunk: never the inter-chunk gap.
- tpot_ms          per request (e2e_ms - ttft_ms) / (output_tokens - 1); NaN when output_tokens <= 1.
- e2e_ms           intended send -> last token chunk (not the end of the stream: the trailing usage chunk and
                   [DONE] carry no tokens, so TPOT and ITL cover the same span).
- ttft_from_send_ms, e2e_from_send_ms  the same from the actual send (what the server alone is answerable for).
- queue_delay_ms   actual send - intended send: time queued in the client for a free slot (0 in closed loop).
- tokens_per_chunk per request output_tokens / number of token chunks.
output_tokens is the server's final usage count; when a server sends none, the per-chunk sum.
Pooling: icl_ms and itl_ms pool every gap of every successful request; ttft_ms, tpot_ms, e2e_ms and
tokens_per_chunk give one value per successful request. Each is reported as _mean, _p50, _p90, _p99
(linear interpolation). Warm-up requests are left out entirely. Failed requests are left out of the
latency figures but counted in num_failed and failure_rate; they are never dropped silently.
Throughput is over the measured window, first (intended) send to last end (stream end or failure) among
measured requests: request_throughput_rps = successful requests / duration_s; output_throughput_tps = output
tokens of successful requests / duration_s (tokens, never chunks); goodput_rps = successful requests
meeting every limit of the Slo / duration_s (a request with no TPOT, output_tokens <= 1, is judged on
the other limits; TTFT and e2e are judged from the intended send). num_token_mismatch counts requests
whose per-chunk counts (from the server or a tokenizer) do not add up to the server's usage total.

Speedup (speedup_table): each speculative cell is paired with the target-only cell of the same batch
size (and request rate, for open-loop cells) and repeat number; the speedup is the geometric mean of the
per-repeat ratios, with a 95% t-interval on the log-ratios (NaN with a single repeat). In an open loop the
arrivals set output tokens/s (every server serves the same requests at the same times), so there the speedup is
target-only's mean TPOT over the server's: how much faster each request decodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from spectune.errors import SpectuneError
from spectune.records import Acceptance, RequestRecord, Scrape

LATENCY_METRICS = ("ttft_ms", "icl_ms", "itl_ms", "tpot_ms", "e2e_ms", "tokens_per_chunk", "ttft_from_send_ms",
                   "e2e_from_send_ms", "queue_delay_ms")
NS_PER_MS = 1e6


@dataclass(frozen=True, slots=True)
class Slo:
    """Service-level limits for goodput; None = no limit on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None


def request_frame(records: list[RequestRecord]) -> pd.DataFrame:
    """One row per measured (non-warm-up) request, failed ones included with their error."""
    rows = []
    for r in records:
        if r.warmup:
            continue
        output_tokens = r.output_tokens if r.output_tokens is not None else r.counted_tokens
        ttft = e2e = ttft_send = e2e_send = math.nan
        if r.chunk_ns:
            ttft, e2e = (r.chunk_ns[0] - r.intended) / NS_PER_MS, (r.chunk_ns[-1] - r.intended) / NS_PER_MS
            ttft_send, e2e_send = (r.chunk_ns[0] - r.send_ns) / NS_PER_MS, (r.chunk_ns[-1] - r.send_ns) / NS_PER_MS
        rows.append(
            {
                "index": r.index,
                "send_ns": r.send_ns,
                "intended_ns": r.intended,
                "end_ns": r.end_ns,
                "ttft_ms": ttft,
                "tpot_ms": (e2e - ttft) / (output_tokens - 1) if output_tokens > 1 else math.nan,
                "e2e_ms": e2e,
                "ttft_from_send_ms": ttft_send,
                "e2e_from_send_ms": e2e_send,
                "queue_delay_ms": (r.send_ns - r.intended) / NS_PER_MS,
                "output_tokens": output_tokens,
                "counted_tokens": r.counted_tokens,
                "prompt_tokens": r.prompt_tokens,
                "num_chunks": len(r.chunk_ns),
                "tokens_per_chunk": output_tokens / len(r.chunk_ns) if r.chunk_ns else math.nan,
                "token_source": r.token_source,
                "token_mismatch": r.per_token_known and r.output_tokens is not None and r.output_tokens != r.counted_tokens,
                "per_token_unknown": not r.per_token_known,
                "error": r.error,
                "chunk_ns": list(r.chunk_ns),  # raw: every metric above can be recomputed from these
                "chunk_tokens": list(r.chunk_tokens),
                "text": r.text,
            }
        )
    return pd.DataFrame(rows, columns=_FRAME_COLUMNS)


_FRAME_COLUMNS = [
    "index", "send_ns", "intended_ns", "end_ns", "ttft_ms", "tpot_ms", "e2e_ms", "ttft_from_send_ms", "e2e_from_send_ms",
    "queue_delay_ms", "output_tokens", "counted_tokens", "prompt_tokens", "num_chunks", "tokens_per_chunk", "token_source",
    "token_mismatch", "per_token_unknown", "error", "chunk_ns", "chunk_tokens", "text",
]


def chunk_gaps(records: list[RequestRecord]) -> tuple[list[float], list[float]]:
    """(icl_ms, itl_ms) pooled over all successful measured requests; itl_ms is empty when any of them has
    unknown per-chunk token counts (a figure from the others alone would not describe the cell)."""
    icl, itl = [], []
    ok = [r for r in records if not r.warmup and r.error is None]
    known = all(r.per_token_known for r in ok)
    for r in ok:
        for i in range(1, len(r.chunk_ns)):
            gap = (r.chunk_ns[i] - r.chunk_ns[i - 1]) / NS_PER_MS
            icl.append(gap)
            if known:
                itl.extend([gap / r.chunk_tokens[i]] * r.chunk_tokens[i])
    return icl, itl


def summarize_cell(records: list[RequestRecord], slo: Slo | None = None) -> dict[str, float]:
    """Flat metrics of one cell (see the module docstring for every definition)."""
    frame = request_frame(records)
    ok = frame[frame["error"].isna()]
    icl, itl = chunk_gaps(records)
    pooled = {"icl_ms": icl, "itl_ms": itl}  # one value per gap; the others one per request
    summary: dict[str, float] = {}
    for name in LATENCY_METRICS:
        summary |= _stats(name, pooled[name] if name in pooled else ok[name])
    duration_s = float(frame["end_ns"].max() - frame["intended_ns"].min()) / 1e9 if len(frame) else math.nan
    per_s = 1.0 / duration_s if duration_s > 0 else math.nan
    output_tokens_total = int(ok["output_tokens"].sum())
    summary |= {
        "num_requests": len(frame),
        "num_failed": len(frame) - len(ok),
        "failure_rate": (len(frame) - len(ok)) / len(frame) if len(frame) else math.nan,
        "duration_s": duration_s,
        "request_throughput_rps": len(ok) * per_s,
        "output_throughput_tps": output_tokens_total * per_s,
        "output_tokens_total": output_tokens_total,
        "num_token_mismatch": int(frame["token_mismatch"].sum()),
        "per_token_unknown": int(ok["per_token_unknown"].sum()),
    }
    if slo is not None:
        summary["goodput_rps"] = int(_meets(ok, slo).sum()) * per_s
    return summary


def _stats(name: str, values) -> dict[str, float]:
    arr = np.asarray(values, dtype=float)
    arr = arr[~np.isnan(arr)]
    if arr.size == 0:
        return {f"{name}_{s}": math.nan for s in ("mean", "p50", "p90", "p99")}
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {f"{name}_mean": float(arr.mean()), f"{name}_p50": float(p50), f"{name}_p90": float(p90), f"{name}_p99": float(p99)}


def _meets(ok: pd.DataFrame, slo: Slo) -> pd.Series:
    meets = pd.Series(True, index=ok.index)
    for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
        limit = getattr(slo, name)
        if limit is not None:
            passes = ok[name] <= limit
            if name == "tpot_ms":  # a single-token request has no TPOT to miss
                passes |= ok[name].isna()
            meets &= passes
    return meets


def acceptance(before: Scrape, after: Scrape) -> Acceptance:
    """Acceptance over the window between two scrapes.

    vLLM counters: rate = dAccepted / dDraftTokens, mean_length = 1 + dAccepted / dDrafts,
    per_pos[i] = dAcceptedAtPos[i] / dDrafts. Without counters (SGLang), mean_length is the server's
    lifetime avg_accept_length and is_lifetime is True. No drafts in the window: all None.
    """
    drafts = _delta(before.num_drafts, after.num_drafts)
    if drafts is None:
        if after.avg_accept_length is not None:
            return Acceptance(rate=None, mean_length=after.avg_accept_length, is_lifetime=True)
        return Acceptance(rate=None, mean_length=None)
    accepted = _delta(before.num_accepted_tokens, after.num_accepted_tokens)
    draft_tokens = _delta(before.num_draft_tokens, after.num_draft_tokens)
    if drafts <= 0:
        return Acceptance(rate=None, mean_length=None)
    per_pos = ()
    if len(before.accepted_per_pos) == len(after.accepted_per_pos):
        per_pos = tuple((a - b) / drafts for b, a in zip(before.accepted_per_pos, after.accepted_per_pos))
    return Acceptance(
        rate=accepted / draft_tokens if accepted is not None and draft_tokens else None,
        mean_length=1 + accepted / drafts if accepted is not None else None,
        per_pos=per_pos,
        num_drafts=drafts,
        num_accepted_tokens=accepted,
    )


def _delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


def open_loop(cells: pd.DataFrame) -> pd.Series:
    """Cells measured under an open-loop schedule (trace, poisson): their batch size is a cap, their tok/s the arrivals'."""
    if "schedule" in cells:
        return cells["schedule"].fillna("closed") != "closed"
    return cells["request_rate"].notna() if "request_rate" in cells else pd.Series(False, index=cells.index)


OPEN_LOOP_NOTE = ("open loop: the arrivals set output tokens/s (every server got the same requests at the same times), "
                  "so a speedup here is target-only's mean TPOT / the server's on the same arrivals (a row per request rate "
                  "where the plan sets rates), the batch size being the cap on requests in flight")


def where_text(batch_size: int, request_rate: float | None) -> str:
    """A recommendation row's place: batch size "8", or in an open loop "16 req/s (cap 8)"."""
    return f"{batch_size}" if pd.isna(request_rate) else f"{request_rate:g} req/s (cap {batch_size})"


def speedup_table(
    cells: pd.DataFrame, metric: str = "output_throughput_tps", *, tpot_metric: str = "tpot_ms_mean", baseline: str | None = None
) -> pd.DataFrame:
    """Speedup of every speculative (server, batch_size) over the target-only server at that batch size.

    `cells`: one row per measured cell with columns server, is_speculative, num_speculative_tokens,
    batch_size, repeat, status and the metric columns. Only status "ok" counts. `speedup` is
    spec/target of `metric` (higher is better); `tpot_speedup` is target/spec of `tpot_metric`.
    `baseline` names the target-only server when there is more than one.
    """
    required = {"server", "is_speculative", "num_speculative_tokens", "batch_size", "repeat", "status", metric}
    missing = required - set(cells.columns)
    if missing:
        raise SpectuneError(f"cells: missing column(s) {', '.join(sorted(missing))}; pass a frame with one row per cell")
    ok = cells[cells["status"] == "ok"]
    targets = sorted(ok.loc[~ok["is_speculative"].astype(bool), "server"].unique())
    if baseline is None:
        if len(targets) != 1:
            raise SpectuneError(f"speedup: {len(targets)} target-only servers ({', '.join(targets)}); name one as baseline")
        baseline = targets[0]
    elif baseline not in targets:
        raise SpectuneError(f"baseline: {baseline!r} has no ok target-only cells; choose one of {', '.join(targets)}")
    target = ok[ok["server"] == baseline]
    # open-loop cells: the same rate too (NaN for closed loop, so a mixed plan pairs like with like)
    has_rate = "request_rate" in ok and ok["request_rate"].notna().any()
    if has_rate:
        ok, target = ok.assign(request_rate=ok["request_rate"].fillna(0.0)), target.assign(request_rate=target["request_rate"].fillna(0.0))
    keys = ["batch_size", "request_rate"] if has_rate else ["batch_size"]
    rows = []
    for (server, *axis), spec in ok[ok["is_speculative"].astype(bool)].groupby(["server", *keys], sort=True):
        at = target[(target[keys] == axis).all(axis=1)]
        pairs = spec.merge(at, on="repeat", suffixes=("", "_target"))
        ratios = pairs[metric] / pairs[f"{metric}_target"]
        if metric == "output_throughput_tps" and tpot_metric in pairs and open_loop(pairs).all():  # module docstring
            ratios = pairs[f"{tpot_metric}_target"] / pairs[tpot_metric]
        speedup, low, high = _ratio_ci(ratios)
        row = {
            "server": server,
            "num_speculative_tokens": spec["num_speculative_tokens"].iloc[0],
            **dict(zip(keys, axis)),
            "num_repeats": len(pairs),
            "speedup": speedup,
            "speedup_ci_low": low,
            "speedup_ci_high": high,
        }
        if tpot_metric in pairs.columns:
            tpot, tpot_low, tpot_high = _ratio_ci(pairs[f"{tpot_metric}_target"] / pairs[tpot_metric])
            row |= {"tpot_speedup": tpot, "tpot_speedup_ci_low": tpot_low, "tpot_speedup_ci_high": tpot_high}
        rows.append(row)
    return pd.DataFrame(rows)


def _ratio_ci(ratios: pd.Series) -> tuple[float, float, float]:
    """Geometric mean of the ratios and its 95% t-interval (on log-ratios); NaN where undefined."""
    logs = np.log(ratios.to_numpy(dtype=float))
    logs = logs[np.isfinite(logs)]
    if logs.size == 0:
        return math.nan, math.nan, math.nan
    center = float(np.exp(logs.mean()))
    if logs.size < 2:
        return center, math.nan, math.nan
    half = t_quantile_975(logs.size - 1) * logs.std(ddof=1) / math.sqrt(logs.size)
    return center, float(np.exp(logs.mean() - half)), float(np.exp(logs.mean() + half))


# Two-sided 95% Student-t critical values for 1..30 degrees of freedom (scipy stays a test-only dependency).
_T975 = (
    12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
    2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
    2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423,
)


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t; beyond the table, the Cornish-Fisher expansion (error < 1e-4)."""
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def t_quantile(p: float, df: int) -> float:
    """The p quantile of Student's t with df degrees of freedom (0.5 < p < 1), by bisection on its CDF written with
    the regularized incomplete beta function (scipy is a test-only dependency; agreement with scipy is tested)."""
    if not 0.5 < p < 1 or df < 1:
        raise ValueError(f"t_quantile: need 0.5 < p < 1 and df >= 1, got p={p}, df={df}")
    tail = lambda t: 0.5 * _betai(df / 2, 0.5, df / (df + t * t))  # P(T > t), t >= 0
    lo, hi = 0.0, 1.0
    while tail(hi) > 1 - p:
        lo, hi = hi, hi * 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tail(mid) > 1 - p else (lo, mid)
        if hi - lo < 1e-10 * hi:
            break
    return (lo + hi) / 2


def _betai(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b) (continued fraction, modified Lentz)."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _betai(b, a, 1.0 - x)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)), -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * f / a


def model_pick(measured: pd.Series, fitted: pd.Series):
    """Of the speedups over target-only `measured` above 1, the label of the one the cost model's `fitted` speedups
    (same index, NaN: not fitted, its measured one counts) put highest; None where none was measured above 1. The
    caller still checks the fitted speedup of the pick: at 1 or below, target-only is the answer."""
    faster = measured > 1.0
    return fitted.fillna(measured)[faster].idxmax() if faster.any() else None


def recommendation_table(cells: pd.DataFrame, max_failure_rate: float = 0.05, baseline: str | None = None,
                         expected: pd.Series | None = None) -> pd.DataFrame:
    """The measured answer per batch size: the static server with the highest output-throughput speedup over
    target-only (speedup_table's geometric mean and 95% CI), or target-only itself where no speculative server
    measured faster. Adaptive-config servers are left out (their step count moves during a cell). `baseline`: the
    target-only server to compare with when there are several (spectune.store.first_target), if it has usable cells.
    `expected`: the cost model's tok/s per (batch_size, server), fitted on every cell, of the cells it is trusted on
    (spectune.guided.expected_tps; a cell without it counts as measured). The pick is then, of the servers measured
    faster than target-only, the one the model expects fastest, or target-only where the model expects that one no
    faster: a lead that one launch's luck gave is not taken.

    Columns: batch_size, server, method ("target-only" for none), steps (0 for target-only), speedup,
    speedup_ci_low, speedup_ci_high, tpot_speedup, acceptance_rate, acceptance_length, is_clear: the
    interval excludes 1 (for target-only rows: the fastest speculative server's interval lies below 1); with one
    repeat there is no interval and nothing is clear; compared: a speculative server was measured at this batch
    size (False only on a target-only row, e.g. a guided sweep that measured none there); fastest_measured and
    fastest_speedup: the server measured fastest and its speedup; expected_speedup and fastest_expected: the model's
    speedups for the pick and for that server (NaN without `expected`)."""
    ok = cells[(cells["status"] == "ok") & (cells["failure_rate"].fillna(0.0) <= max_failure_rate)]
    if "adaptive_config" in ok:
        ok = ok[ok["adaptive_config"].isna()]
    columns = ["batch_size", "request_rate", "server", "method", "steps", "speedup", "speedup_ci_low", "speedup_ci_high", "tpot_speedup",
               "acceptance_rate", "acceptance_length", "is_clear", "compared", "fastest_measured", "fastest_speedup",
               "expected_speedup", "fastest_expected"]
    if ok.empty or ok["is_speculative"].astype(bool).all():
        return pd.DataFrame(columns=columns)
    if baseline not in set(ok.loc[~ok["is_speculative"].astype(bool), "server"]):
        baseline = None
    speedups = (speedup_table(ok, baseline=baseline) if ok["is_speculative"].astype(bool).any()
                else pd.DataFrame(columns=["batch_size", "speedup"]))
    means = ok.groupby("server")[["method"]].first()
    acc = ok.groupby(["server", "batch_size"])[[c for c in ("acceptance_rate", "acceptance_length") if c in ok]].mean()
    target = baseline or ok.loc[~ok["is_speculative"].astype(bool), "server"].iloc[0]
    target_tps = ok[ok["server"] == target].groupby("batch_size")["output_throughput_tps"].mean()
    rates = ok["request_rate"] if "request_rate" in ok else pd.Series(math.nan, index=ok.index)
    rows = []
    mine = ok["server"] == target  # open loop: one row per batch size cap and rate (rate None in a closed loop)
    keys = {(int(b), float(r) if pd.notna(r) else None) for b, r in zip(ok.loc[mine, "batch_size"], rates[mine])}
    for bs, rate in sorted(keys, key=lambda k: (k[0], k[1] or 0.0)):
        at = speedups[speedups["batch_size"] == bs].dropna(subset=["speedup"])
        if rate is not None and "request_rate" in at:
            at = at[at["request_rate"] == rate]
        place = {"batch_size": int(bs), "request_rate": math.nan if rate is None else rate}
        fastest = at.loc[at["speedup"].idxmax()] if not at.empty else None
        model = pd.Series([expected.get((bs, s), math.nan) / target_tps[bs] if expected is not None else math.nan
                           for s in at.get("server", [])], index=at.index, dtype=float)
        pick = model_pick(at["speedup"], model)
        best = at.loc[pick] if pick is not None else fastest
        seen = {"fastest_measured": fastest["server"] if fastest is not None else None,
                "fastest_speedup": float(fastest["speedup"]) if fastest is not None else math.nan,
                "expected_speedup": float(model[best.name]) if best is not None else math.nan,
                "fastest_expected": float(model[fastest.name]) if fastest is not None else math.nan}
        if best is None or best["speedup"] <= 1.0 or seen["expected_speedup"] <= 1.0:
            # is_clear here: the fastest speculative server was slower beyond noise (its interval is below 1)
            rows.append({**place, "server": target, "method": "target-only", "steps": 0, "speedup": 1.0,
                         "speedup_ci_low": math.nan, "speedup_ci_high": math.nan, "tpot_speedup": 1.0,
                         "acceptance_rate": math.nan, "acceptance_length": math.nan,
                         "is_clear": bool(fastest is not None and fastest["speedup_ci_high"] < 1.0), "compared": fastest is not None,
                         **seen})
            continue
        server = best["server"]
        figures = acc.loc[(server, bs)] if (server, bs) in acc.index else pd.Series(dtype=float)
        rows.append({**place, "server": server, "method": means.loc[server, "method"],
                     "steps": int(best["num_speculative_tokens"]), "speedup": float(best["speedup"]),
                     "speedup_ci_low": float(best["speedup_ci_low"]), "speedup_ci_high": float(best["speedup_ci_high"]),
                     "tpot_speedup": float(best.get("tpot_speedup", math.nan)),
                     "acceptance_rate": float(figures.get("acceptance_rate", math.nan)),
                     "acceptance_length": float(figures.get("acceptance_length", math.nan)),
                     "is_clear": bool(best["speedup_ci_low"] > 1.0), "compared": True, **seen})
    return pd.DataFrame(rows, columns=columns)
