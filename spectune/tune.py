"""`spectune tune`: fit the sweep, search SGLang adaptive configs with Optuna on a simulated bench, compare the
best with the baselines and write the configs.

The stages live in their own modules: spectune.scoring (the bench a trial is scored on), spectune.search (search
space, study, ask/tell loop), spectune.comparisons (tuned vs static, schedule, presets, oracle) and spectune.deploy
(configs and tuning.json). The study is named after the run, the method, the objective and a digest of the bench (a
changed sweep or simulator starts a new study, bench_digest); without --worker the
command runs its trials and then writes, with --worker it only runs trials for a shared study.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd

from spectune.adaptive import AdaptiveConfig
from spectune.analysis import open_loop
from spectune.comparisons import best_schedule
from spectune.confirm import naming_run
from spectune.deploy import finalize
from spectune.costmodel import fastest_method, split_failed
from spectune.emit import ADAPTIVE_ALGORITHMS, validate_sglang_config
from spectune.errors import SpectuneError
from spectune.holdout import holdout_lines
from spectune.refine import kept_text, refine
from spectune.scoring import REQUEST_METRICS, Bench, Score, make_bench, prompts_not_swept
from spectune.search import open_study, redact, run_trials, trial_counts
from spectune.simulate import StaticPolicy
from spectune.store import Run, load_run

OBJECTIVES = ("throughput", "latency", "ttft", "tpot", "e2e")


@dataclass(frozen=True, slots=True)
class TuneOptions:
    results_dir: Path
    storage: str | None = None  # Optuna RDB URL; None = sqlite:///<results_dir>/study.db
    trials: int = 100
    objective: str | None = None  # None: "throughput", or "latency" for an open-loop sweep (default_objective)
    worker: bool = False  # only run trials; write nothing
    seed: int = 0  # traces use it as is; a worker's sampler adds its pid so that workers explore apart
    sglang_version: str = "0.5.23"
    out_dir: Path | None = None  # None = <results_dir>/tuned
    draft_model: str | None = None  # for the vLLM / llama.cpp outputs; default: the sweep plan's
    method: str | None = None  # the speculative method to tune; None = sglang_method (EAGLE if measured, else the fastest)
    traffic: str | None = None  # replay objectives: workload name or file with arrival_s; None = the sweep's
    max_concurrency: int | None = None  # replay objectives: requests in flight and engine slots; None = the sweep's largest batch size
    acceptance_from: Path | None = None  # replay objectives: a run of static servers measured on the traffic's prompts
    exhaustive: bool = True  # also score an exhaustive grid of SGLang configs (spectune.exhaustive; a minute or two)
    refine: bool = False  # write the config that keeps the best measured slot per batch size (spectune.refine); no trials


@dataclass(slots=True)
class TuneOutcome:
    study_name: str
    storage: str
    num_complete: int
    num_failed: int
    summary: pd.DataFrame | None = None  # comparisons (None for a worker)
    files: list[Path] = field(default_factory=list)
    verdict_lines: list[str] = field(default_factory=list)  # tuning.json's verdict and exhaustive texts


def tune(options: TuneOptions, log: Callable[[str], None] = print) -> TuneOutcome:
    if options.objective is not None and options.objective not in OBJECTIVES:
        raise SpectuneError(f"--objective {options.objective!r}: must be one of {', '.join(OBJECTIVES)}")
    run = load_results(options.results_dir)
    if options.objective is None:
        options = replace(options, objective=default_objective(run.cells))
        if options.objective == "latency":
            log(f"open loop: tuning for latency (mean TPOT of decode rounds), as the answer is in TPOT (the arrivals set tokens/s); "
                "--objective throughput tunes tokens/s at the batch sizes the servers ran")
    outdir = options.out_dir or Path(options.results_dir) / "tuned"
    refined, record = refine(outdir) if options.refine and not options.worker else (None, None)  # before the bench: fails fast
    method = options.method or sglang_method(run.cells)
    served = acceptance_run(options)
    bench = make_bench(run, options.objective, options.seed, method, options.traffic, options.max_concurrency, served)
    if bench.replay is not None:
        log(acceptance_text(served or run, options.traffic or run.manifest["plan"]["workload"], bench, options))
    storage = options.storage or f"sqlite:///{Path(options.results_dir).resolve() / 'study.db'}"
    study_name = f"spectune-{Path(options.results_dir).resolve().name}-{bench.fit.method}-{options.objective}"
    if bench.replay is not None:  # a study's scores hold for one replayed traffic and concurrency only
        study_name += f"-{bench.replay.traffic.name}-c{bench.replay.max_num_seqs}"
    study_name += f"-{bench_digest(bench)}"  # and for one bench: new cells or a new simulator start a new study
    study = open_study(storage, study_name, seed=options.seed + (os.getpid() if options.worker else 0))
    evaluate = lambda cfg: _evaluate(bench, cfg, options.sglang_version)
    if not study.trials:
        enqueue_start_points(study, bench)
    run_trials(study, bench.space, evaluate, 0 if refined else options.trials, log)
    outcome = TuneOutcome(study_name, redact(storage), *trial_counts(study))
    log(f"study {study_name}: {outcome.num_complete} complete, {outcome.num_failed} failed trials")
    if record:
        log(f"refined (round {record['round']}, from {record['passes']} measured passes): {kept_text(record)}")
    if not options.worker:
        outcome.summary, outcome.files = finalize(study, bench, run.cells, run.manifest, options, outdir, outcome, log,
                                                  tuned=refined, refined=record)
        report = json.loads((outdir / "tuning.json").read_text())
        outcome.verdict_lines = verdict_lines(report, options.results_dir)
        for line in holdout_lines(report.get("holdout", {})):
            log(naming_run(line, options.results_dir))
    return outcome


def default_objective(cells: pd.DataFrame) -> str:
    """What to tune for when none is named: tokens/s of closed loops; in an open loop the arrivals set tokens/s, and
    the answer is target-only's TPOT over the server's (spectune.analysis.open_loop), so mean TPOT there."""
    return "latency" if open_loop(cells).any() else "throughput"


def sglang_method(cells: pd.DataFrame) -> str | None:
    """The method to tune when none is named: adaptive_spec.json is SGLang's, and SGLang runs adaptive steps with
    EAGLE/EAGLE3 only, so the fastest measured of those; None (the fastest measured of all) where none was measured."""
    usable, _ = split_failed(cells)
    static = usable[usable["is_speculative"].astype(bool) & usable["adaptive_config"].isna() & (usable["num_speculative_tokens"] > 0)]
    runnable = static[static["method"].astype(str).str.upper().isin(ADAPTIVE_ALGORITHMS)]
    return fastest_method(runnable, usable)[1] if not runnable.empty else None


def acceptance_run(options: TuneOptions) -> Run | None:
    """The run --acceptance-from names, checked: replay objectives only, and a results directory with cells."""
    if options.acceptance_from is None:
        return None
    if options.objective not in REQUEST_METRICS:
        raise SpectuneError(f"--acceptance-from {options.acceptance_from}: only the replay objectives ({', '.join(REQUEST_METRICS)}) "
                            f"draw acceptance per request; use --objective e2e (or ttft, tpot), or drop --acceptance-from")
    try:
        run = load_run(options.acceptance_from)
    except SpectuneError as e:
        raise SpectuneError(f"--acceptance-from: {e}") from None
    if run.cells.empty:
        raise SpectuneError(f"--acceptance-from {options.acceptance_from}: no finished cells; let its `spectune sweep` finish first")
    return run


def acceptance_text(source: Run, traffic: str, bench: Bench, options: TuneOptions) -> str:
    """Where the replay's acceptance comes from (the sweep, or --acceptance-from's run), and a warning where the
    traffic's prompts never ran there: the replay then gives them the acceptance of other prompts of their tag."""
    replay, method = bench.replay, bench.fit.method
    tags = ", ".join(sorted(g or "untagged" for g in replay.profiles))
    where = f"the static {method} servers of {options.acceptance_from}" if options.acceptance_from else f"the sweep's static {method} servers"
    unseen, total = prompts_not_swept(source, traffic)
    if not unseen:
        return f"acceptance: per tag ({tags}) from {where}, measured on the traffic's own prompts"
    return (f"acceptance: {unseen} of the {total} prompts of traffic {replay.traffic.name} never ran on {where}; the replay "
            f"gives them the acceptance of other prompts of their tag ({tags}), which can be well off (measured: 15% at "
            f"g = 7, benchmarks/README.md, issue 13). To tune on their own: sweep static {method} servers on them (one "
            f"batch size, g up to {bench.fit.max_steps}) and pass that run as --acceptance-from")


