"""Run a sweep plan: every server, every batch size, every repeat, on identical traffic.

For each server: launch once, then for each (batch size, repeat) not yet finished: reset its cache, warm up at
the same concurrency, scrape, send the measured requests, scrape again, and write the cell atomically before
the next one starts. A server that dies fails only the cell it died in; it is restarted and the sweep goes on.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from spectune.errors import SpectuneError
from spectune.plan import Plan, plan_to_dict
from spectune.servers.base import ServerSpec, stop_all_servers
from spectune.store import RunStore, cell_id


@dataclass(frozen=True, slots=True)
class Cell:
    server: ServerSpec
    batch_size: int
    repeat: int

    @property
    def id(self) -> str:
        return cell_id(self.server.name, self.batch_size, self.repeat)


@dataclass(slots=True)
class SweepOutcome:
    root: Path
    done: int
    failed: int
    skipped: int  # already finished before a resume
    interrupted: bool


def plan_cells(plan: Plan) -> list[Cell]:
    return [Cell(s, bs, r) for s in plan.servers for bs in plan.batch_sizes for r in range(plan.repeats)]


def traffic_for(plan: Plan, batch_size: int):
    """The exact requests and schedule every server gets at this batch size (a pure function of the plan)."""
    from spectune.workload import ClosedLoop, Trace, load_requests, traffic_digest

    requests = load_requests(plan.workload, num_prompts=plan.num_prompts(batch_size), max_tokens=plan.max_tokens, seed=plan.seed)
    schedule = ClosedLoop(concurrency=batch_size) if plan.schedule == "closed" else Trace(max_concurrency=batch_size)
    digest = traffic_digest(requests, schedule, _sampling(plan))
    return requests, schedule, digest


def _sampling(plan: Plan) -> dict:
    return {"temperature": plan.temperature, "seed": plan.seed, "ignore_eos": plan.ignore_eos}


def traffic_digests(plan: Plan) -> dict[str, str]:
    return {str(bs): traffic_for(plan, bs)[2] for bs in plan.batch_sizes}


def new_manifest(plan: Plan, run_id: str) -> dict:
    return {
        "run_id": run_id,
        "plan": plan_to_dict(plan),
        "plan_digest": plan.digest(),
        "traffic_digests": traffic_digests(plan),
        "engines": {},
        "hardware": _hardware(),
        "git_sha": _git_sha(),
        "spectune_version": _version(),
        "started_at": _now(),
        "status": "running",
        "progress": {"total": len(plan_cells(plan)), "done": 0, "failed": 0},
    }


def check_resumable(store: RunStore, plan: Plan) -> None:
    m = store.manifest
    if m.get("plan_digest") != plan.digest():
        raise SpectuneError(
            f"{store.root / 'run.json'}: the plan changed since this run started (plan digest differs); "
            "resume with the same plan file and flags, or start a new run with another --out"
        )
    now = traffic_digests(plan)
    if m.get("traffic_digests") != now:
        changed = sorted(k for k in now if m.get("traffic_digests", {}).get(k) != now[k])
        raise SpectuneError(
            f"{store.root / 'run.json'}: the workload changed since this run started (traffic digest differs at batch sizes "
            f"{changed}); restore the original workload file or start a new run with another --out"
        )


def run_sweep(plan: Plan, out: Path, *, resume: bool = False, log=print) -> SweepOutcome:
    """Measure every cell of the plan into `out`; on resume only the unfinished ones."""
    if resume:
        store = RunStore.open(out)
        check_resumable(store, plan)
        store.manifest["status"] = "running"
        store.manifest.setdefault("resumed_at", []).append(_now())
        store.save_manifest()
    else:
        _preflight(plan)
        store = RunStore.create(out, new_manifest(plan, out.name))
    finished = store.finished_cells()
    done_ids = {cid for cid, row in finished.items() if row.get("status") in ("ok", "failed")}
    todo = [c for c in plan_cells(plan) if c.id not in done_ids]
    outcome = SweepOutcome(root=out, done=0, failed=0, skipped=len(plan_cells(plan)) - len(todo), interrupted=False)
    try:
        for spec in plan.servers:
            cells = [c for c in todo if c.server.name == spec.name]
            if cells:
                _run_server(plan, store, spec, cells, outcome, log)
    except KeyboardInterrupt:
        outcome.interrupted = True
    finally:
        stop_all_servers()
        _update_progress(store, plan, outcome)
        store.finalize()
    return outcome


def _preflight(plan: Plan) -> None:
    """Checks that fail before anything launches: bad workload, ports in use, mismatched tokenizers."""
    from spectune.servers.base import check_port_free

    traffic_for(plan, plan.batch_sizes[0])  # raises on a bad workload file
    for spec in plan.servers:
        if spec.url is None and spec.port is not None:
            check_port_free(spec.host, spec.port)
    from spectune.emit import validate_sglang_config
    from spectune.servers.sglang import speculative_args
    from spectune.tokenizer_check import check_tokenizers

    for spec in plan.servers:
        if spec.adaptive_config:
            validate_sglang_config(spec.adaptive_config)
        if spec.engine == "sglang" and spec.is_speculative:
            speculative_args(spec)  # inconsistent SGLang flags (e.g. adaptive with topk > 1) fail here, not at launch
        check_tokenizers(spec)


def _run_server(plan: Plan, store: RunStore, spec: ServerSpec, cells: list[Cell], outcome: SweepOutcome, log) -> None:
    from spectune.servers import make_server

    server = make_server(spec, store.log_dir(), round_log=store.round_log_path(spec.name), max_batch_size=max(plan.batch_sizes))
    started = False
    try:
        for i, cell in enumerate(cells):
            if not started or not server.alive():
                log(f"[{spec.name}] {'server is down; restarting' if started else 'starting'} {spec.engine} server")
                server.stop()
                try:
                    server.start()
                except SpectuneError as e:  # never ready: fail this server's remaining cells, go on with the next server
                    for rest in cells[i:]:
                        store.write_cell({**_cell_header(plan, rest, traffic_for(plan, rest.batch_size)[2]),
                                          "status": "failed", "error": f"server did not start: {e}", "finished_at": _now()}, None)
                        outcome.failed += 1
                    log(f"[{spec.name}] server did not start: {e}")
                    return
                started = True
                store.manifest["engines"][spec.name] = {"engine": spec.engine, "version": server.engine_version(), "pid": server.pid()}
                store.save_manifest()
            row = _measure_cell(plan, store, server, cell, log)
            if row["status"] == "failed":
                outcome.failed += 1
            else:
                outcome.done += 1
            _update_progress(store, plan, outcome)
    finally:
        server.stop()


def _measure_cell(plan: Plan, store: RunStore, server, cell: Cell, log) -> dict:
    from spectune.analysis import acceptance, request_frame, summarize_cell
    from spectune.loadgen import run_requests
    from spectune.hostload import ForeignLoad
    from spectune.servers.memory import MemorySampler
    import asyncio

    requests, schedule, digest = traffic_for(plan, cell.batch_size)
    row: dict = _cell_header(plan, cell, digest)
    records: list = []
    common = dict(temperature=plan.temperature, seed=plan.seed, ignore_eos=plan.ignore_eos, api_key=_api_key(cell.server),
                  request_timeout_s=plan.request_timeout_s, stall_timeout_s=plan.stall_timeout_s,
                  extra_body=server.extra_body or None)
    warmup = plan.warmup_per_slot * cell.batch_size
    sampler = MemorySampler(server.pid())
    foreign = ForeignLoad([os.getpid(), server.pid()])
    interrupted = False
    try:
        sampler.start()
        foreign.start()
        scrapes: list = []

        def reset_and_scrape() -> None:  # a warm-up fills the prefix cache with these very prompts
            server.reset_cache()
            scrapes.append(server.scrape())

        if not warmup:
            reset_and_scrape()
        asyncio.run(run_requests(server.base_url, server.model_name, requests, schedule, records=records,
                                 warmup_requests=warmup, after_warmup=reset_and_scrape if warmup else None, **common))
        before = scrapes[0]
        after = server.scrape()
        acc = acceptance(before, after)
        row["acceptance_rate"], row["acceptance_length"] = acc.rate, acc.mean_length
        for i, rate in enumerate(acc.per_pos, start=1):
            row[f"accept_pos_{i}"] = rate
        row["kv_cache_usage"] = after.kv_cache_usage
        row["live_num_steps"] = after.num_steps
    except KeyboardInterrupt:
        interrupted = True
    except Exception as e:  # a scrape or transport failure fails this cell, not the sweep
        row["status"], row["error"] = "failed", f"{type(e).__name__}: {e}"
    finally:
        mem = sampler.stop()
        row["foreign_cpu_cores"] = foreign.stop()  # other work on this machine during the cell (spectune.hostload)
        row["mem_peak_mb"], row["mem_mean_mb"], row["mem_source"] = mem.peak_mb, mem.mean_mb, mem.source
    measured = [r for r in records if not r.warmup]
    row.update(summarize_cell(measured))
    if interrupted:
        row["status"], row["error"] = "partial", "interrupted (Ctrl-C); spectune sweep --resume re-runs this cell"
    elif not server.alive():
        row["status"] = "failed"
        row["error"] = f"server exited during the cell; last log lines: {server.log_tail()}"
    row["finished_at"] = _now()
    frame = None
    if measured:
        frame = request_frame(measured)
        prompts = {r.index: r.prompt if r.prompt is not None else "\n".join(f"{role}: {text}" for role, text in r.messages or ())
                   for r in requests}
        frame["prompt"] = frame["index"].map(prompts)
    store.write_cell(row, frame)
    log(_cell_line(row))
    if interrupted:
        raise KeyboardInterrupt
    return row


def _cell_header(plan: Plan, cell: Cell, digest: str) -> dict:
    s = cell.server
    return {
        "cell": cell.id,
        "server": s.name,
        "engine": s.engine,
        "method": s.method,
        "is_speculative": s.is_speculative,
        "num_speculative_tokens": s.num_speculative_tokens or 0,
        "adaptive_config": s.adaptive_config,
        "batch_size": cell.batch_size,
        "repeat": cell.repeat,
        "workload": plan.workload,
        "traffic_digest": digest,
        "status": "ok",
        "error": None,
        "started_at": _now(),
    }


def _cell_line(row: dict) -> str:
    tput = row.get("output_throughput_tps")
    tpot = row.get("tpot_ms_mean")
    acc = row.get("acceptance_rate")
    parts = [f"[{row['server']}] bs={row['batch_size']} r={row['repeat']} {row['status']}"]
    if tput is not None:
        parts.append(f"{tput:.1f} tok/s")
    if tpot is not None and tpot == tpot:
        parts.append(f"TPOT {tpot:.2f} ms")
    if acc is not None and acc == acc:
        parts.append(f"acceptance {acc:.2f}")
    if row.get("num_failed"):
        parts.append(f"{row['num_failed']} failed requests")
    if row.get("error"):
        parts.append(f"({row['error'].splitlines()[0][:120]})")
    return "  ".join(parts)


def _api_key(spec: ServerSpec) -> str | None:
    return os.environ.get(spec.api_key_env) if spec.api_key_env else None


def _update_progress(store: RunStore, plan: Plan, outcome: SweepOutcome) -> None:
    finished = store.finished_cells()
    store.manifest["progress"] = {
        "total": len(plan_cells(plan)),
        "done": sum(1 for r in finished.values() if r.get("status") == "ok"),
        "failed": sum(1 for r in finished.values() if r.get("status") == "failed"),
        "partial": sum(1 for r in finished.values() if r.get("status") == "partial"),
    }
    store.manifest["updated_at"] = _now()
    if outcome.interrupted:
        store.manifest["status"] = "interrupted"
    elif store.manifest["progress"]["done"] + store.manifest["progress"]["failed"] == len(plan_cells(plan)):
        store.manifest["status"] = "complete"
        store.manifest["finished_at"] = _now()
    store.save_manifest()


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _version() -> str:
    from spectune import __version__

    return __version__


def _hardware() -> dict:
    import psutil

    hw = {"machine": platform.machine(), "processor": platform.processor(), "cpu_count": os.cpu_count(),
          "memory_gb": round(psutil.virtual_memory().total / 2**30, 1), "python": sys.version.split()[0], "gpus": []}
    try:
        import pynvml

        pynvml.nvmlInit()
        hw["gpus"] = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # no NVIDIA driver: a CPU machine
        pass
    return hw
