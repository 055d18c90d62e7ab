"""The spectune command line: parse, call one library function, print. Heavy imports stay inside commands."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Optional

import typer

from spectune.errors import SpectuneError

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PLAN = REPO_ROOT / "configs" / "embedded.toml"

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
    objective: str = typer.Option("throughput", help="throughput (tokens/s) or latency (mean TPOT) of decode rounds; or "
                                  "ttft, tpot, e2e of replayed traffic (embedded-engine sweeps)."),
    traffic: Optional[str] = typer.Option(None, help="ttft/tpot/e2e: workload (name or file, with arrival_s) to replay. Default: the sweep's."),
    max_concurrency: Optional[int] = typer.Option(None, help="ttft/tpot/e2e: requests in flight and engine slots. Default: the sweep's largest batch size."),
    worker: bool = typer.Option(False, help="Only run trials for the shared study; write nothing (finish with --trials 0)."),
    seed: int = typer.Option(0, help="Seed of the sampler and the synthetic traces."),
    sglang_version: str = typer.Option("0.5.23", help="SGLang release to write adaptive_spec.json for."),
    out: Optional[Path] = typer.Option(None, help="Output directory. Default: <RESULTS>/tuned."),
    draft_model: Optional[str] = typer.Option(None, help="Draft model path for the vLLM / llama.cpp outputs. Default: the plan's."),
    method: Optional[str] = typer.Option(None, help="Speculative method to tune (e.g. eagle, ngram). Default: the one that measured fastest over target-only."),
) -> None:
    """Search SGLang adaptive configs on the measured traces; write adaptive_spec.json, vLLM and llama.cpp configs."""
    from spectune.tune import TuneOptions
    from spectune.tune import tune as run_tune

    outcome = run_tune(TuneOptions(results_dir=results, storage=storage, trials=trials, objective=objective, worker=worker, seed=seed,
                                   sglang_version=sglang_version, out_dir=out, draft_model=draft_model, method=method,
                                   traffic=traffic, max_concurrency=max_concurrency), log=typer.echo)
    if outcome.summary is not None:
        typer.echo(outcome.summary[["name", "speedup", "policy"]].to_string(index=False, float_format="%.3f"))
        typer.echo("\n".join(str(p) for p in outcome.files))


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
    if outcome.failed:
        typer.echo(f"{outcome.failed} cell(s) failed: their causes are in {root}/cells/*.json and the report", err=True)
        raise typer.Exit(1)


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
