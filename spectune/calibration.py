"""The request-level replay calibrated against the embedded engine it stands for (spectune.simulate.simulate_requests):
its serving-cost terms and acceptance fitted from a closed-loop sweep's step logs joined with the load generator's
records (spectune.steplog), the replay set beside a measured run, and how fast the engine ran in a run (speed index).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from spectune.costmodel import (
    MIN_BUCKET_ROUNDS,
    MIN_REQUEST_OVERHEAD_MS,
    POSITION_BUCKET_TOKENS,
    PositionalAcceptance,
    RoundCost,
    ServingCost,
    _line_fit,
    fit_positional_acceptance,
)
from spectune.errors import SpectuneError
from spectune.steplog import cell_windows, engine_requests, in_windows, join_requests, step_frame

# --- fitting the replay's terms ----------------------------------------------------------------------------------

MAX_FOREIGN_CORES = 0.25  # cells measured while other work used more of the machine are left out of the fit
MIN_STEPS = 10  # steps per (batch size, width) below which a median wall is not trusted
RELATIVE_FIT_ROUNDS = 10  # re-weightings of the prefill fit (fit_prefill); it settles in 3-5


def quiet_cells(cells: pd.DataFrame, max_foreign: float = MAX_FOREIGN_CORES) -> pd.DataFrame:
    """The ok cells measured while other work used at most max_foreign cores, and for each (server, batch size)
    with none that quiet its least disturbed cell: a busy moment must not leave the fit without a batch size it
    needs (all ok cells when the sweep did not record other work)."""
    ok = cells[cells["status"] == "ok"]
    if "foreign_cpu_cores" not in ok or ok.empty:
        return ok
    foreign = ok["foreign_cpu_cores"].fillna(0.0)
    least = foreign.groupby([ok["server"], ok["batch_size"]]).transform("min")
    return ok[(foreign <= max_foreign) | ((foreign == least) & (least > max_foreign))]


@dataclass(frozen=True, slots=True)
class StepEffects:
    """What else a decode step's wall depends on (ms), beyond its clean cost (fit_step_costs): gather per sequence of a
    batch not in one run of slots, per request taken in during the step, per request finished at the step before."""

    gather_ms_per_seq: float
    intake_ms: float
    finish_ms: float
    steps: int


def fit_step_effects(steps: pd.DataFrame, decode: RoundCost) -> StepEffects:
    """StepEffects from decode steps with a wall (columns of step_frame): least squares of every step's wall over its
    clean cost (decode, fitted on the clean steps), in relative terms as the replay is judged. In ms the largest
    batches set the terms, and their tensor work leaves the interpreter free for a request's intake: on the swing sweep
    (benchmarks/README.md, issue 13) that fit charged an intake 0.36 ms where a step at batch 2-4 pays 0.9 ms, and the
    replay's TTFT came out 1-1.5 points short. Steps at batch sizes outside the clean cost's (extrapolated there) are
    left out. A negative estimate (noise) is taken as 0."""
    inside = steps["batch_size"].between(min(decode.batch_sizes), max(decode.batch_sizes))
    d = steps[(steps["kind"] == "decode") & steps["wall_ms"].notna() & inside]
    if d.empty:
        return StepEffects(0.0, 0.0, 0.0, 0)
    bs, clean = d["batch_size"].to_numpy(float), clean_walls(d, decode)
    effects = np.column_stack([bs * ~d["contiguous"].astype(bool).to_numpy(), d["num_intakes"], d["num_finished_before"]])
    coef, *_ = np.linalg.lstsq(effects.astype(float) / clean[:, None], d["wall_ms"].to_numpy(float) / clean - 1.0, rcond=None)
    gather, intake, finish = (max(0.0, float(c)) for c in coef)
    return StepEffects(gather, intake, finish, len(d))


def clean_walls(steps: pd.DataFrame, decode: RoundCost) -> np.ndarray:
    """Per decode step (step_frame rows), its wall without the step effects: a plain decode at its batch size, or a
    round that ran the proposer and verified its width."""
    bs, width = steps["batch_size"].to_numpy(float), steps["width"].to_numpy(float)
    return np.where(steps["num_steps"].to_numpy() > 0, decode.t_speculative(bs, width), decode.t_round(bs, np.zeros_like(bs)))


def fit_step_costs(steps: pd.DataFrame) -> RoundCost:
    """Decode wall per batch size from clean steps (slots in one run, no request taken in or finished around them;
    StepEffects covers those) of target-only and static servers: target_ms = the median wall of steps that ran no
    proposer; for steps that did, the median wall per width (drafts verified per request; 0 when no request was
    offered any) and a line in the width: draft_fixed_ms = its intercept over target_ms (the proposer's own cost),
    per_step_ms = its slope (a negative one: flat, as costmodel.fit_sweep). Batch sizes: those with MIN_STEPS clean
    steps without a proposer and at two widths (or one, g >= 1) with it."""
    decode = steps[(steps["kind"] == "decode") & steps["wall_ms"].notna()]
    decode = decode[decode["contiguous"].astype(bool) & (decode["num_intakes"] == 0) & (decode["num_finished_before"] == 0)]
    plain = decode[decode["num_steps"] == 0].groupby("batch_size")["wall_ms"].agg(["median", "size"])
    plain = plain[plain["size"] >= MIN_STEPS]["median"]
    spec = decode[decode["num_steps"] > 0].groupby(["batch_size", "width"])["wall_ms"].agg(["median", "size"])
    spec = spec[spec["size"] >= MIN_STEPS]["median"]
    rows = []
    for bs in sorted(set(plain.index) & set(spec.index.get_level_values(0))):
        at = spec.loc[bs]
        w, t, t0 = at.index.to_numpy(float), at.to_numpy(float), float(plain[bs])
        if len(w) >= 2 and (line := _line_fit(w, t))[1] >= 0:
            fixed, slope = line[0] - t0, line[1]
        elif len(w) >= 2:
            fixed, slope = float(t.mean()) - t0, 0.0
        elif w[0] > 0:  # one width: no fixed cost can be told apart
            fixed, slope = 0.0, max(0.0, float((t[0] - t0) / w[0]))
        else:
            continue
        rows.append((int(bs), t0, float(fixed), float(slope)))
    if not rows:
        raise SpectuneError(f"round logs: no batch size has {MIN_STEPS}+ clean decode steps both without and with drafts")
    bss, target, fixed, per_step = zip(*rows)
    return RoundCost(batch_sizes=bss, target_ms=target, draft_fixed_ms=fixed, per_step_ms=per_step)


def fit_prefill(steps: pd.DataFrame) -> tuple[float, float, float, float]:
    """Prefill wall = fixed + per_token x T + per_token2 x T^2 + per_intake x requests taken in meanwhile (T: padded
    tokens): least squares on the compute of every prefill step (exact even when the engine idled before it), plus
    the median hand-out time after a prefill (wall - compute). A batch of 64 prompts costs more per token than one
    (measured: 0.29 ms per token at 5,000 padded tokens, 0.19 at 300), so a line through both puts the prefills of
    a few requests 10-20% off; the square term is dropped where it, or the per-token term with it, comes out
    negative. The fit is in relative error (weights 1 / the prediction): in plain least squares the few prefills of
    64 prompts (300 ms and more) set the line, and the prefills of 1-3 prompts that make TTFT at small batch sizes
    came out 4% too dear at 1 prompt and 7% too cheap at 3 (3 December 2026). Returns (fixed, per_token, per_token2,
    per_intake)."""
    prefill = steps[steps["kind"] == "prefill"]
    if len(prefill) < 3:
        raise SpectuneError("round logs: fewer than 3 prefill steps logged")
    tokens = prefill["padded_tokens"].to_numpy(float)
    X = np.column_stack([np.ones(len(prefill)), tokens, tokens**2, prefill["num_intakes"]]).astype(float)
    y = prefill["compute_ms"].to_numpy(float)
    columns = [0, 1, 2, 3]  # fixed, per_token, per_token2, per_intake

    def fit() -> dict[int, float]:  # least squares in relative error: weights 1 / the prediction, re-fitted
        A = X[:, columns]
        coef = np.linalg.lstsq(A, y, rcond=None)[0]
        for _ in range(RELATIVE_FIT_ROUNDS):
            scale = np.maximum(A @ coef, 0.1 * float(np.median(y)))
            coef = np.linalg.lstsq(A / scale[:, None], y / scale, rcond=None)[0]
        return dict(zip(columns, coef))

    coef = fit()
    # a negative square term, or a square term that bends the line below 0 per token, then a negative fixed cost,
    # is noise: fit without it
    if coef[2] < 0 or coef[1] < 0:
        columns.remove(2)
        coef = fit()
    if coef[0] < 0:
        columns.remove(0)
        coef = fit()
    post = (prefill["wall_ms"] - prefill["compute_ms"]).dropna()
    fixed = coef.get(0, 0.0) + (post.median() if not post.empty else 0.0)
    return float(fixed), float(coef[1]), float(coef.get(2, 0.0)), max(0.0, float(coef[3]))


def fit_client_side(steps: pd.DataFrame, requests: pd.DataFrame) -> tuple[float, float]:
    """(delivery_ms, stream_end_ms): medians over matched requests of their first and last chunk's arrival at the
    client, and of their stream's end there, after the end of the wall of the step that produced them (the replay's
    step end: the next step's start, or its own end where the engine idled after it)."""
    wall_end = dict(zip(steps["end_s"], steps["next_start_s"].where(steps["wall_ms"].notna(), steps["end_s"])))
    first_end = requests["e_step_ends"].map(lambda e: wall_end.get(e[0], math.nan))
    last_end = requests["e_step_ends"].map(lambda e: wall_end.get(e[-1], math.nan))
    first = requests["chunk_ns"].map(lambda c: c[0]) / 1e9
    last = requests["chunk_ns"].map(lambda c: c[-1]) / 1e9
    delivery = pd.concat([first - first_end, last - last_end]).dropna() * 1000.0
    stream_end = (requests["end_ns"] / 1e9 - last_end).dropna() * 1000.0
    return (float(delivery.median()) if len(delivery) else 0.0, float(stream_end.median()) if len(stream_end) else 0.0)


def fit_intake(steps: pd.DataFrame, requests: pd.DataFrame) -> float:
    """The server's time per request before the engine sees it (HTTP, JSON, tokenizing, one at a time on its event
    loop): the median over matched requests of submitted - max(send, the previous request's submit)."""
    submitted = np.sort(np.concatenate([np.asarray(s, dtype=float) for s in steps.loc[steps["kind"] == "prefill", "submitted_s"]]))
    own = requests["e_submitted_s"].to_numpy(float)
    send = requests["send_ns"].to_numpy(float) / 1e9
    previous = submitted[np.maximum(np.searchsorted(submitted, own) - 1, 0)]
    previous = np.where(previous < own, previous, -np.inf)
    service = (own - np.maximum(send, previous)) * 1000.0
    return float(np.median(service)) if len(service) else 0.0


def round_acceptance(joined: pd.DataFrame, tags: dict[str, str]) -> dict[str, PositionalAcceptance]:
    """Per-position acceptance along the output per request tag (key "" pools all) from the engine's own record of
    every request-round of static speculative servers: how often the proposer drafted at all, and given it did,
    the conditional per-position acceptance (censored at the drafts it offered)."""
    accepted, proposed, asked, positions, groups, request = [], [], [], [], [], []
    for k, row in enumerate(joined.itertuples()):
        if not row.e_num_steps or max(row.e_num_steps) == 0:
            continue
        tokens = np.asarray(row.chunk_tokens, dtype=np.int64)
        accepted.append(np.asarray(row.e_accepted, dtype=np.int64))
        proposed.append(np.asarray(row.e_proposed, dtype=np.int64))
        asked.append(np.asarray(row.e_num_steps, dtype=np.int64))
        positions.append(np.cumsum(tokens)[:-1])  # output tokens before each decode step
        groups.append(np.full(len(row.e_accepted), tags.get(row.prompt, ""), dtype=object))
        request.append(np.full(len(row.e_accepted), k))
    if not accepted:
        raise SpectuneError("round logs: no request-rounds of static speculative servers to fit acceptance on")
    accepted, proposed, asked, positions, groups, request = map(np.concatenate, (accepted, proposed, asked, positions, groups, request))

    def fit(rows: np.ndarray) -> PositionalAcceptance:
        drafted = rows & (proposed > 0)
        conditional = fit_positional_acceptance(accepted[drafted], proposed[drafted], positions[drafted])
        bucket = positions // POSITION_BUCKET_TOKENS
        whole = float((proposed[rows] > 0).mean())
        shares = tuple(float((proposed[rows & (bucket == b)] > 0).mean()) if (rows & (bucket == b)).sum() >= MIN_BUCKET_ROUNDS else whole
                       for b in range(len(conditional.by_bucket)))
        offered = offered_rates(proposed[drafted], asked[drafted])
        profile = PositionalAcceptance(conditional.by_bucket, drafted=shares)
        offsets = [_request_offset(profile, accepted[m], proposed[m], positions[m]) for i in np.unique(request[drafted])
                   if (m := drafted & (request == i)).sum() >= MIN_REQUEST_ROUNDS]
        return PositionalAcceptance(conditional.by_bucket, drafted=shares, request_offsets=tuple(o for o in offsets if math.isfinite(o)),
                                    offered=offered)

    profiles = {g: fit(groups == g) for g in set(groups) if g}
    profiles[""] = fit(np.ones(len(groups), dtype=bool))
    return profiles


MIN_REQUEST_ROUNDS = 4  # drafted rounds below which a request's own acceptance is not estimated


def offered_rates(proposed: np.ndarray, asked: np.ndarray, min_rounds: int = MIN_BUCKET_ROUNDS) -> tuple[float, ...]:
    """From drafting request-rounds (drafts the proposer offered, step count the round asked for): for k = 2, 3, ...,
    the share of rounds that asked for k or more and were offered k - 1 or more in which it offered k or more, up to
    the largest k with min_rounds such rounds. Empty when every round was offered all it asked for (an EAGLE
    head, a draft model): the replay then offers g."""
    if (proposed >= asked).all():
        return ()
    rates = []
    for k in range(2, int(asked.max(initial=0)) + 1):
        at_risk = (asked >= k) & (proposed >= k - 1)
        if at_risk.sum() < min_rounds:
            break
        rates.append(float((proposed[at_risk] >= k).mean()))
    return tuple(rates)


def _request_offset(profile: PositionalAcceptance, accepted: np.ndarray, proposed: np.ndarray, positions: np.ndarray) -> float:
    """How much easier one request was to draft for than its group: the shift theta of every conditional rate in
    log-odds that makes its expected accepted drafts (over its own rounds, positions and offered drafts) match what it
    accepted. Requests of one kind differ (one passage is copied word for word, another is not), and that spread
    decides how far apart requests finish."""
    horizon = int(proposed.max())
    base = np.clip(profile.rate_matrix(int(positions.max()) + 1, horizon)[positions], 1e-4, 1 - 1e-4)  # [R, H]
    logit = np.log(base / (1 - base))
    offered = np.arange(horizon)[None, :] < proposed[:, None]  # [R, H]
    target = accepted.sum()
    expected = lambda theta: float((np.cumprod(1 / (1 + np.exp(-(logit + theta))), axis=1) * offered).sum())
    lo, hi = -12.0, 12.0
    if target <= expected(lo):
        return lo
    if target >= expected(hi):
        return hi
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected(mid) < target else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True, slots=True, eq=False)
class Calibration:
    """The replay's terms fitted from a sweep's step clocks, and what they were fitted on."""

    cost: ServingCost
    profiles: dict[str, PositionalAcceptance]  # per request tag; "" pools all
    cells_used: int
    cells_left_out: int  # measured while other work loaded the machine
    requests_matched: int
    requests_unmatched: int


