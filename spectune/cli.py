"""The spectune command line: parse, call one library function, print. Heavy imports stay inside commands."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Optional

import typer

from spectune.errors import SpectuneError
from spectune.pipeline import DEFAULT_TRIALS

app = typer.Typer(help="Measure speculative decoding and tune its step counts.", no_args_is_help=True, add_completion=False)

# --- serve (owned by the engine work) ---
@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Address to bind."),
    port: int = typer.Option(8000, help="Port to bind (0 = any free port; the ready line names it)."),
    model: Optional[Path] = typer.Option(None, help="Target: an HF Llama checkpoint dir. Default: the shipped target."),
    served_model_name: Optional[str] = typer.Option(None, help="Model name in the API. Default: the model dir's name."),
    speculative_config: Optional[str] = typer.Option(
        None, help='vLLM-style JSON, e.g. \'{"method": "eagle", "num_speculative_tokens": 3}\', '
        '\'{"method": "dflash", "num_speculative_tokens": 6}\' (a parallel block drafter: K drafts in one pass), '
        '\'{"method": "draft_model", "num_speculative_tokens": 3}\' or '
        '\'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}\'. Without "model", eagle, dflash and '
        'draft_model use the shipped head / draft. Default: no speculation.'),
    draft_noise: Optional[float] = typer.Option(
        None, help="draft_model without \"model\": draft with the shipped target plus Gaussian noise of this many times each "
        "tensor's std (0 = the target itself; acceptance falls as it grows), made on first use under ~/.cache/spectune/models."),
    speculative_adaptive_config: Optional[Path] = typer.Option(
        None, help="SGLang adaptive_spec.json: steps adapt per batch size (num_speculative_tokens is the launch step)."),
    max_num_seqs: int = typer.Option(16, help="Most sequences decoded together (KV-cache slots)."),
    max_model_len: Optional[int] = typer.Option(None, help="Prompt + output limit. Default: the target's max_position_embeddings."),
    round_log: Optional[Path] = typer.Option(None, help="Append one JSON line per verify round to this file."),
    seed: int = typer.Option(0, help="Seed for requests that bring no seed of their own."),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads. Default: $SPECTUNE_TORCH_THREADS, else torch's default."),
) -> None:
    """Run the embedded speculative-decoding engine as an OpenAI-compatible server."""
    from spectune.engine.config import EngineConfig, ServeOptions, SpeculativeConfig
    from spectune.engine.server import serve as run_server

    spec = SpeculativeConfig.parse(speculative_config) if speculative_config else None
    if draft_noise is not None:
        if draft_noise < 0:
            raise SpectuneError(f"--draft-noise: {draft_noise} is negative; use a relative noise scale >= 0, e.g. 0.05")
        if spec is None or spec.method != "draft_model" or spec.model is not None:
            raise SpectuneError("--draft-noise: needs --speculative-config with method draft_model and no model "
                                "(it makes the draft from the shipped target)")
        from spectune.engine.shipped import noisy_draft_path

        spec = dataclasses.replace(spec, model=noisy_draft_path(draft_noise))
    engine = EngineConfig(model=model, speculative=spec, adaptive_config=speculative_adaptive_config, max_num_seqs=max_num_seqs,
                          max_model_len=max_model_len, seed=seed, round_log=round_log, num_threads=threads)
    run_server(ServeOptions(engine=engine, host=host, port=port, served_model_name=served_model_name))
# --- end serve ---

# --- model / tune / validate-config (owned by the tuning work) ---
@app.command("validate-config")
def validate_config(
    file: Path = typer.Argument(..., help="SGLang adaptive_spec.json or a vLLM speculative-config JSON file."),
    engine: str = typer.Option(..., help="sglang or vllm"),
    sglang_version: str = typer.Option("0.5.23", help="SGLang release the file is for (0.5.13 or later)."),
) -> None:
    """Check a config the way the engine would, plus what it would silently get wrong; exit 2 on the first problem."""
    from spectune.emit import describe_config_file

    typer.echo("OK: " + describe_config_file(file, engine, sglang_version))


@app.command()
def model(
    alpha: str = typer.Option(..., help="Acceptance rate(s), e.g. 0.8 or 0.6,0.7,0.8,0.9."),
    cost: float = typer.Option(0.05, min=0.0, help="Draft step cost / target step cost (c)."),
    gamma: str = typer.Option("2,4,7,10", help="Draft lengths: a list (2,4,7,10) or a range (1-10)."),
) -> None:
    """Expected tokens per round (1 - a^(g+1))/(1 - a) and speedup E/(g*c + 1) for each alpha and g."""
    from spectune.costmodel import model_table, parse_alphas, parse_gammas

    table = model_table(parse_alphas(alpha), parse_gammas(gamma), cost)
    typer.echo(table.to_string(index=False, formatters={"alpha": "{:.2f}".format, "expected_tokens": "{:.2f}".format, "speedup": "{:.2f}".format}))


@app.command()
def tune(
    results: Path = typer.Argument(..., help="A results directory written by spectune sweep."),
    storage: Optional[str] = typer.Option(None, help="Optuna storage URL. Default: sqlite:///<RESULTS>/study.db; postgresql://... shares one study across machines."),
    trials: int = typer.Option(100, min=0, help="Trials to run here (0: only write the configs from the study's best trial)."),
    objective: Optional[str] = typer.Option(None, help="throughput (tokens/s) or latency (mean TPOT) of decode rounds; or "
                                            "ttft, tpot, e2e of replayed traffic (embedded-engine sweeps). Default: throughput, "
                                            "latency for an open-loop sweep (trace, poisson), where the arrivals set tokens/s."),
    traffic: Optional[str] = typer.Option(None, help="ttft/tpot/e2e: workload (name or file, with arrival_s) to replay. Default: the sweep's."),
    max_concurrency: Optional[int] = typer.Option(None, help="ttft/tpot/e2e: requests in flight and engine slots. Default: the sweep's largest batch size."),
    acceptance_from: Optional[Path] = typer.Option(None, help="ttft/tpot/e2e: a results directory of static servers of the method measured on "
                                                   "the traffic's prompts; the replay draws their acceptance instead of the sweep's."),
    worker: bool = typer.Option(False, help="Only run trials for the shared study; write nothing (finish with --trials 0)."),
    seed: int = typer.Option(0, help="Seed of the sampler and the synthetic traces."),
    sglang_version: str = typer.Option("0.5.23", help="SGLang release to write adaptive_spec.json for."),
    out: Optional[Path] = typer.Option(None, help="Output directory. Default: <RESULTS>/tuned."),
    draft_model: Optional[str] = typer.Option(None, help="Draft model path for the vLLM / llama.cpp outputs. Default: the plan's."),
    method: Optional[str] = typer.Option(None, help="Speculative method to tune (e.g. eagle, ngram). Default: the fastest measured one SGLang runs adaptive steps with (EAGLE), else the fastest measured."),
    exhaustive: bool = typer.Option(True, help="Also score an exhaustive grid of SGLang configs on the same bench (a minute or two)."),
    refine: bool = typer.Option(False, help="After `spectune confirm`: keep at each batch size the slots of whichever confirmed config "
                                "measured best there (no new trials); `spectune confirm` then measures it on new passes."),
) -> None:
    """Search SGLang adaptive configs on the measured traces; write adaptive_spec.json, vLLM and llama.cpp configs."""
    from spectune.tune import TuneOptions
    from spectune.tune import tune as run_tune

    outcome = run_tune(TuneOptions(results_dir=results, storage=storage, trials=trials, objective=objective, worker=worker, seed=seed,
                                   sglang_version=sglang_version, out_dir=out, draft_model=draft_model, method=method,
                                   traffic=traffic, max_concurrency=max_concurrency, acceptance_from=acceptance_from,
                                   exhaustive=exhaustive, refine=refine), log=typer.echo)
    if outcome.summary is not None:
        typer.echo(outcome.summary[["name", "speedup", "policy"]].to_string(index=False, float_format="%.3f"))
        typer.echo("\n".join(str(p) for p in outcome.files))
        for line in outcome.verdict_lines:
            typer.echo(line)


@app.command()
def confirm(
    results: Path = typer.Argument(..., help="A results directory tuned by spectune tune (RESULTS/tuned/tuning.json)."),
    max_passes: int = typer.Option(20, min=2, help="Most paired passes (each runs every server once on the same traffic)."),
    min_passes: int = typer.Option(4, min=2, help="Passes before the first look at the intervals."),
    run_passes: Optional[int] = typer.Option(None, min=1, help="Run at most this many passes now; run again to continue."),
    batch_sizes: Optional[str] = typer.Option(None, help="Closed-loop objectives: confirm at these swept batch sizes only, e.g. 1,16."),
    tuned: Optional[Path] = typer.Option(None, help="The tune output to confirm (tuning.json, adaptive_spec.json). Default: <RESULTS>/tuned."),
    max_foreign_cores: float = typer.Option(0.3, min=0.0, help="Run a pass again when, in any cell, other work used more cores of this machine."),
    max_slowdown: float = typer.Option(0.15, min=0.0, help="Run a pass again when, in any cell, the engine's steps ran this much slower than in the same server's median pass."),
    out: Optional[Path] = typer.Option(None, help="Passes directory. Default: <RESULTS>/confirm."),
) -> None:
    """Measure the tuned config against SGLang's default config, the best static g and target-only on the engine,
    paired passes until the difference is clear; write the verdict into tuning.json."""
    from spectune.confirm import ConfirmOptions
    from spectune.confirm import confirm as run_confirm

    outcome = run_confirm(ConfirmOptions(results_dir=results, tuned_dir=tuned, out_dir=out, max_passes=max_passes, min_passes=min_passes,
                                         run_passes=run_passes, batch_sizes=_ints(batch_sizes, "--batch-sizes"),
                                         max_foreign_cores=max_foreign_cores, max_slowdown=max_slowdown), log=typer.echo)
    if not outcome.finished and not outcome.exhausted:
        again = " ".join(sys.argv[1:]).replace(f"--run-passes {run_passes}", "").strip() if run_passes else " ".join(sys.argv[1:])
        typer.echo(f"{outcome.passes} passes counted so far; not settled yet. Continue with: spectune {again}")


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
    plan: Optional[str] = typer.Argument(None, help="Sweep plan: a TOML file, or a shipped plan by name (embedded, vllm-cpu, ...). "
                                         "Default: embedded (the embedded engine)."),
    out: Optional[Path] = typer.Option(None, help="Results directory. Default: results/<plan name>-<timestamp> under the current directory. "
                                       "With --worker: the worker's own (its server logs); default: a temp dir."),
    resume: Optional[Path] = typer.Option(None, help="Continue the run in this results directory (same plan)."),
    workload: Optional[str] = typer.Option(None, help="Override the plan's workload: code, quote, random, phase, or a file."),
    batch_sizes: Optional[str] = typer.Option(None, help="Override batch sizes (closed-loop concurrency), e.g. 1,4,16."),
    repeats: Optional[int] = typer.Option(None, help="Override repeats per cell; with --resume, more repeats than the run's are "
                                           "added to it (measured on fresh launches of every server)."),
    max_tokens: Optional[int] = typer.Option(None, help="Override output tokens per request."),
    no_tune: bool = typer.Option(False, "--no-tune", help="Stop after measuring (no configs; spectune tune RESULTS does it later)."),
    no_report: bool = typer.Option(False, "--no-report", help="Do not write the report (spectune report RESULTS does it later)."),
    trials: int = typer.Option(DEFAULT_TRIALS, min=0, help="Optuna trials of the tune stage."),
    report_dir: Optional[Path] = typer.Option(None, help="Report directory. Default: reports/<run> beside results/<run>, else <RESULTS>/report."),
    budget: Optional[float] = typer.Option(None, help="Guided sweep: measure at most this share of the (server, batch size) cells, "
                                           "chosen by the cost model (e.g. 0.25). Default: the plan's `budget`, else every cell."),
    storage: Optional[str] = typer.Option(None, help="With --worker: the Optuna RDB URL (postgresql://... for several machines, "
                                          "sqlite:///... on one) whose study shares the plan's cells among workers."),
    worker: bool = typer.Option(False, "--worker", help="Claim cells of the plan from --storage, measure them and record them there "
                                "until none is left; then spectune collect URL --out DIR writes the results directory."),
    heartbeat: float = typer.Option(10.0, min=1.0, help="With --worker: seconds between heartbeats; a worker silent for 3 of them "
                                    "is taken as dead and its cell goes to another."),
) -> None:
    """Measure target-only vs speculative servers on identical traffic, then tune, write the configs and the report."""
    import datetime as dt

    from spectune.pipeline import PipelineOptions, run_pipeline
    from spectune.plan import load_plan
    from spectune.resources import resolve_plan

    overrides = dict(workload=workload, batch_sizes=_ints(batch_sizes, "--batch-sizes"), repeats=repeats, max_tokens=max_tokens)
    if resume is not None and plan is None:
        p = _recorded_plan(resume, overrides)
    else:
        p = load_plan(resolve_plan(plan), **overrides)
    root = resume or out or Path("results") / f"{p.name}-{dt.datetime.now():%Y%m%d-%H%M%S}"
    progress = _progress()
    if worker or storage:
        _sweep_worker(p, storage, worker, heartbeat, out, budget, resume)
        return
    if budget is not None and not 0 < budget <= 1:
        raise SpectuneError(f"--budget {budget}: must be a share of the plan's cells in (0, 1], e.g. 0.25")
    options = PipelineOptions(tune=not no_tune, report=not no_report, trials=trials, report_dir=report_dir, budget=budget)
    outcome = run_pipeline(p, root, resume=resume is not None, options=options, progress=progress)
    if outcome.sweep.interrupted:
        typer.echo(f"Interrupted. Finished cells are saved in {root}. Resume with: spectune sweep --resume {root}", err=True)
        raise typer.Exit(130)
    s = outcome.sweep
    _print_summary(root, outcome.report_files, progress)
    for error in outcome.errors:
        typer.echo(f"error: {error}", err=True)
    if s.failed:
        typer.echo(f"{s.failed} cell(s) failed: their causes are in {root}/cells/*.json and the report", err=True)
    if s.failed or outcome.errors:
        raise typer.Exit(1)


def _sweep_worker(plan, storage: Optional[str], worker: bool, heartbeat: float, scratch: Optional[Path],
                  budget: Optional[float], resume: Optional[Path]) -> None:
    from spectune.distributed import run_worker
    from spectune.search import redact

    if not (worker and storage):
        raise SpectuneError("--storage and --worker go together: spectune sweep PLAN --storage URL --worker (then spectune collect URL --out DIR)")
    if budget is not None or resume is not None:
        flag = "--budget (a guided sweep picks its cells from its own results, on one machine)" if budget is not None else \
            "--resume (the study keeps what the workers finished: the same command joins it again)"
        raise SpectuneError(f"{flag} does not go with --worker; drop it")
    try:
        outcome = run_worker(plan, storage, scratch=scratch, heartbeat_s=heartbeat, log=typer.echo)
    except KeyboardInterrupt:
        typer.echo("Interrupted. The cells this worker finished are in the study; the same command joins it again.", err=True)
        raise typer.Exit(130)
    typer.echo(f"worker done: {len(outcome.measured)} cells measured ({outcome.failed} failed) in study {outcome.study_name}; "
               f"their server logs are in {outcome.scratch / 'logs'}")
    typer.echo(f"next: spectune collect {redact(storage)} --out DIR")


@app.command()
def collect(
    storage: str = typer.Argument(..., help="The Optuna RDB URL the sweep workers shared."),
    out: Path = typer.Option(..., help="Results directory to write (one per hardware, OUT/hw-<key>, when machines differ)."),
    study: Optional[str] = typer.Option(None, help="The sweep study; default: the only one in the storage."),
) -> None:
    """Write the cells that sweep workers recorded in a shared study as a results directory (spectune tune/report read it)."""
    from spectune.distributed import collect as run_collect

    for path in run_collect(storage, out, study, log=typer.echo):
        typer.echo(f"next: spectune tune {path} (then spectune report {path})")


@app.command()
def merge(
    results: list[Path] = typer.Argument(..., help="Two or more results directories of one plan (runs at different times; only repeats may differ)."),
    out: Path = typer.Option(..., help="Results directory to write: every cell with all the runs' repeats (spectune tune/report read it)."),
) -> None:
    """Pool runs of one plan measured at different times into one results directory, each cell's mean over all their launches."""
    from spectune.merge import merge_runs

    outcome = merge_runs(results, out)
    for source, low, high in outcome.repeats:
        typer.echo(f"{source}: repeats {low}-{high}")
    typer.echo(f"{outcome.root}: {outcome.cells} cells from {len(outcome.repeats)} runs; next: spectune tune {outcome.root}")