def bench_digest(bench: Bench) -> str:
    """8 hex digits that change when what a trial scores on changes (the sweep's cells, or how spectune simulates
    them): target-only's figures and the largest static g's speedup on the bench. The same on every worker."""
    import hashlib

    figures = [round(v, 6) for r in bench.baselines.values() for v in r.figures().values()]
    figures.append(round(bench.score(StaticPolicy(bench.fit.max_steps)).speedup, 9))
    return hashlib.sha1(json.dumps(figures).encode()).hexdigest()[:8]


def verdict_lines(report: dict, results_dir: Path) -> list[str]:
    """What tuning.json (`report`) says a user should conclude: the verdict (measured or simulated), its commands
    naming the run, and the exhaustive bound."""
    lines = []
    if "verdict" in report:
        lines.append(f"verdict ({report['verdict']['source']}): {naming_run(report['verdict']['text'], results_dir)}")
    if "exhaustive" in report:
        lines.append(f"exhaustive: {report['exhaustive']['text']}")
    return lines


def load_results(results_dir: str | Path) -> Run:
    """A sweep's results directory (spectune.store's layout). Under an open-loop schedule (trace, poisson) a cell's
    batch_size is only the cap on requests in flight: there each cell counts at the batch size its server actually
    ran (batch_size_ran, rounded; the cap stays in batch_size_cap), which is what an adaptive config's slots see."""
    run = load_run(results_dir)
    if run.cells.empty:
        raise SpectuneError(f"{results_dir}: no finished cells; run `spectune sweep` first (or let it finish)")
    schedule = run.manifest.get("plan", {}).get("schedule", "closed")
    if schedule != "closed":
        ran = run.cells["batch_size_ran"] if "batch_size_ran" in run.cells else pd.Series(float("nan"), index=run.cells.index)
        if ran.isna().all():
            raise SpectuneError(f"{results_dir}/run.json: schedule is {schedule!r}, where batch size is only a cap, and no cell "
                                "recorded the batch size its server ran; sweep again with this spectune version, or tune from a "
                                "closed-loop sweep (schedule = \"closed\")")
        ran = ran.round().clip(lower=1).fillna(run.cells["batch_size"]).astype(int)
        # the server idled between arrivals, so its tok/s is the arrivals' rate; what it decodes at the batch size it
        # ran is that many sequences at 1000 / TPOT tokens/s each (the measured figure is kept aside)
        decoded = (ran * 1000.0 / run.cells["tpot_ms_mean"]).where(run.cells["tpot_ms_mean"] > 0, run.cells["output_throughput_tps"])
        run.cells = run.cells.assign(batch_size_cap=run.cells["batch_size"], batch_size=ran,
                                     output_throughput_tps_measured=run.cells["output_throughput_tps"], output_throughput_tps=decoded)
    return run


def enqueue_start_points(study, bench: Bench) -> None:
    """A fresh study's first trials: the best static speculative g and the best per-batch-size schedule, as
    adaptive configs. The search space is large and the configs that beat a static g are a small corner of
    it (measured: 100 TPE trials from scratch scored below target-only), so the study starts from them and
    the tuned config never scores below the best static g >= 1 or the schedule (a schedule that never
    speculates is no adaptive config and is skipped)."""
    sizes = bench.fit.cost.batch_sizes
    statics = {g: bench.score(StaticPolicy(g)).speedup for g in range(1, bench.fit.max_steps + 1)}
    best_g = max(statics, key=statics.get)
    starts = [dict.fromkeys(sizes, best_g), best_schedule(bench, best_g)]
    for steps in starts:
        if any(steps.values()):
            study.enqueue_trial(bench.space.params_for(steps), skip_if_exists=True)


def _evaluate(bench: Bench, cfg: AdaptiveConfig, sglang_version: str) -> Score:
    validate_sglang_config(cfg.to_dict(), sglang_version)
    return bench.score(bench.adaptive(cfg))