def calibrate(run, engine: str, method: str) -> Calibration:
    """Fit the replay's serving cost and acceptance from a closed-loop sweep of target-only and static `method`
    servers on the embedded engine, from quiet cells only (quiet_cells)."""
    cells, quiet, steps, joined, unmatched = _joined(run, engine, method, with_target=True)
    prefill_fixed, per_token, per_token2, prefill_intake = fit_prefill(steps)
    decode = fit_step_costs(steps)
    effects = fit_step_effects(steps, decode)
    delivery, stream_end = fit_client_side(steps, joined)
    cost = ServingCost(decode=decode, prefill_fixed_ms=prefill_fixed, prefill_per_token_ms=per_token,
                       prefill_per_token2_ms=per_token2,
                       request_overhead_ms=max(MIN_REQUEST_OVERHEAD_MS, fit_intake(steps, joined)), source="step clocks",
                       gather_ms_per_seq=effects.gather_ms_per_seq, intake_interference_ms=effects.intake_ms,
                       prefill_intake_ms=prefill_intake, finish_ms=effects.finish_ms, delivery_ms=delivery, stream_end_ms=stream_end)
    return Calibration(cost=cost, profiles=_tag_acceptance(run, joined), cells_used=len(quiet),
                       cells_left_out=len(cells[cells["status"] == "ok"]) - len(quiet), requests_matched=len(joined),
                       requests_unmatched=unmatched)