def _progress():
    """A live rich panel on a terminal; a line per server and cell otherwise (CI logs)."""
    from spectune.progress import PlainProgress, RichProgress

    return RichProgress() if sys.stdout.isatty() else PlainProgress(typer.echo)


def _print_summary(root: Path, report_files: list[Path], progress) -> None:
    from spectune.progress import RichProgress
    from spectune.summary import build_summary, plain_text, print_rich

    summary = build_summary(root, report_files)
    if isinstance(progress, RichProgress):
        print_rich(summary, progress.console)
    else:
        typer.echo(plain_text(summary))


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
    concurrency: int = typer.Option(1, min=1, help="Requests in flight (the batch size); with --request-rate, the cap on them."),
    num_prompts: int = typer.Option(16, min=1, help="Measured requests."),
    max_tokens: int = typer.Option(64, min=1, help="Output tokens per request (ignore_eos keeps them fixed)."),
    workload: str = typer.Option("code", help="code, quote, random, phase, or a JSONL/ShareGPT file."),
    out: Path = typer.Option(..., help="Results directory to write."),
    api_key_env: Optional[str] = typer.Option(None, help="Environment variable that holds the API key."),
    tokenizer: Optional[str] = typer.Option(None, help="The served model's tokenizer (tokenizer.json or an HF model dir): "
                                            "counts the tokens of each chunk when the server sends no per-chunk counts."),
    request_rate: Optional[float] = typer.Option(None, help="Open loop: requests per second (Poisson arrivals, seeded) "
                                                 "instead of a closed loop."),
    burstiness: Optional[float] = typer.Option(None, help="With --request-rate: gamma shape of the gaps (1 = Poisson, < 1 bursty)."),
    slo_ttft_ms: Optional[float] = typer.Option(None, help="Goodput: TTFT limit (ms, from the intended send)."),
    slo_tpot_ms: Optional[float] = typer.Option(None, help="Goodput: TPOT limit (ms)."),
    slo_e2e_ms: Optional[float] = typer.Option(None, help="Goodput: end-to-end limit (ms, from the intended send)."),
    workers: int = typer.Option(1, min=1, help="Load-generator processes (same requests and schedule, request i to worker i mod N): "
                                "more when one client core saturates (the cell then says client_saturated)."),
) -> None:
    """Measure one cell against an already-running server (attached, not launched) and write the same files as a sweep."""
    from spectune.plan import plan_from_dict
    from spectune.progress import PlainProgress
    from spectune.sweep import run_sweep

    server = {"name": "server", "engine": "openai", "url": url, "model": model, "api_key_env": api_key_env, "tokenizer": tokenizer}
    raw = {"name": "bench", "workload": workload, "batch_sizes": [concurrency], "repeats": 1, "max_tokens": max_tokens,
           "prompts_per_slot": 1, "min_prompts": num_prompts, "burstiness": burstiness, "slo_ttft_ms": slo_ttft_ms,
           "slo_tpot_ms": slo_tpot_ms, "slo_e2e_ms": slo_e2e_ms, "workers": workers,
           "servers": [{k: v for k, v in server.items() if v is not None}]}
    if request_rate is not None:
        raw |= {"schedule": "poisson", "request_rates": [request_rate]}
    p = plan_from_dict({k: v for k, v in raw.items() if v is not None}, source="spectune bench")
    outcome = run_sweep(p, out, progress=PlainProgress(typer.echo))
    if outcome.interrupted:
        typer.echo(f"Interrupted. Resume with: spectune sweep --resume {out}", err=True)
        raise typer.Exit(130)
    typer.echo(f"Results: {out} (cells/, requests/, cells.parquet)")
    if outcome.failed:
        typer.echo(f"the cell failed: its cause is in {out}/cells/*.json", err=True)
        raise typer.Exit(1)


