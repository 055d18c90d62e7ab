"""The embedded engine's round log as steps and requests, joined with the load generator's records.

The engine logs every step (a prefill or a verify round): its start and end on the machine's monotonic clock
(time.perf_counter, which the load generator's perf_counter_ns stamps share), the requests in it, and for a prefill
when each request was received and handed to the engine. Joined request by request with the client's send and chunk
stamps, every request's latency splits exactly into

    TTFT = intake (send -> handed to the engine: HTTP, JSON, tokenizing, the server's event loop)
         + queue (-> the start of its prefill step) + prefill (the step's compute) + first delivery (-> first chunk)
    e2e  = TTFT + decode (prefill end -> end of its last step's compute) + last delivery - first delivery

and every step's wall (start to the next step's start, when the engine did not idle in between) is known.
spectune.calibration fits the replay's terms from these.
"""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from spectune.errors import SpectuneError

NEEDS = "the round log has no step clocks; sweep again with this spectune version (its engine logs start_s/end_s)"


def step_frame(path: str | Path) -> pd.DataFrame:
    """One row per engine step of a round log: kind, batch_size, num_steps (decode), width (drafts verified per
    request: the most any request proposed; 0 when none drafted), padded_tokens (prefill: batch x longest prompt),
    start_s/end_s (compute), next_start_s, wall_ms (start to the next step's start: compute, handing the tokens out
    and taking new requests in; NaN where the engine idled before the next step, or at the log's end) and
    request_ids."""
    rows = []
    with Path(path).open() as f:
        for number, line in enumerate(f, 1):
            row = json.loads(line)
            if "start_s" not in row:
                raise SpectuneError(f"{path}:{number}: {NEEDS}")
            prefill = bool(row.get("prefill"))
            prompts = row.get("prompt_tokens") or []
            rows.append({
                "kind": "prefill" if prefill else "decode",
                "batch_size": int(row["batch_size"]),
                "num_steps": 0 if prefill else int(row["num_steps"]),
                "width": 0 if prefill else max(row["proposed"], default=0),
                "padded_tokens": len(prompts) * max(prompts) if prompts else 0,
                "start_s": float(row["start_s"]),
                "end_s": float(row["end_s"]),
                "num_running": int(row.get("num_running") or 0),
                "request_ids": list(row["request_ids"]),
                "submitted_s": row.get("submitted_s"),
                "received_s": row.get("received_s"),
                "prompt_tokens": prompts,
                "proposed": row.get("proposed"),
                "accepted": row.get("accepted"),
            })
    steps = pd.DataFrame(rows)
    if steps.empty:
        raise SpectuneError(f"{path}: no steps logged")
    # A new engine (a restart, or the next server of a log that several appended to) numbers its requests from 0.
    steps["epoch"] = ((steps["kind"] == "prefill") & steps["request_ids"].map(lambda ids: 0 in ids)).cumsum()
    nxt = steps["start_s"].shift(-1)
    # The engine idles only with nothing to run: before a prefill of requests that all reached it after this step
    # ended, none running.
    first_submit = steps["submitted_s"].shift(-1).map(lambda s: min(s) if isinstance(s, list) and s and None not in s else np.nan)
    idle = (steps["kind"].shift(-1) == "prefill") & (steps["num_running"].shift(-1) == 0) & ~(first_submit <= steps["end_s"])
    idle |= steps["epoch"].shift(-1) != steps["epoch"]
    wall = (nxt - steps["start_s"]) * 1000.0
    steps["next_start_s"] = nxt
    steps["compute_ms"] = (steps["end_s"] - steps["start_s"]) * 1000.0
    steps["wall_ms"] = wall.where(~idle & (nxt >= steps["end_s"]))
    steps["contiguous"], steps["num_finished_before"] = _slots(steps)
    # Requests the server's event loop handed to the engine during the step: reading and tokenizing them holds the
    # interpreter the engine's step needs (measured: about their own duration is added to the step).
    submitted = np.sort(np.concatenate([np.asarray([t for t in s if t is not None], dtype=float)
                                        for s in steps["submitted_s"] if isinstance(s, list)] or [np.zeros(0)]))
    ends = steps["next_start_s"].fillna(steps["end_s"])
    steps["num_intakes"] = np.searchsorted(submitted, ends.to_numpy(float)) - np.searchsorted(submitted, steps["start_s"].to_numpy(float))
    return steps


