"""The request-level replay against the embedded engine, per server, before and after calibration, on traffic the
replay was not fitted on.

    python benchmarks/calibration.py RESULTS [--traffic heldout] [--passes 2] [--measure] [--out DIR] [--passes-dir DIR]
        [--at-own-speed] [--batch-sizes 4] [--bracket] [--acceptance-from RUN] [--tuned DIR]

RESULTS is a closed-loop sweep tuned by `spectune tune` on a replay objective (its tuned/ holds the tuned config).
With --measure, the four servers `spectune confirm` runs (target-only, the best static g, the tuned config, SGLang's
default config) are run on the traffic (a workload with arrival_s), `--passes` times with the server order rotated,
into DIR/<traffic>/pass-NN (resumable: finished passes are kept); with --batch-sizes, in a closed loop at those batch
sizes instead (the whole set per cell, into DIR/<traffic>-closed-<sizes>; --at-own-speed reads the first only). Then every measured run under DIR/<traffic> is
replayed (or those of --passes-dir, e.g. a `spectune confirm` directory) with the replay fitted on RESULTS two ways:
- before: the fit of spectune 0.x before calibration (step costs from round-log gaps at the swept batch sizes, a
  decode step charged its policy's g whatever was drafted, acceptance from the streamed chunks);
- after: spectune.calibration (step clocks, verify width, the engine's own request-rounds with the drafted share).
With --acceptance-from RUN (static servers measured on the passes' traffic), also the replay with RUN's acceptance
per tag: the passes' own prompts', for which the fit's prompts of the same tag stand in otherwise (a diagnostic: a
replay of new prompts cannot know it).
With --bracket, target-only also runs between the other servers of each pass (T A T B T C T, the copies named
target-at-N; into DIR/<traffic>...-bracket), so the host's speed is measured on the baseline right before and after
every server's cell; --at-own-speed then also replays each server at the mean of those two speeds (a slowdown of a
minute falls on a server's cell and on the baseline cells beside it alike, where one target-only cell per pass can
miss it).
With --at-own-speed, also each server replayed pass by pass on a host as fast as target-only's engine ran in that
pass (decode and prefill costs each times its cells' measured step wall / the wall the replay charges for those very
steps, of that kind): the
host's speed of the moment, measured on the baseline alone, so still a prediction for every other server; then each
server at the median speed of the pass's other speculative servers (also a prediction: its own steps are not used;
on a slowed host target-only's steps slowed more than the speculative servers'); then each server at the speed its
own engine ran in that cell: what the replay leaves out besides the host's speed, a
diagnostic only (the speed is known after the fact); and the accepted
drafts per request-round at each step count, replay vs engine, with how many drafts the engine's proposer offered.
Passes spectune confirm would not count (other work on the machine, or the engine more than 15% slower than in the
same server's median pass) are left out and listed. Prints predicted vs measured mean TTFT, TPOT and e2e per server
and the relative errors, and each measured mean's standard error over the counted passes; writes DIR/<traffic>.json.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from spectune import scoring
from spectune.calibration import FIGURES, closed_loop_of, predicted_walls, replay_vs_measured, replayed_figure, server_policy
from spectune.costmodel import ServingCost, fit_sweep
from spectune.errors import SpectuneError
from spectune.simulate import draw_acceptance, simulate_requests
from spectune.steplog import step_frame
from spectune.confirm import TARGET, confirm_plan, pass_complete, pass_plan, pass_table, plan_servers, read_tuning, step_cost
from spectune.plan import plan_from_dict
from spectune.store import load_run
from spectune.sweep import run_sweep


BRACKET = "target-at-"  # --bracket: the extra target-only servers run between the others in each pass
PREFILL_TERMS = ("prefill_fixed_ms", "prefill_per_token_ms", "prefill_per_token2_ms", "prefill_intake_ms")
DECODE_TERMS = ("request_overhead_ms", "gather_ms_per_seq", "intake_interference_ms", "finish_ms", "delivery_ms", "stream_end_ms")


def scaled(cost: ServingCost, k: float, k_prefill: float | None = None) -> ServingCost:
    """`cost` on a host k times slower at decode steps (and what the interpreter does between them: intake, hand-out)
    and k_prefill times slower at prefill steps (default: k too)."""
    d = cost.decode
    decode = replace(d, target_ms=tuple(k * t for t in d.target_ms), draft_fixed_ms=tuple(k * t for t in d.draft_fixed_ms),
                     per_step_ms=tuple(k * t for t in d.per_step_ms), request_ms=tuple(k * t for t in d.request_ms))
    k_prefill = k if k_prefill is None else k_prefill
    return replace(cost, decode=decode, **{t: k * getattr(cost, t) for t in DECODE_TERMS},
                   **{t: k_prefill * getattr(cost, t) for t in PREFILL_TERMS})


def speeds_of(steps: pd.DataFrame, cost: ServingCost) -> tuple[float, float]:
    """(decode, prefill): measured step wall over the wall the replay charges for those very steps, per kind. A busy
    host slows the two apart (measured: decode steps 1.1-1.6x the fit's cost while prefills stayed at 0.9-1.2x), so one
    figure for both overcharges the prefills and with them TTFT."""
    predicted = predicted_walls(steps, cost)
    decode = (steps["kind"] == "decode").to_numpy()
    walls = steps["wall_ms"].to_numpy(float)
    k = float(walls[decode].sum() / np.nansum(predicted[decode]))
    k_prefill = float(walls[~decode].sum() / np.nansum(predicted[~decode])) if (~decode).any() else k
    return k, k_prefill


def is_baseline(server: str) -> bool:
    return server == TARGET or server.startswith(BRACKET)


def bracket_speed(run, server: str, cost: ServingCost) -> tuple[float, float]:
    """The mean speed (speeds_of) of the target-only cells run just before and just after `server`'s cell in a
    bracketed pass (its own, for a target-only cell, not counted): the host's speed at that moment from the baseline."""
    first = {s: float(step_frame(log)["start_s"].min()) for s, log in run.round_logs.items()}
    mine = first[server]
    before = [s for s, t in first.items() if is_baseline(s) and s != server and t < mine]
    after = [s for s, t in first.items() if is_baseline(s) and s != server and t > mine]
    near = [max(before, key=first.get)] if before else []
    near += [min(after, key=first.get)] if after else []
    speeds = [speeds_of(valid_steps(run, s), cost) for s in near]
    return float(np.mean([k for k, _ in speeds])), float(np.mean([kp for _, kp in speeds]))


def others_speed(run, server: str, cost: ServingCost) -> tuple[float, float]:
    """The median speed (speeds_of) of the pass's speculative servers other than `server`: the host's speed of the
    moment measured on work like a speculative server's (target-only's own steps slowed more than theirs on a slow
    host: benchmarks/README.md), still a prediction for `server`, whose own step walls are not used."""
    others = [s for s in run.round_logs if s != server and not is_baseline(s)] or [TARGET]  # none: the baseline's
    speeds = [speeds_of(valid_steps(run, s), cost) for s in others]
    return float(np.median([k for k, _ in speeds])), float(np.median([kp for _, kp in speeds]))


def valid_steps(run, server: str) -> pd.DataFrame:
    steps = step_frame(run.round_logs[server])
    return steps[steps["wall_ms"].notna()]


def at_own_speed(fit_run, runs: list, method: str, draws: int, speed_of: str | None = None) -> pd.DataFrame:
    """Per server: the replay of each pass at the speed its engine ran in that cell (speed_of: at the speed the named
    server's engine ran in that pass instead, e.g. target-only's; "bracket": at the speed of the target-only cells
    just before and after it, bracket_speed; "others": at the median speed of the pass's other speculative servers,
    others_speed), beside the measured means."""
    fit = fit_sweep(fit_run.cells, method=method)
    horizon = max(fit.max_steps, 7)
    first = runs[0].cells
    loop = closed_loop_of(runs[0], first.iloc[0])
    replay = scoring.make_replay(fit_run, fit, horizon, 0, first["workload"].iloc[0], int(first["batch_size"].iloc[0]), True, loop)
    acceptance = [draw_acceptance(replay.traffic, replay.profiles, horizon, k) for k in range(draws)]
    rows = []
    for server in sorted(s for s in first["server"] if not s.startswith(BRACKET)):
        policy = server_policy(first[first["server"] == server].iloc[0], method)
        if policy is None:
            continue
        predicted, measured, speeds = [], [], []
        for run in runs:
            if speed_of == "bracket":
                k, k_prefill = bracket_speed(run, server, replay.cost)
            elif speed_of == "others":
                k, k_prefill = others_speed(run, server, replay.cost)
            else:
                k, k_prefill = speeds_of(valid_steps(run, speed_of or server), replay.cost)
            sims = [simulate_requests(replay.traffic, policy, scaled(replay.cost, k, k_prefill), a, max_num_seqs=replay.max_num_seqs)
                    for a in acceptance]
            predicted.append({f: np.mean([replayed_figure(x, f, closed=loop is not None) for x in sims]) for f in FIGURES})
            measured.append(run.cells[run.cells["server"] == server].iloc[0])
            speeds.append((k, k_prefill))
        row = {"server": server, "speeds": " / ".join(f"{k:.2f} ({kp:.2f})" for k, kp in speeds)}
        for f, column in FIGURES.items():
            m = float(np.mean([c[column] for c in measured]))
            row |= {f"{f}_measured": m, f"{f}_predicted": float(np.mean([p[f] for p in predicted])),
                    f"{f}_error": float(np.mean([p[f] for p in predicted])) / m - 1.0}
        rows.append(row)
    return pd.DataFrame(rows)


def accepted_per_round(fit_run, runs: list, method: str, draws: int = 3) -> pd.DataFrame:
    """Per server and step count g of a round: mean accepted drafts per request-round in the replay (at the fit's
    speed) and in the engine (its round logs, over the passes), and in the engine's drafting rounds how many drafts
    the proposer offered (the replay offers g whenever a round drafts)."""
    fit = fit_sweep(fit_run.cells, method=method)
    horizon = max(fit.max_steps, 7)
    first = runs[0].cells
    replay = scoring.make_replay(fit_run, fit, horizon, 0, first["workload"].iloc[0], int(first["batch_size"].iloc[0]), True,
                                 closed_loop_of(runs[0], first.iloc[0]))
    rows = []
    for server in sorted(first["server"]):
        policy = server_policy(first[first["server"] == server].iloc[0], method)
        if policy is None:
            continue
        replayed: dict[int, list[int]] = {}
        for k in range(draws):
            sim = simulate_requests(replay.traffic, policy, replay.cost, draw_acceptance(replay.traffic, replay.profiles, horizon, k),
                                    max_num_seqs=replay.max_num_seqs)
            for step in sim.steps[(sim.steps["kind"] == "decode") & (sim.steps["steps"] > 0)].itertuples():
                replayed.setdefault(int(step.steps), []).extend(min(a, int(step.steps)) for a in step.at_horizon)
        engine = pd.concat([step_frame(run.round_logs[server]) for run in runs])
        engine = engine[(engine["kind"] == "decode") & (engine["num_steps"] > 0)]
        for g, steps in engine.groupby("num_steps"):
            offered = np.concatenate([np.asarray(x) for x in steps["proposed"]])
            accepted = np.concatenate([np.asarray(x) for x in steps["accepted"]])
            drafted = offered > 0
            rows.append({"server": server, "g": int(g), "replay_accepted": float(np.mean(replayed.get(int(g), [np.nan]))),
                         "engine_accepted": float(accepted.mean()), "engine_offered_when_drafting": float(offered[drafted].mean()),
                         "engine_full_g_offered_share": float((offered[drafted] == g).mean())})
    return pd.DataFrame(rows)


def bracketed(servers: list[dict], index: int) -> list[dict]:
    """Pass `index`'s order with target-only before each other server and after the last (T A T B T C T): the host's
    speed measured on the baseline right around every server's cell."""
    target = next(s for s in servers if s["name"] == TARGET)
    order = [target]
    for j, server in enumerate(plan_servers([s for s in servers if s["name"] != TARGET], index)):
        order += [server, {**target, "name": f"{BRACKET}{j + 1}"}]
    return order


def measure(results: Path, traffic: str, out: Path, passes: int, batch_sizes: list[int] | None, bracket: bool = False,
            tuned: Path | None = None) -> None:
    tuned = tuned or results / "tuned"
    servers, raw = confirm_plan(load_run(results).manifest, read_tuning(tuned), tuned, out, None)
    from spectune.workload import load_requests

    raw |= {"workload": traffic, "min_prompts": len(load_requests(traffic))}
    if batch_sizes:  # a closed loop at batch sizes of one's choice (tuned on a closed-loop objective)
        raw |= {"schedule": "closed", "batch_sizes": batch_sizes}
    for i in range(passes):
        pass_dir = out / f"pass-{i + 1:02d}"
        if not pass_complete(pass_dir):
            plan = (plan_from_dict({**raw, "servers": bracketed(servers, i)}, source=f"bracketed pass {i + 1}") if bracket
                    else pass_plan(raw, servers, i))
            outcome = run_sweep(plan, pass_dir, resume=(pass_dir / "run.json").exists())
            if outcome.interrupted or outcome.failed:
                raise SystemExit(f"{pass_dir}: interrupted or failed; run again to resume")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--traffic", default="heldout")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--measure", action="store_true")
    parser.add_argument("--out", type=Path, help="default: RESULTS/calibration")
    parser.add_argument("--draws", type=int, default=5)
    parser.add_argument("--at-own-speed", action="store_true", help="also replay each cell at its engine's own measured speed")
    parser.add_argument("--passes-dir", type=Path, help="replay the passes of this directory (e.g. RESULTS/confirm) instead")
    parser.add_argument("--batch-sizes", help="with --measure: a closed loop at these batch sizes (e.g. 4,16) instead of the "
                        "traffic's arrival times; the whole set each cell")
    parser.add_argument("--tuned", type=Path, help="the tune output to measure / that the passes measured; default: RESULTS/tuned")
    parser.add_argument("--acceptance-from", type=Path, help="also replay with the acceptance of this run's static "
                        "servers (measured on the passes' traffic: its own prompts' acceptance, which the fit's prompts "
                        "stand in for)")
    parser.add_argument("--bracket", action="store_true", help="with --measure: target-only also runs between the other "
                        "servers in each pass (T A T B T C T; into DIR/<traffic>...-bracket), and the replay is also run at "
                        "the speed of the target-only cells just before and after each server")
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else None
    name = Path(args.traffic).stem + (f"-closed-{'-'.join(map(str, batch_sizes))}" if batch_sizes else "") + ("-bracket" if args.bracket else "")
    out = args.passes_dir or (args.out or args.results / "calibration") / name
    if args.measure:
        measure(args.results, args.traffic, out, args.passes, batch_sizes, args.bracket, args.tuned)
    passes = sorted(p for p in out.glob("pass-*") if pass_complete(p))
    if not passes:
        raise SystemExit(f"{out}: no measured passes; run with --measure")
    fit_run = load_run(args.results)
    tuning = read_tuning(args.tuned or args.results / "tuned")
    method = tuning["method"]
    # The rule spectune confirm counts passes by: none with other work on the machine, none where the engine ran
    # more than 15% slower than in the same server's median pass (a constant error of the replay cancels there).
    table = pass_table(out, len(passes), "e2e_ms_mean", 0.3, step_cost(fit_run, tuning), 0.15)
    disturbed = sorted(int(p) for p in table.loc[table["disturbed"], "pass"].unique())
    runs = [load_run(p) for p in passes if int(p.name.split("-")[1]) not in disturbed]
    print(f"{len(passes)} passes measured; not counted (disturbed): {disturbed or 'none'}")
    print(table.pivot_table(index="pass", columns="server", values="speed_index").round(2).to_string())
    if not runs:
        raise SystemExit(f"{out}: every measured pass was disturbed, nothing to compare; measure more on a quieter "
                         f"machine: --measure --passes {len(passes) + 3}")
    tables = {}
    for label, calibrated in (("before", False), ("after", True)):
        table = replay_vs_measured(fit_run, runs, calibrated=calibrated, method=method, draws=args.draws)
        tables[label] = table[~table["server"].str.startswith(BRACKET)].reset_index(drop=True)
    if args.acceptance_from:
        try:
            table = replay_vs_measured(fit_run, runs, calibrated=True, method=method, draws=args.draws,
                                       acceptance_run=load_run(args.acceptance_from))
        except SpectuneError as e:
            raise SystemExit(f"--acceptance-from: {e}; give a run of static {method} servers "
                             "with round logs, measured on the passes' workload")
        source = f"{args.acceptance_from.parent.name}/{args.acceptance_from.name}"
        tables[f"after, with the acceptance of {source}'s prompts"] = table[~table["server"].str.startswith(BRACKET)].reset_index(drop=True)
    if args.at_own_speed:
        # the host's speed of the moment, from target-only alone: a prediction for the other servers (their own step
        # walls are not used), where each one's own speed is known only after the fact
        tables["after, each pass at the speed target-only ran in it"] = at_own_speed(fit_run, runs, method, args.draws, "target")
        if any(s.startswith(BRACKET) for s in runs[0].cells["server"]):
            tables["after, each cell at the speed of the target-only cells just before and after it"] = at_own_speed(
                fit_run, runs, method, args.draws, "bracket")
        tables["after, each cell at the median speed of the pass's other speculative servers"] = at_own_speed(
            fit_run, runs, method, args.draws, "others")
        tables["after, each cell at its own speed"] = at_own_speed(fit_run, runs, method, args.draws)
        accepted = accepted_per_round(fit_run, runs, method)
        print("\naccepted drafts per request-round by the round's step count g, replay (calibrated) vs engine:")
        print(accepted.to_string(index=False, float_format="%.2f"))
    pd.set_option("display.width", 220)
    for label, table in tables.items():
        print(f"\n{label}{'' if ',' in label else ' calibration'}: replay fitted on {args.results.name}, traffic {runs[0].manifest['plan']['workload']} ({len(runs)} measured passes)")
        cols = ["server"] + [f"{m}_{k}" for m in ("ttft_ms", "tpot_ms", "e2e_ms") for k in ("measured", "predicted", "error")]
        print(table[cols].to_string(index=False, float_format="%.3f"))
        if "speeds" in table:
            print("speeds (measured step wall / the replay's, per pass: decode (prefill)): " + "; ".join(f"{r.server} {r.speeds}" for r in table.itertuples()))
    print(f"\nstandard error of each measured mean over the {len(runs)} counted passes, % of the mean (a replay error "
          f"within about twice it cannot be told from the measurement's):")
    after = tables["after"]  # replay_vs_measured keeps each measured mean's SD over the passes
    se = after[["server"]].assign(**{f"{f}_se_pct": 100 * after[f"{f}_measured_sd"] / np.sqrt(after["passes"]) / after[f"{f}_measured"]
                                     for f in FIGURES})
    print(se.to_string(index=False, float_format="%.1f") if len(runs) > 1 else "  not known: one counted pass")
    foreign = pd.concat([r.cells for r in runs])["foreign_cpu_cores"]
    print(f"\nother work on the machine during the counted cells: mean {foreign.mean():.2f} cores, max {foreign.max():.2f}")
    record = {k: t.to_dict("records") for k, t in tables.items()} | {"passes": len(passes), "not_counted": disturbed}
    (out.parent / f"{out.name}.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