def served_acceptance(run, engine: str, method: str) -> dict[str, PositionalAcceptance]:
    """Acceptance per request tag ("" pools all) of a run's static `method` servers alone, from their quiet cells:
    measured on the prompts to be served, it stands in for the acceptance a sweep measured on other prompts (a
    tag's acceptance does not carry over to other prompts of the tag; benchmarks/README.md, issue 13)."""
    return _tag_acceptance(run, _joined(run, engine, method, with_target=False)[3])


def _joined(run, engine: str, method: str, with_target: bool):
    """The run's static `method` (and with_target: target-only) cells, the quiet ones, their engine steps within
    the cells' windows, and their requests joined with the engine's record of them (steplog.join_requests)."""
    cells = run.cells[(run.cells["engine"] == engine) & run.cells["adaptive_config"].isna()]
    spec = cells["is_speculative"].astype(bool) & (cells["method"] == method) & (cells["num_speculative_tokens"] > 0)
    cells = cells[spec | (~cells["is_speculative"].astype(bool) & with_target)]
    quiet = quiet_cells(cells)
    servers = sorted(set(quiet["server"]) & set(run.round_logs))
    if not servers:
        if with_target:
            raise SpectuneError(f"{run.root}: no round logs of target-only or static {method} servers on the {engine} engine")
        raise SpectuneError(f"{run.root}: no round logs of static {method} servers on the {engine} engine; sweep static "
                            f"{method} servers (num_speculative_tokens = [...]) on the prompts to be served")
    all_steps, joined, unmatched = [], [], 0
    for server in servers:
        steps = step_frame(run.round_logs[server]).assign(server=server)
        mine = quiet[quiet["server"] == server]
        windows = cell_windows(run.requests, mine["cell"])
        all_steps.append(steps[in_windows(steps["start_s"], windows)])
        engine_rows = engine_requests(steps)
        for cell in mine["cell"]:
            j = join_requests(run.requests[run.requests["cell"] == cell], engine_rows)
            unmatched += j.attrs["unmatched"]
            joined.append(j)
    return cells, quiet, pd.concat(all_steps, ignore_index=True), pd.concat(joined, ignore_index=True), unmatched


