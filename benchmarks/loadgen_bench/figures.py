"""What one client run measured, checked against what the emitter actually did.

Per request (matched by the " @<seq>" in its text; requests without text cannot be matched):
  true TTFT        a_0 - rx: the emitter's first emission minus the kernel's receive time of the request
  TTFT error       the client's TTFT minus the true TTFT. It holds the client's send path (its timestamp to the
                   request reaching the server: send_ms) and its read path (the chunk leaving the server to the
                   client's timestamp: recv_ms), for clients whose clock is CLOCK_MONOTONIC (both are shown).
  inter-chunk err  each gap the client recorded minus the true gap a_i - a_(i-1), pooled over chunks
  true TPOT        (a_last - a_0) / (tokens - 1), vLLM's definition, from the emitter's times
The emitter's own lateness (a_i - its schedule) is reported, never part of any error.

Rate and CPU are over the client's active window: first request received by the emitter to the last chunk
the client recorded. chunks/s = chunks of completed requests / window; CPU = client process tree's
user + sys in that window (interpolated from 50 ms samples); CPU per chunk = CPU / chunks.
"""

from __future__ import annotations

import math

import numpy as np

from loadgen_bench.clients import ClientRun
from loadgen_bench.emitter import Emitted, Schedule

NS_PER_MS = 1e6


def measure(run: ClientRun, served: dict[int, Emitted], schedule: Schedule) -> dict[str, float | int | str]:
    """Flat figures of one run (ms unless named otherwise)."""
    ttft_err, send_ms, recv_ms, gap_err, gaps, true_tpot, counted = [], [], [], [], [], [], []
    unmatched = failed = gap_len_mismatch = 0
    chunks = 0
    first_rx, last_end = None, None
    for r in run.requests:
        if r.error is not None or r.ttft_ms is None:
            failed += 1
            continue
        e = served.get(r.seq) if r.seq is not None else None
        if e is None or e.aborted or len(e.chunk_ns) == 0:
            unmatched += 1
            continue
        true_ttft = (e.chunk_ns[0] - e.rx_ns) / NS_PER_MS
        ttft_err.append(r.ttft_ms - true_ttft)
        if r.send_ns is not None:
            send_ms.append((e.rx_ns - r.send_ns) / NS_PER_MS)
            recv_ms.append((r.send_ns + r.ttft_ms * NS_PER_MS - e.chunk_ns[0]) / NS_PER_MS)
        true_gaps = np.diff(e.chunk_ns) / NS_PER_MS
        if r.gaps_ms is not None:
            if len(r.gaps_ms) == len(true_gaps):
                gap_err.append(np.asarray(r.gaps_ms) - true_gaps)
                gaps.append(np.asarray(r.gaps_ms))
            else:
                gap_len_mismatch += 1
        if e.max_tokens > 1:
            true_tpot.append((e.chunk_ns[-1] - e.chunk_ns[0]) / NS_PER_MS / (e.max_tokens - 1))
        counted.append(r.output_tokens if r.output_tokens is not None else math.nan)
        chunks += len(e.chunk_ns)
        first_rx = e.rx_ns if first_rx is None else min(first_rx, e.rx_ns)
        if r.end_ns is not None:
            last_end = r.end_ns if last_end is None else max(last_end, r.end_ns)
    lateness = _lateness(served, schedule)
    window_s = (last_end - first_rx) / 1e9 if first_rx is not None and last_end is not None else math.nan
    cpu_s = _cpu_between(run.cpu_samples, first_rx, last_end)
    deferred_s = float(run.reported.get("deferred_cpu_s") or 0.0)
    gap_err_all = np.concatenate(gap_err) if gap_err else np.array([])
    gaps_all = np.concatenate(gaps) if gaps else np.array([])
    completed = len(ttft_err)
    return {
        "requests": len(run.requests),
        "completed": completed,
        "failed": failed,
        "unmatched": unmatched,
        "ttft_err_mean": _mean(ttft_err),
        "ttft_err_p50": _pct(ttft_err, 50),
        "ttft_err_p99": _pct(ttft_err, 99),
        "send_mean": _mean(send_ms),
        "recv_mean": _mean(recv_ms),
        "gap_err_mean": _mean(gap_err_all),
        "gap_err_p99": _pct(gap_err_all, 99),
        "gap_abs_err_p99": _pct(np.abs(gap_err_all), 99),
        "gap_p50": _pct(gaps_all, 50),  # a burst reader shows gaps near 0 here
        "gap_len_mismatch": gap_len_mismatch,
        "tpot_true": _mean(true_tpot),
        "tpot_reported": run.reported.get("tpot_ms", math.nan),
        "per_token_true": schedule.gap_ms / schedule.tokens_per_chunk,
        "per_token_reported": run.reported.get("per_token_ms", math.nan),
        "tokens_counted_mean": _mean(counted),
        "tokens_true": schedule.max_tokens,
        "tps_true": completed * schedule.max_tokens / window_s if window_s > 0 else math.nan,
        "tps_reported": run.reported.get("output_tps", math.nan),
        "token_source": str(run.reported.get("token_source", "")),
        "self_flagged": run.reported.get("client_saturated"),  # spectune.clientload's verdict; None: the client has none
        "chunks": chunks,
        "window_s": window_s,
        "chunks_per_s": chunks / window_s if window_s > 0 else math.nan,
        "cpu_s": cpu_s,
        "cpu_util": cpu_s / window_s if window_s > 0 else math.nan,
        # a client that parses after its streams end (spectune) pays that CPU outside the window: it is added here
        "cpu_us_per_chunk": (cpu_s + deferred_s) / chunks * 1e6 if chunks else math.nan,
        "cpu_us_per_chunk_streaming": cpu_s / chunks * 1e6 if chunks else math.nan,
        **lateness,
    }


def _lateness(served: dict[int, Emitted], schedule: Schedule) -> dict[str, float]:
    """The emitter's own lateness: emission minus schedule (ms), and its read lag (parse - rx, ms)."""
    late, read = [], []
    for e in served.values():
        if len(e.chunk_ns) == 0:
            continue
        due = e.parse_ns + int(schedule.ttft_ms * NS_PER_MS) + np.arange(len(e.chunk_ns)) * int(schedule.gap_ms * NS_PER_MS)
        late.append((e.chunk_ns - due) / NS_PER_MS)
        read.append((e.parse_ns - e.rx_ns) / NS_PER_MS)
    late_all = np.concatenate(late) if late else np.array([])
    return {
        "emitter_late_p50": _pct(late_all, 50),
        "emitter_late_p99": _pct(late_all, 99),
        "emitter_late_max": float(late_all.max()) if late_all.size else math.nan,
        "emitter_early": int((late_all < 0).sum()),  # must be 0: the schedule is never run ahead of
        "emitter_read_lag_p99": _pct(read, 99),
    }


def _cpu_between(samples: list[tuple[int, float]], start_ns: int | None, end_ns: int | None) -> float:
    if start_ns is None or end_ns is None or len(samples) < 2:
        return math.nan
    t = np.array([s[0] for s in samples], dtype=float)
    c = np.array([s[1] for s in samples], dtype=float)
    return float(np.interp(end_ns, t, c) - np.interp(start_ns, t, c))


def _mean(values) -> float:
    arr = np.asarray(values, dtype=float)
    return float(np.nanmean(arr)) if arr.size and not np.isnan(arr).all() else math.nan


def _pct(values, q: float) -> float:
    arr = np.asarray(values, dtype=float)
    return float(np.percentile(arr, q)) if arr.size else math.nan