@app.command()
def report(
    results: Path = typer.Argument(..., help="A results directory written by spectune sweep or bench."),
    out: Optional[Path] = typer.Option(None, help="Report directory. Default: reports/<run>/ under the current directory."),
) -> None:
    """Write an HTML and a Markdown report with plots."""
    from spectune.report import write_report

    paths = write_report(results, out or Path("reports") / results.name)
    for p in paths:
        typer.echo(str(p))


@app.command()
def gate(
    results: Path = typer.Argument(..., help="The new results directory."),
    baseline: Path = typer.Option(..., help="The baseline results directory to compare with."),
    rules: Optional[Path] = typer.Option(None, help="Rules (TOML, see configs/gate-rules.toml). Default: target-only "
                                         "throughput, speedup at the 2 smallest batch sizes, p99 TTFT and TPOT, acceptance length."),
    junit: Optional[Path] = typer.Option(None, help="Also write a JUnit XML file for CI."),
    summary: Optional[Path] = typer.Option(None, help="Also write a Markdown summary (appended to $GITHUB_STEP_SUMMARY when set)."),
) -> None:
    """Exit 1 when a metric got worse beyond its rule's threshold and beyond run-to-run noise; 2 on a bad baseline."""
    from spectune.gate import DEFAULT_RULES, compare, load_rules, print_result, write_junit, write_summary

    result = compare(results, baseline, load_rules(rules) if rules else DEFAULT_RULES, defaults=rules is None)
    print_result(result)
    if junit is not None:
        write_junit(result, junit)
    write_summary(result, results, baseline, summary)
    if result.errors:
        more = f" (and {len(result.errors) - 1} more above)" if len(result.errors) > 1 else ""
        raise SpectuneError(result.errors[0] + more)
    if result.regressions:
        raise typer.Exit(1)


def main() -> None:
    try:
        rc = app(standalone_mode=False)  # click returns typer.Exit's code instead of raising it here
        sys.exit(rc if isinstance(rc, int) else 0)
    except SpectuneError as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except Exception as e:
        # click's usage errors, by class name: typer vendors its own copy of click from 0.2x, older ones use click's
        names = {cls.__name__ for cls in type(e).__mro__}
        if "ClickException" in names:
            e.show()
            sys.exit(2)
        if "Abort" in names:
            sys.exit(130)
        raise


if __name__ == "__main__":
    main()