def _slots(steps: pd.DataFrame) -> tuple[list[bool], list[int]]:
    """Per step, replaying the scheduler's KV-cache slots (spectune.engine.scheduler: an admitted request takes the
    lowest free slot, a finished one frees its slot after its last step): whether the batch's slots are one run
    (the model then reads the cache through a view; else it gathers the rows, spectune.engine.model) and how many
    requests finished at the step before."""
    last: dict[tuple[int, int], int] = {}
    for k, (epoch, ids) in enumerate(zip(steps["epoch"], steps["request_ids"])):
        for i in ids:
            last[(epoch, i)] = k
    free: list[int] = []
    fresh = 0
    slot: dict[tuple[int, int], int] = {}
    ending: dict[int, list[tuple[int, int]]] = {}
    contiguous, finished = [], []
    epoch_now = None
    for k, (kind, epoch, ids) in enumerate(zip(steps["kind"], steps["epoch"], steps["request_ids"])):
        if epoch != epoch_now:
            free, fresh, slot, epoch_now = [], 0, {}, epoch
        # A request of an engine killed before it finished ends in no step of the next engine's epoch.
        done = [key for key in ending.pop(k, []) if key[0] == epoch]
        for key in done:
            heapq.heappush(free, slot.pop(key))
        finished.append(len(done))
        keys = [(epoch, i) for i in ids]
        if kind == "prefill":
            for key in keys:
                if free and free[0] < fresh:
                    slot[key] = heapq.heappop(free)
                else:
                    slot[key], fresh = fresh, fresh + 1
            contiguous.append(True)
        else:
            taken = sorted(slot[key] for key in keys if key in slot)
            contiguous.append(not taken or taken == list(range(taken[0], taken[0] + len(taken))))
        for key in keys:
            if last[key] == k:
                ending.setdefault(k + 1, []).append(key)
    return contiguous, finished


def engine_requests(steps: pd.DataFrame) -> pd.DataFrame:
    """Per engine request (id): received_s, submitted_s, prompt_tokens, its prefill step's start/end, and per
    step that produced a chunk for it (the prefill, then every decode step it ran in) that step's end_s."""
    prefills = steps[steps["kind"] == "prefill"]
    rows = {}
    for step in prefills.itertuples():
        for k, rid in enumerate(step.request_ids):
            rows[rid] = {"request_id": rid, "received_s": step.received_s[k], "submitted_s": step.submitted_s[k],
                         "prompt_tokens": step.prompt_tokens[k], "prefill_start_s": step.start_s, "prefill_end_s": step.end_s,
                         "prefill_batch": step.batch_size, "step_ends": [step.end_s], "widths": [], "batch_sizes": [],
                         "proposed": [], "accepted": [], "num_steps": []}
    for step in steps[steps["kind"] == "decode"].itertuples():
        for k, rid in enumerate(step.request_ids):
            if rid in rows:  # a request prefilled before the log began is skipped
                r = rows[rid]
                r["step_ends"].append(step.end_s)
                r["widths"].append(step.width)
                r["batch_sizes"].append(step.batch_size)
                r["proposed"].append(step.proposed[k])
                r["accepted"].append(step.accepted[k])
                r["num_steps"].append(step.num_steps)
    return pd.DataFrame(list(rows.values()))


def join_requests(client: pd.DataFrame, engine: pd.DataFrame, lookahead: int = 64) -> pd.DataFrame:
    """The load generator's rows (one cell's or several) matched to the engine's requests: in order of send, each
    takes the first engine request received at or after its send that no earlier one took and that agrees with it
    on prompt tokens and number of chunks (requests sent together may reach the server in another order; warm-up
    requests, not in the client's rows, are passed over). Rows without such a request are dropped and counted in
    attrs["unmatched"]."""
    client = client[client["error"].isna()].sort_values("send_ns")
    engine = engine.sort_values("received_s").reset_index(drop=True)
    received = engine["received_s"].to_numpy(float)
    prompts = engine["prompt_tokens"].to_numpy()
    chunks = engine["step_ends"].map(len).to_numpy()
    taken = np.zeros(len(engine), dtype=bool)
    picks, rows = [], []
    for row in client.itertuples():
        start = int(np.searchsorted(received, row.send_ns / 1e9))
        for k in range(start, min(start + lookahead, len(engine))):
            if not taken[k] and prompts[k] == row.prompt_tokens and chunks[k] == row.num_chunks:
                taken[k] = True
                picks.append(k)
                rows.append(row.Index)
                break
    joined = pd.concat([client.loc[rows].reset_index(drop=True), engine.loc[picks].reset_index(drop=True).add_prefix("e_")], axis=1)
    joined.attrs["unmatched"] = int(len(client) - len(joined))
    return joined


