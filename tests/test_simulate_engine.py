"""The request-level replay against the real embedded engine: fit from a tiny closed-loop sweep, replay a short
trace (quiet single requests, then a burst), and compare with what the engine measured on that same trace (each
request's median over three runs of it).

Behaviour with stated tolerances, not timing targets (this machine is shared, so costs drift between the fit and
the measurement): the burst's TTFT is predicted far above the quiet requests' TTFT, as measured; n-gram
speculation is predicted to shorten e2e on this quote traffic, as measured, with the predicted e2e ratio
(n-gram / target-only) within 0.25 of the measured one; every predicted mean TTFT and e2e is within a factor of 2
of the measured one. Seen here (2 cores shared with other work): ratios 0.62-0.75 measured, 0.64-0.66 predicted,
and once 0.90 predicted for 0.66 measured, while other tests were running on the machine."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from spectune.scoring import make_bench, request_phases
from spectune.simulate import StaticPolicy, survival_by_steps
from spectune.tune import TuneOptions, load_results, tune
from spectune.workload import load_requests
from sweep_helpers import sweep_cmd

NUM_QUIET, BURST = 8, 8
QUIET_GAP_S, BURST_AT_S = 0.25, 2.2
MAX_TOKENS, G = 48, 4  # long enough that quotes are mostly past their unmatched opening
TRACE_REPEATS = 3  # the per-request median over 3 runs of the trace survives one disturbed run (CI: one burst's prefill took 2x)

CLOSED_PLAN = """
name = "replay-fit"
workload = "{workload}"
batch_sizes = [1, {burst}]
repeats = 1
max_tokens = {max_tokens}
prompts_per_slot = 1
min_prompts = {n}
warmup_per_slot = 1
interleave = true  # both servers up at once, cells side by side: host drift falls on both alike

[[servers]]
name = "target"

[[servers]]
name = "ngram"
method = "ngram"
num_speculative_tokens = [1, {g}]
prompt_lookup_min = 1
prompt_lookup_max = 4
"""

TRACE_PLAN = """
name = "replay-trace"
workload = "{workload}"
schedule = "trace"
batch_sizes = [{burst}]
repeats = {trace_repeats}
max_tokens = {max_tokens}
prompts_per_slot = 1
min_prompts = {n}
warmup_per_slot = 0
interleave = true

[[servers]]
name = "target"

[[servers]]
name = "ngram"
method = "ngram"
num_speculative_tokens = {g}
prompt_lookup_min = 1
prompt_lookup_max = 4
"""


def run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(workload file, closed-loop sweep, trace sweep), measured back to back."""
    root = tmp_path_factory.mktemp("replay")
    quotes = load_requests("quote", num_prompts=NUM_QUIET + BURST)
    arrivals = [i * QUIET_GAP_S for i in range(NUM_QUIET)] + [BURST_AT_S] * BURST
    workload = root / "quiet-then-burst.jsonl"
    workload.write_text("".join(json.dumps({"prompt": r.prompt, "max_tokens": MAX_TOKENS, "arrival_s": a, "tag": "quote"}) + "\n"
                                for r, a in zip(quotes, arrivals)))
    fields = dict(workload=workload, burst=BURST, max_tokens=MAX_TOKENS, n=NUM_QUIET + BURST, g=G, trace_repeats=TRACE_REPEATS)
    dirs = []
    for name, plan in (("closed", CLOSED_PLAN), ("trace", TRACE_PLAN)):
        (root / name).mkdir()
        path = root / name / "plan.toml"
        path.write_text(plan.format(**fields))
        run(sweep_cmd(str(path), "--out", str(root / name / "run")))
        dirs.append(root / name / "run")
    return workload, dirs[0], dirs[1]


def measured(trace_run: Path, server: str) -> pd.DataFrame:
    """Each request's TTFT and e2e, the median over the trace's repeats (a disturbance slows a run, never speeds it)."""
    requests = pd.read_parquet(trace_run / "requests.parquet")
    requests = requests[requests["cell"].str.startswith(f"{server}__")]
    assert requests["error"].isna().all() and len(requests) == (NUM_QUIET + BURST) * TRACE_REPEATS
    assert requests.groupby("index")["cell"].nunique().eq(TRACE_REPEATS).all()
    return requests.groupby("index")[["ttft_ms", "e2e_ms"]].median().sort_index().reset_index(drop=True)