def _tag_acceptance(run, joined: pd.DataFrame) -> dict[str, PositionalAcceptance]:
    from spectune.scoring import _prompt_key
    from spectune.workload import load_requests

    tags = {_prompt_key(r): r.tag for r in load_requests(run.manifest["plan"]["workload"])}
    return round_acceptance(joined[joined["e_num_steps"].map(lambda s: bool(s) and max(s) > 0)], tags)


# --- the replay beside a measured run ------------------------------------------------------------------------------

FIGURES = {"ttft_ms": "ttft_ms_mean", "tpot_ms": "tpot_ms_mean", "e2e_ms": "e2e_ms_mean"}


def server_policy(cell: pd.Series, method: str):
    """The step policy a measured server ran (None: a method other than the fitted one)."""
    from spectune.adaptive import AdaptiveConfig
    from spectune.emit import sglang_launch_steps
    from spectune.simulate import AdaptiveConfigPolicy, StaticPolicy

    if not cell["is_speculative"]:
        return StaticPolicy(0)
    if cell["method"] != method:
        return None
    if isinstance(cell.get("adaptive_config"), str):
        cfg = AdaptiveConfig.from_file(cell["adaptive_config"])
        return AdaptiveConfigPolicy(cfg, initial_steps=sglang_launch_steps(cfg), cuda_graph_bs=(), name=cell["server"])
    return StaticPolicy(int(cell["num_speculative_tokens"]))