def latency_parts(joined: pd.DataFrame) -> pd.DataFrame:
    """Per matched request, its TTFT and e2e split into the parts of the module docstring (ms), and each chunk's
    delivery (client stamp - the end of the step that produced it)."""
    send = joined["send_ns"].to_numpy(float) / 1e9
    first = joined["chunk_ns"].map(lambda c: c[0]).to_numpy(float) / 1e9
    last = joined["chunk_ns"].map(lambda c: c[-1]).to_numpy(float) / 1e9
    last_end = joined["e_step_ends"].map(lambda e: e[-1]).to_numpy(float)
    ms = lambda x: x * 1000.0
    out = pd.DataFrame({
        "ttft_ms": ms(first - send),
        "e2e_ms": ms(last - send),
        "intake_ms": ms(joined["e_submitted_s"].to_numpy(float) - send),
        "http_ms": ms(joined["e_received_s"].to_numpy(float) - send),
        "queue_ms": ms(joined["e_prefill_start_s"].to_numpy(float) - joined["e_submitted_s"].to_numpy(float)),
        "prefill_ms": ms(joined["e_prefill_end_s"].to_numpy(float) - joined["e_prefill_start_s"].to_numpy(float)),
        "first_delivery_ms": ms(first - joined["e_prefill_end_s"].to_numpy(float)),
        "decode_ms": ms(last_end - joined["e_prefill_end_s"].to_numpy(float)),
        "last_delivery_ms": ms(last - last_end),
        "prefill_batch": joined["e_prefill_batch"].to_numpy(int),
        "output_tokens": joined["output_tokens"].to_numpy(int),
    })
    deliveries = [ms(np.asarray(c, dtype=float) / 1e9 - np.asarray(e, dtype=float)) for c, e in zip(joined["chunk_ns"], joined["e_step_ends"])]
    out["mean_delivery_ms"] = [float(d.mean()) for d in deliveries]
    return out


@dataclass(frozen=True, slots=True, eq=False)
class JoinedRun:
    """A results directory's cells joined with its servers' round logs."""

    steps: dict[str, pd.DataFrame]  # per server
    requests: pd.DataFrame  # matched requests of every cell: cell, server, batch_size + latency_parts columns + joins
    unmatched: int


def join_run(run) -> JoinedRun:
    """Every cell of a loaded run (spectune.store.Run) whose server has a round log with step clocks."""
    steps, frames, unmatched = {}, [], 0
    for server, path in run.round_logs.items():
        steps[server] = step_frame(path)
        engine = engine_requests(steps[server])
        cells = run.cells[(run.cells["server"] == server) & (run.cells["status"] == "ok")]
        for cell in cells.itertuples():
            client = run.requests[run.requests["cell"] == cell.cell]
            joined = join_requests(client, engine)
            unmatched += joined.attrs["unmatched"]
            parts = latency_parts(joined)
            frames.append(pd.concat([joined, parts.drop(columns=["ttft_ms", "e2e_ms", "output_tokens"])], axis=1)
                          .assign(cell=cell.cell, server=server, batch_size=cell.batch_size))
    if not frames:
        raise SpectuneError(f"{run.root}: no cells with round logs to join")
    return JoinedRun(steps=steps, requests=pd.concat(frames, ignore_index=True), unmatched=unmatched)


def cell_windows(requests: pd.DataFrame, cells: pd.Series) -> list[tuple[float, float]]:
    """Each cell's measured window on the monotonic clock (s): its first send to its last stream end."""
    rows = requests[requests["cell"].isin(cells)]
    spans = rows.groupby("cell").agg(lo=("send_ns", "min"), hi=("end_ns", "max"))
    return [(lo / 1e9, hi / 1e9) for lo, hi in zip(spans["lo"], spans["hi"])]


def in_windows(times: pd.Series, windows: list[tuple[float, float]]) -> pd.Series:
    inside = pd.Series(False, index=times.index)
    for lo, hi in windows:
        inside |= (times >= lo) & (times <= hi)
    return inside


def has_step_clocks(run) -> bool:
    """Whether every round log of the run was written by an engine that logs step clocks."""
    for path in run.round_logs.values():
        with Path(path).open() as f:
            first = f.readline()
        if not first or "start_s" not in json.loads(first):
            return False
    return bool(run.round_logs)