def test_replay_predicts_what_the_engine_measures_on_a_replayed_trace(sweeps):
    workload, closed, trace = sweeps
    bench = make_bench(load_results(closed), "e2e", seed=0, method="ngram", traffic=str(workload), max_concurrency=BURST)
    assert bench.replay.traffic.num_requests == NUM_QUIET + BURST and bench.replay.max_num_seqs == BURST
    quiet, burst = slice(0, NUM_QUIET), slice(NUM_QUIET, None)
    figures = {}
    for server, policy in (("target", StaticPolicy(0)), ("ngram", StaticPolicy(G))):
        sim = pd.concat([r.requests for r in bench.replay.run(policy).values()])
        sim["index"] = list(range(NUM_QUIET + BURST)) * len(bench.replay.draws)
        sim = sim.groupby("index")[["ttft_ms", "e2e_ms"]].mean()
        real = measured(trace, server)
        figures[server] = {"sim": sim, "real": real}
        # Load: the burst waits for a prefill of 8 prompts (and the first of them); quiet requests for their own.
        for frame in (sim, real):
            assert frame["ttft_ms"].iloc[burst].mean() > 2.5 * frame["ttft_ms"].iloc[quiet].mean(), (server, frame["ttft_ms"].tolist())
        # Magnitude: within a factor of 2, request-averaged.
        for metric in ("ttft_ms", "e2e_ms"):
            ratio = sim[metric].mean() / real[metric].mean()
            assert 0.5 < ratio < 2.0, (server, metric, sim[metric].mean(), real[metric].mean())
    ratio = {kind: figures["ngram"][kind]["e2e_ms"].mean() / figures["target"][kind]["e2e_ms"].mean() for kind in ("sim", "real")}
    # One measured cell per server: on a shared 2-core host each cell's e2e moves ~6%, their ratio ~8.5%. The replay
    # puts it near 0.8, so "below 0.9" failed about one run in ten (CI: 0.93); below 1 (2.4 SDs) is what the check
    # below needs: n-gram ahead at all, and the replay's ratio within 0.25 of the engine's.
    assert ratio["real"] < 1.0, f"n-gram should beat target-only on quote traffic; the comparison below needs it: {ratio}"
    assert ratio["sim"] < 1.0 and ratio["sim"] == pytest.approx(ratio["real"], abs=0.25), ratio


def test_tune_on_e2e_scores_every_comparison_on_the_replayed_traffic(sweeps, tmp_path):
    workload, closed, _ = sweeps
    results = Path(shutil.copytree(closed, tmp_path / "run"))  # tune writes study.db into the results directory
    outcome = tune(TuneOptions(results_dir=results, objective="e2e", trials=6, seed=0, method="ngram", traffic=str(workload), exhaustive=False,
                               max_concurrency=BURST), log=lambda _: None)
    report = json.loads((results / "tuned" / "tuning.json").read_text())
    assert report["objective"] == "e2e" and "e2e_ms" in report["score"]
    assert report["traffic"] | {"name": workload.stem, "requests": NUM_QUIET + BURST, "max_concurrency": BURST,
                                "max_num_seqs": BURST} == report["traffic"]
    assert report["serving_cost"]["prefill_per_token_ms"] > 0 and report["replay_acceptance"]["quote"]["rates_by_bucket"]
    rows = {c["name"]: c for c in report["comparisons"]}
    assert set(rows) == {"target_only", "best_static", "best_per_batch_schedule", "sglang_default", "conservative",
                         "aggressive", "oracle", "tuned_adaptive"}
    name = workload.stem
    for row in rows.values():  # the speedup: target-only's mean e2e over the policy's (geometric mean over draws)
        assert row["speedup"] == pytest.approx(rows["target_only"][f"{name}: e2e ms"] / row[f"{name}: e2e ms"], rel=0.02)
    statics = report["policies"]["static_speedups"]
    assert set(report["policies"]["static_figures"]) == set(statics) == {str(g) for g in range(G + 1)}
    assert rows["tuned_adaptive"]["speedup"] >= max(s for g, s in statics.items() if int(g) > 0) * (1 - 1e-9)
    assert outcome.num_complete == 6
    # another concurrency is another objective: its trials go to a study of their own, not into this one
    other = tune(TuneOptions(results_dir=results, objective="e2e", trials=2, seed=0, method="ngram", traffic=str(workload), exhaustive=False,
                             max_concurrency=BURST // 2), log=lambda _: None)
    assert other.study_name != outcome.study_name and other.num_complete == 2


def test_throughput_bench_lifts_the_round_log_to_each_measured_g_and_caps_it_at_max_tokens(sweeps):
    """The throughput objective's round-log trace, on a real sweep: every engine request of the logged server is matched
    to its workload phase, rounds at a smaller g get the acceptance that g's own server logged, and no request yields
    more than max_tokens."""
    _, closed, _ = sweeps
    run = load_results(closed)
    phases = request_phases(run, f"ngram-g{G}")
    streamed = run.requests[run.requests["cell"].str.startswith(f"ngram-g{G}__")]
    assert set(phases.values()) == {"quote"} and len(phases) >= len(streamed)
    bench = make_bench(run, "throughput", seed=0, method="ngram")
    trace = bench.traces[0]
    assert trace.name == f"ngram-g{G}" and trace.lifted is not None and trace.cap is not None
    real = np.arange(trace.accepted.shape[1])[None, :] < trace.batch_sizes[:, None]
    lifted_s1 = (trace.took()[:, :, 1][real] >= 1).mean()
    logged_s1 = survival_by_steps(run.round_logs["ngram-g1"])[""][1][0]
    cut_s1 = (trace.accepted[real] >= 1).mean()
    assert lifted_s1 == pytest.approx(logged_s1, abs=0.05) and abs(lifted_s1 - logged_s1) <= abs(cut_s1 - logged_s1) + 1e-9
    # per request, the rounds at the logged g yield exactly its output tokens after the prefill's one
    made = {}
    tokens = trace.took()[:, :, G] + 1
    for ids, row, mask in zip(trace.request_ids, tokens, real):
        for i, t in zip(ids[mask], row[mask]):
            made[int(i)] = made.get(int(i), 0) + int(t)
    assert max(made.values()) == MAX_TOKENS - 1 and list(made.values()).count(MAX_TOKENS - 1) >= len(streamed)
    assert (trace.accepted[real] > trace.cap[real]).any()  # the engine accepted drafts past max_tokens: the cap binds