def replay_vs_measured(fit_run, measured_runs: list, calibrated: bool, method: str | None = None, draws: int = 3,
                       seed: int = 0, acceptance_run=None) -> pd.DataFrame:
    """Per measured server (over every run given, e.g. confirm passes: their mean) the replay's predicted mean TTFT,
    TPOT and e2e next to the measured ones, with the replay fitted on fit_run (calibrated: from step clocks; else the
    older fit from round-log gaps and streamed chunks). The measured runs' traffic (workload, schedule, cap) is
    replayed: on its arrival times, or a closed loop's cell as it sent its requests (scoring.ClosedLoop).
    acceptance_run: take the acceptance per tag from this run's static servers instead (a diagnostic: static servers
    measured on the replayed traffic give its own prompts' acceptance, which a replay of new prompts cannot know)."""
    from spectune import scoring
    from spectune.costmodel import fit_sweep
    from spectune.simulate import draw_acceptance

    fit = fit_sweep(fit_run.cells, method=method)
    horizon = max(fit.max_steps, 7)
    own = None if acceptance_run is None else served_acceptance(acceptance_run, fit.engine, fit.method)
    cells = pd.concat([r.cells.assign(run=i) for i, r in enumerate(measured_runs)], ignore_index=True)
    cells = cells[cells["status"] == "ok"]
    rows = []
    for (workload, cap), group in cells.groupby(["workload", "batch_size"]):
        loop = closed_loop_of(measured_runs[int(group["run"].iloc[0])], group.iloc[0])
        replay = scoring.make_replay(fit_run, fit, horizon, seed, workload, int(cap), calibrated, loop, acceptance=own)
        all_draws = [draw_acceptance(replay.traffic, replay.profiles, horizon, seed + k) for k in range(draws)]
        for server, mine in group.groupby("server"):
            policy = server_policy(mine.iloc[0], fit.method)
            if policy is None:
                continue
            from spectune.simulate import simulate_requests

            sims = [simulate_requests(replay.traffic, policy, replay.cost, d, max_num_seqs=replay.max_num_seqs) for d in all_draws]
            row = {"workload": workload, "max_concurrency": int(cap), "server": server, "passes": len(mine)}
            for name, column in FIGURES.items():
                predicted = float(np.mean([replayed_figure(s, name, closed=loop is not None) for s in sims]))
                measured = float(mine[column].mean())
                row |= {f"{name}_predicted": predicted, f"{name}_measured": measured, f"{name}_error": predicted / measured - 1.0,
                        f"{name}_measured_sd": float(mine[column].std(ddof=1)) if len(mine) > 1 else math.nan}
            rows.append(row)
    return pd.DataFrame(rows)


