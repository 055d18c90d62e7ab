"""The spectune command line: parse, call one library function, print. Heavy imports stay inside commands."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from spectune.errors import SpectuneError

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PLAN = REPO_ROOT / "configs" / "embedded.toml"

app = typer.Typer(help="Measure speculative decoding and tune its step counts.", no_args_is_help=True, add_completion=False)

# --- serve (owned by the engine work) ---
# --- end serve ---

# --- model / tune / validate-config (owned by the tuning work) ---
# --- end model / tune / validate-config ---


def _ints(text: str | None, flag: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SpectuneError(f"{flag} {text!r}: expected comma-separated integers, e.g. 1,4,16") from None


@app.command()
def sweep(
    plan: Optional[Path] = typer.Argument(None, help="Sweep plan (TOML). Default: configs/embedded.toml (the embedded engine)."),
    out: Optional[Path] = typer.Option(None, help="Results directory. Default: results/<plan name>-<timestamp>."),
    resume: Optional[Path] = typer.Option(None, help="Continue the run in this results directory (same plan)."),
    workload: Optional[str] = typer.Option(None, help="Override the plan's workload: code, quote, random, phase, or a file."),
    batch_sizes: Optional[str] = typer.Option(None, help="Override batch sizes (closed-loop concurrency), e.g. 1,4,16."),
    repeats: Optional[int] = typer.Option(None, help="Override repeats per cell."),
    max_tokens: Optional[int] = typer.Option(None, help="Override output tokens per request."),
) -> None:
    """Measure target-only vs speculative servers on identical traffic, per batch size and step count."""
    import datetime as dt

    from spectune.plan import load_plan
    from spectune.sweep import run_sweep

    overrides = dict(workload=workload, batch_sizes=_ints(batch_sizes, "--batch-sizes"), repeats=repeats, max_tokens=max_tokens)
    if resume is not None and plan is None:
        p = _recorded_plan(resume, overrides)
    else:
        p = load_plan(plan or DEFAULT_PLAN, **overrides)
    root = resume or out or REPO_ROOT / "results" / f"{p.name}-{dt.datetime.now():%Y%m%d-%H%M%S}"
    outcome = run_sweep(p, root, resume=resume is not None, log=typer.echo)
    if outcome.interrupted:
        typer.echo(f"Interrupted. Finished cells are saved in {root}. Resume with: spectune sweep --resume {root}", err=True)
        raise typer.Exit(130)
    typer.echo(f"{outcome.done} cells measured, {outcome.failed} failed, {outcome.skipped} already done. Results: {root}")
    typer.echo(f"Next: spectune report {root}   |   spectune tune {root}")


def _recorded_plan(root: Path, overrides: dict):
    """A resumed run re-reads the plan it recorded in run.json, so the user need not pass it again."""
    from spectune.plan import plan_from_dict
    from spectune.store import RunStore

    store = RunStore.open(root)
    return plan_from_dict(store.manifest["plan"], source=str(root / "run.json"), **overrides)


@app.command()
def bench(
    url: str = typer.Option(..., help="Base URL of a running OpenAI-compatible server, e.g. http://127.0.0.1:8000"),
    model: Optional[str] = typer.Option(None, help="Model name for request bodies (default: the server's first model)."),
    concurrency: int = typer.Option(1, min=1, help="Requests in flight (the batch size)."),
    num_prompts: int = typer.Option(16, min=1, help="Measured requests."),
    max_tokens: int = typer.Option(64, min=1, help="Output tokens per request (ignore_eos keeps them fixed)."),
    workload: str = typer.Option("code", help="code, quote, random, phase, or a JSONL/ShareGPT file."),
    out: Path = typer.Option(..., help="Results directory to write."),
    api_key_env: Optional[str] = typer.Option(None, help="Environment variable that holds the API key."),
) -> None:
    """Measure one cell against an already-running server and write the same files as a sweep."""
    from spectune.plan import Plan
    from spectune.servers.base import ServerSpec
    from spectune.sweep import run_sweep

    spec = ServerSpec(name="server", engine="openai", url=url, model=model, api_key_env=api_key_env)
    p = Plan(name="bench", workload=workload, batch_sizes=(concurrency,), repeats=1, max_tokens=max_tokens,
             prompts_per_slot=1, min_prompts=num_prompts, servers=(spec,))
    outcome = run_sweep(p, out, log=typer.echo)
    if outcome.interrupted:
        raise typer.Exit(130)
    typer.echo(f"Results: {out} (cells/, requests/, cells.parquet)")


@app.command()
def report(
    results: Path = typer.Argument(..., help="A results directory written by spectune sweep or bench."),
    out: Optional[Path] = typer.Option(None, help="Report directory. Default: reports/<run>/"),
) -> None:
    """Write an HTML and a Markdown report with plots."""
    from spectune.report import write_report

    paths = write_report(results, out or REPO_ROOT / "reports" / results.name)
    for p in paths:
        typer.echo(str(p))


@app.command()
def gate(
    results: Path = typer.Argument(..., help="The new results directory."),
    baseline: Path = typer.Option(..., help="The baseline results directory to compare with."),
    metric: str = typer.Option("output_throughput_tps", help="Higher-is-better metric to compare per cell."),
    max_regression: float = typer.Option(0.10, help="Largest allowed relative drop, e.g. 0.10 = 10%."),
    junit: Optional[Path] = typer.Option(None, help="Also write a JUnit XML file for CI."),
) -> None:
    """Exit 1 when any cell regressed beyond --max-regression against the baseline."""
    from spectune.gate import compare, write_junit

    result = compare(results, baseline, metric=metric, max_regression=max_regression)
    for line in result.lines():
        typer.echo(line)
    if junit is not None:
        write_junit(result, junit)
    if not result.passed:
        raise typer.Exit(1)


def main() -> None:
    try:
        app(standalone_mode=False)
    except SpectuneError as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except Exception as e:  # click usage errors and the like
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            sys.exit(2)
        if isinstance(e, click.exceptions.Abort):
            sys.exit(130)
        raise


if __name__ == "__main__":
    main()
