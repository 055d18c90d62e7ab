"""`spectune sweep`'s whole chain: measure, then tune (fit the model, search, write the configs), then the report.

The stages after the measurement read the results directory exactly as `spectune tune` and `spectune report` do.
A stage that fails is recorded with its cause and the next one still runs: the measurement is on disk already
and is never lost; the caller exits non-zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from spectune.errors import SpectuneError

if TYPE_CHECKING:  # the CLI imports DEFAULT_TRIALS from here; `spectune --help` stays instant
    from spectune.plan import Plan
    from spectune.progress import SweepProgress
    from spectune.sweep import SweepOutcome

# Optuna trials of the tune stage. Each costs about 0.1 s on the default sweep (2 cores), so tuning adds
# seconds to the ~4 minutes of measurement; the study starts from the best static g and schedule (tune.py).
DEFAULT_TRIALS = 100


@dataclass(frozen=True, slots=True)
class PipelineOptions:
    tune: bool = True
    report: bool = True
    trials: int = DEFAULT_TRIALS
    seed: int = 0
    report_dir: Path | None = None  # None: report_dir_for(results)
    budget: float | None = None  # guided sweep (spectune.guided); None: the plan's budget, or the whole grid


@dataclass(slots=True)
class PipelineOutcome:
    sweep: SweepOutcome
    tuned_dir: Path | None = None
    report_files: list[Path] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one line per failed stage: "tune: ..."
    skipped: list[str] = field(default_factory=list)  # stages with nothing to do, and why


def report_dir_for(results: Path) -> Path:
    """reports/<run> beside a results/<run> directory; <run>/report inside any other results directory."""
    results = Path(results)
    if results.parent.name == "results":
        return results.parent.parent / "reports" / results.name
    return results / "report"


def run_pipeline(plan: Plan, root: Path, *, resume: bool = False, options: PipelineOptions = PipelineOptions(),
                 progress: SweepProgress | None = None) -> PipelineOutcome:
    """Measure the plan into `root`, then tune and report as `options` say. Interrupted: the later stages are skipped."""
    from spectune.sweep import run_sweep

    budget = options.budget if options.budget is not None else plan.budget
    if budget is not None:
        from spectune.guided import run_guided

        measured = run_guided(plan, root, budget=budget, resume=resume, seed=options.seed, progress=progress)
    else:
        measured = run_sweep(plan, root, resume=resume, progress=progress)
    outcome = PipelineOutcome(sweep=measured)
    say = progress.message if progress is not None else print
    if outcome.sweep.interrupted:
        return outcome
    s = outcome.sweep
    say(f"{s.done} cells measured, {s.failed} failed, {s.skipped} already done. Results: {Path(root).resolve()}")
    if options.tune:
        _tune_stage(root, options, outcome, say)
    else:
        say(f"tune: not run (--no-tune); later: spectune tune {root}")
    if options.report:
        _report_stage(root, options, outcome, say)
    else:
        say(f"report: not run (--no-report); later: spectune report {root}")
    return outcome


def _tune_stage(root: Path, options: PipelineOptions, outcome: PipelineOutcome, say) -> None:
    from spectune.tune import TuneOptions, tune

    reason = _nothing_to_tune(root)
    if reason:
        outcome.skipped.append(f"tune: {reason}")
        say(f"tune: skipped, {reason}")
        return
    say(f"tune: fitting the model and running {options.trials} Optuna trials on the simulated bench")
    try:
        tuned = tune(TuneOptions(results_dir=root, trials=options.trials, seed=options.seed), log=say)
        outcome.tuned_dir = root / "tuned"
        for line in tuned.verdict_lines:  # is the tuned config worth deploying over SGLang's default: the answer's point
            say(line)
    except Exception as e:  # the measurement is on disk; report the stage's failure, go on with the report
        outcome.errors.append(f"tune: {_cause(e)}; the measurement is intact, rerun with: spectune tune {root}")
        say(f"tune failed: {_cause(e)}")


def _report_stage(root: Path, options: PipelineOptions, outcome: PipelineOutcome, say) -> None:
    from spectune.report import write_report

    out = options.report_dir or report_dir_for(root)
    say(f"report: writing {out.resolve()}")
    try:
        outcome.report_files = [Path(p) for p in write_report(root, out)]
    except Exception as e:
        outcome.errors.append(f"report: {_cause(e)}; rerun with: spectune report {root} --out {out}")
        say(f"report failed: {_cause(e)}")


def _nothing_to_tune(root: Path) -> str | None:
    """Why the results hold nothing to tune (no usable static speculative cell and target-only cell), or None."""
    from spectune.store import load_run

    cells = load_run(root).cells
    if cells.empty:
        return "no finished cells"
    ok = cells[cells["status"] == "ok"]
    static = ok[ok["is_speculative"].astype(bool) & ok["adaptive_config"].isna() & (ok["num_speculative_tokens"] > 0)]
    if static.empty:
        return "the sweep measured no static speculative server"
    if ok["is_speculative"].astype(bool).all():
        return "the sweep measured no target-only server"
    return None


def _cause(e: Exception) -> str:
    return str(e) if isinstance(e, SpectuneError) else f"{type(e).__name__}: {e}"