def replayed_figure(sim, name: str, closed: bool) -> float:
    """A replay's mean TTFT, TPOT or e2e (FIGURES) as spectune.analysis measures it: in a closed loop a request's
    clock starts when it is sent (all of its traffic "arrives" at 0 and waits for a slot), else at its arrival."""
    if closed and name in ("ttft_ms", "e2e_ms"):
        return float(sim.requests[name.replace("_ms", "_from_send_ms")].mean())
    return float(getattr(sim, name))


def closed_loop_of(run, cell: pd.Series):
    """What a closed-loop cell of `run` sent (scoring.ClosedLoop), or None for traffic on its arrival times."""
    from spectune.plan import plan_from_dict
    from spectune.scoring import ClosedLoop

    if cell.get("schedule") != "closed":
        return None
    plan = plan_from_dict(run.manifest["plan"])
    return ClosedLoop(num_prompts=plan.num_prompts(int(cell["batch_size"])), max_tokens=plan.max_tokens, seed=plan.seed)


def predicted_walls(steps: pd.DataFrame, cost: ServingCost) -> np.ndarray:
    """What the replay charges for each logged step (step_frame rows) as the engine ran it: its batch, width, slots,
    intakes and finishes. Beside the measured walls it says how fast the engine ran (speed_index)."""
    decode = (steps["kind"] == "decode").to_numpy()
    bs = steps["batch_size"].to_numpy(float)
    step = clean_walls(steps, cost.decode)
    step += np.where(steps["contiguous"].to_numpy(bool), 0.0, cost.gather_ms_per_seq * bs)
    step += cost.intake_interference_ms * steps["num_intakes"].to_numpy(float) + cost.finish_ms * steps["num_finished_before"].to_numpy(float)
    prefill = np.array([cost.t_prefill(p) if p else np.nan for p in steps["prompt_tokens"]])
    prefill += cost.prefill_intake_ms * steps["num_intakes"].to_numpy(float)
    return np.where(decode, step, prefill)


def speed_index(run, cost: ServingCost) -> pd.Series:
    """Per cell of a run (index: cell id): the median over its steps of measured wall / predicted wall. About 1 on a
    quiet machine; well above 1 when something else slowed the engine down (other work, a noisy neighbour of the
    virtual machine), whatever policy the server ran, since each step is predicted as it was taken."""
    out = {}
    for server, path in run.round_logs.items():
        steps = step_frame(path)
        steps = steps[steps["wall_ms"].notna()]
        ratio = steps["wall_ms"].to_numpy(float) / predicted_walls(steps, cost)
        for cell in run.cells.loc[run.cells["server"] == server, "cell"]:
            inside = in_windows(steps["start_s"], cell_windows(run.requests, pd.Series([cell]))).to_numpy()
            out[cell] = float(np.nanmedian(ratio[inside])) if inside.any() else math.nan
    return pd.Series(out, dtype=float)
