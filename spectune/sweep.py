"""Run a sweep plan: every server, every batch size (and request rate, open loop), every repeat, on identical traffic.

For each server (or all at once with plan.interleave, cells then going repeat by repeat): launch once (with
plan.relaunch: once per repeat), then for each (batch size, rate, repeat) not yet finished: reset its cache, warm up
at the same concurrency, scrape, send the measured requests, scrape again, and write the cell atomically before the
next one starts. A server that dies fails only the cell it died in; it is restarted and the sweep goes on. Ctrl-C
stops it at any moment (spectune.interrupt): the cell in flight is written as partial, finished cells are kept, and
the run resumes with --resume.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from spectune import interrupt
from spectune.errors import SpectuneError
from spectune.plan import Plan, plan_to_dict
from spectune.progress import PlainProgress, SweepProgress
from spectune.servers.base import ServerSpec, stop_all_servers
from spectune.store import RunStore, cell_id


@dataclass(frozen=True, slots=True)
class Cell:
    server: ServerSpec
    batch_size: int  # closed loop: requests in flight; trace and poisson: the cap on them
    repeat: int
    request_rate: float | None = None  # schedule "poisson": requests per second

    @property
    def id(self) -> str:
        return cell_id(self.server.name, self.batch_size, self.repeat, self.request_rate)


@dataclass(slots=True)
class SweepOutcome:
    root: Path
    done: int
    failed: int
    skipped: int  # already finished before a resume
    interrupted: bool


def _rates(plan: Plan) -> tuple[float | None, ...]:
    return plan.request_rates if plan.schedule == "poisson" else (None,)


def plan_cells(plan: Plan) -> list[Cell]:
    """Every cell, server by server; within a server batch size by batch size, or with plan.relaunch repeat by repeat
    (each repeat is a launch)."""
    if plan.relaunch:
        return [Cell(s, bs, r, rate) for s in plan.servers for r in range(plan.repeats) for bs in plan.batch_sizes for rate in _rates(plan)]
    return [Cell(s, bs, r, rate) for s in plan.servers for bs in plan.batch_sizes for rate in _rates(plan) for r in range(plan.repeats)]


def traffic_for(plan: Plan, batch_size: int, request_rate: float | None = None):
    """The exact requests and schedule every server gets at this batch size and rate (a pure function of the plan:
    Poisson arrivals are drawn from the plan's seed, so every server gets the same arrival times)."""
    from spectune.workload import ClosedLoop, Poisson, Trace, load_requests, traffic_digest

    requests = load_requests(plan.workload, num_prompts=plan.num_prompts(batch_size), max_tokens=plan.max_tokens, seed=plan.seed)
    if plan.schedule == "poisson":
        schedule = Poisson(rate_per_s=request_rate, burstiness=plan.burstiness, seed=plan.seed, max_concurrency=batch_size)
    elif plan.schedule == "trace":
        schedule = Trace(max_concurrency=batch_size)
    else:
        schedule = ClosedLoop(concurrency=batch_size)
    digest = traffic_digest(requests, schedule, _sampling(plan))
    return requests, schedule, digest


def traffic_key(batch_size: int, request_rate: float | None = None) -> str:
    """Key of run.json's traffic_digests: "16", or "16@2.5" for 2.5 requests/s capped at 16 in flight."""
    return str(batch_size) if request_rate is None else f"{batch_size}@{request_rate:g}"


def _sampling(plan: Plan) -> dict:
    return {"temperature": plan.temperature, "seed": plan.seed, "ignore_eos": plan.ignore_eos}


def traffic_digests(plan: Plan) -> dict[str, str]:
    return {traffic_key(bs, rate): traffic_for(plan, bs, rate)[2] for bs in plan.batch_sizes for rate in _rates(plan)}


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
    """Raise unless `plan` is the run's, or the run's with more repeats: those are measured on fresh launches at
    another time, so a cell's mean then spans launches (the run's plan, digest and cell count are updated)."""
    m = store.manifest
    recorded = m.get("plan", {}).get("repeats")
    if isinstance(recorded, int) and plan.repeats != recorded and replace(plan, repeats=recorded).digest() == m.get("plan_digest"):
        if plan.repeats < recorded:
            raise SpectuneError(f"{store.root / 'run.json'}: repeats = {plan.repeats} is fewer than the {recorded} this run measures; "
                                f"resume with --repeats {recorded} or more (repeats are only added)")
        m.setdefault("repeats_added", []).append({"at": _now(), "from": recorded, "to": plan.repeats})
        m["plan"], m["plan_digest"] = plan_to_dict(plan), plan.digest()
        m.setdefault("progress", {})["total"] = len(plan_cells(plan))
    if m.get("plan_digest") != plan.digest():
        raise SpectuneError(
            f"{store.root / 'run.json'}: the plan changed since this run started (plan digest differs); "
            "resume with the same plan file and flags (only --repeats may grow), or start a new run with another --out"
        )
    now = traffic_digests(plan)
    if m.get("traffic_digests") != now:
        changed = sorted(k for k in now if m.get("traffic_digests", {}).get(k) != now[k])
        raise SpectuneError(
            f"{store.root / 'run.json'}: the workload changed since this run started (traffic digest differs at batch sizes "
            f"[@rates] {changed}); restore the original workload file or start a new run with another --out"
        )


def run_sweep(plan: Plan, out: Path, *, resume: bool = False, progress: SweepProgress | None = None,
              only: set[str] | None = None) -> SweepOutcome:
    """Measure every cell of the plan into `out` (or only the cells whose ids are in `only`: a guided sweep); on resume
    only the unfinished ones. Owns SIGINT meanwhile. Events go to `progress` (default: a line per server start and per
    cell on stdout)."""
    with interrupt.owned_sigint():
        return _run_sweep(plan, out, resume=resume, progress=progress or PlainProgress(), only=only)


def _run_sweep(plan: Plan, out: Path, *, resume: bool, progress: SweepProgress, only: set[str] | None = None) -> SweepOutcome:
    if resume:
        store = RunStore.open(out)
        check_resumable(store, plan)
        store.manifest["status"] = "running"
        store.manifest.setdefault("resumed_at", []).append(_now())
        with interrupt.critical(stop_after=False):
            store.save_manifest()
    else:
        _preflight(plan)
        with interrupt.critical(stop_after=False):  # from here on a Ctrl-C ends with the resume command
            store = RunStore.create(out, new_manifest(plan, out.name))
    outcome = SweepOutcome(root=out, done=0, failed=0, skipped=0, interrupted=False)
    try:
        finished = store.finished_cells()
        done_ids = {cid for cid, row in finished.items() if row.get("status") in ("ok", "failed")}
        wanted = [c for c in plan_cells(plan) if only is None or c.id in only]
        todo = [c for c in wanted if c.id not in done_ids]
        outcome.skipped = len(wanted) - len(todo)
        progress.start(len(todo), outcome.skipped, [s.name for s in plan.servers if any(c.server.name == s.name for c in todo)])
        if plan.interleave:  # every server up at once
            _run_cells(plan, store, _interleaved(plan, todo), outcome, progress)
        else:  # one server at a time
            for spec in plan.servers:
                cells = [c for c in todo if c.server.name == spec.name]
                if cells:
                    _run_cells(plan, store, cells, outcome, progress)
    except KeyboardInterrupt:
        outcome.interrupted = True
    finally:
        try:
            progress.close()
            with interrupt.critical():  # a Ctrl-C now waits for the servers to stop and the files to be written
                stop_all_servers()
                _update_progress(store, plan, outcome)
                store.finalize()
        except KeyboardInterrupt:
            outcome.interrupted = True
    return outcome


def _preflight(plan: Plan) -> None:
    """Checks that fail before anything launches: bad workload, ports in use, mismatched tokenizers."""
    from spectune.servers.base import check_port_free

    traffic_for(plan, plan.batch_sizes[0], _rates(plan)[0])  # raises on a bad workload file
    for spec in plan.servers:
        if spec.url is None and spec.port is not None:
            check_port_free(spec.host, spec.port)
    from spectune.emit import validate_sglang_config
    from spectune.servers.sglang import speculative_args
    from spectune.tokenizer_check import check_tokenizers

    for spec in plan.servers:
        _served_tokenizer(spec)  # the tokenizer that counts tokens of chunks without counts must load
        if spec.adaptive_config:
            validate_sglang_config(spec.adaptive_config)
        if spec.engine == "sglang" and spec.is_speculative:
            speculative_args(spec)  # inconsistent SGLang flags (e.g. adaptive with topk > 1) fail here, not at launch
        check_tokenizers(spec)


class _Live:
    """One server of the plan: launched on first use, relaunched when it died; `failed` once it never got ready."""

    def __init__(self, plan: Plan, store: RunStore, spec: ServerSpec, progress: SweepProgress):
        from spectune.servers import make_server

        self.spec, self.store, self.progress = spec, store, progress
        self.server = make_server(spec, store.log_dir(), round_log=store.round_log_path(spec.name), max_batch_size=max(plan.batch_sizes))
        self.tokenizer = _served_tokenizer(spec)
        self.started = False
        self.failed: str | None = None
        self.repeat: int | None = None  # the repeat this launch serves (plan.relaunch)

    def ready(self) -> bool:
        if self.failed is not None:
            return False
        if self.started and self.server.alive():
            return True
        spec = self.spec
        self.progress.server_starting(spec.name, spec.engine, restart=self.started, url=spec.url)
        self.server.stop()
        began = time.monotonic()
        try:
            self.server.start()
        except SpectuneError as e:
            self.failed = f"{'could not attach' if spec.url else 'server did not start'}: {e}"
            self.progress.server_failed(spec.name, self.failed)
            return False
        self.progress.server_ready(spec.name, time.monotonic() - began)
        self.started = True
        engines = self.store.manifest["engines"]
        engines[spec.name] = {"engine": spec.engine, "version": self.server.engine_version(), "pid": self.server.pid()}
        exposes = getattr(self.server, "exposes", None)  # an attached server: what it was found to tell about itself
        if exposes is not None:
            engines[spec.name]["exposes"] = exposes
            self.progress.message(f"[{spec.name}] acceptance from: {', '.join(exposes) or 'nothing (no speculative counters found)'}")
        with interrupt.critical():
            self.store.save_manifest()
        return True

    def measure(self, plan: Plan, cell: Cell, outcome: SweepOutcome) -> None:
        """Measure `cell`, or write it failed when this server cannot be got ready."""
        if plan.relaunch and self.started and cell.repeat != self.repeat:
            self.progress.message(f"[{self.spec.name}] repeat {cell.repeat} on a fresh launch (relaunch = true)")
            self.server.stop()
            self.started = False
        self.repeat = cell.repeat
        if not self.ready():
            with interrupt.critical():
                self.store.write_cell({**_cell_header(plan, cell, traffic_for(plan, cell.batch_size, cell.request_rate)[2]),
                                       "status": "failed", "error": self.failed, "finished_at": _now()}, None)
                outcome.failed += 1
            return
        row = _measure_cell(plan, self.store, self.server, cell, self.progress, self.tokenizer)
        if row["status"] == "failed":
            outcome.failed += 1
            if not self.spec.is_speculative and row.get("num_drafts"):  # it speculates: its other cells would too
                self.failed = row["error"]
                self.progress.server_failed(self.spec.name, self.failed)
        else:
            outcome.done += 1
        with interrupt.critical():
            _update_progress(self.store, plan, outcome)


def _run_cells(plan: Plan, store: RunStore, cells: list[Cell], outcome: SweepOutcome, progress: SweepProgress) -> None:
    """Measure `cells` in their order, each server launched at its first cell; all stopped at the end."""
    lives = {s.name: _Live(plan, store, s, progress) for s in plan.servers if any(c.server.name == s.name for c in cells)}
    try:
        for cell in cells:
            interrupt.check()
            lives[cell.server.name].measure(plan, cell, outcome)
    finally:
        for live in lives.values():
            live.server.stop()


def _interleaved(plan: Plan, cells: list[Cell]) -> list[Cell]:
    """plan.interleave's order: repeat by repeat and, at each batch size, server after server, so a change in the
    host's speed during the sweep falls on every server alike (speedups pair cells measured seconds apart, not one
    server's whole sweep apart)."""
    order = {s.name: i for i, s in enumerate(plan.servers)}
    return sorted(cells, key=lambda c: (c.repeat, plan.batch_sizes.index(c.batch_size), c.request_rate or 0.0, order[c.server.name]))


def _served_tokenizer(spec: ServerSpec):
    """The served model's tokenizer (spectune.tokens.tokenizer_path), or None when none is known."""
    from spectune.tokens import load_tokenizer, tokenizer_path

    path = tokenizer_path(spec.model, spec.tokenizer, spec.engine)
    where = f"server {spec.name!r}: tokenizer" if spec.tokenizer else f"server {spec.name!r}: model"
    return load_tokenizer(path, where) if path is not None else None


def _measure_cell(plan: Plan, store: RunStore, server, cell: Cell, progress: SweepProgress, tokenizer=None) -> dict:
    from spectune.analysis import Slo, acceptance, request_frame, summarize_cell
    from spectune.clientload import ClientLoad
    from spectune.loadgen import event_loop_factory, run_requests
    from spectune.hostload import ForeignLoad
    from spectune.servers.memory import MemorySampler
    from spectune.servers.running import GaugeSampler, in_flight_mean, log_size, round_log_batch_mean

    requests, schedule, digest = traffic_for(plan, cell.batch_size, cell.request_rate)
    row: dict = _cell_header(plan, cell, digest)
    records: list = []
    common = dict(temperature=plan.temperature, seed=plan.seed, ignore_eos=plan.ignore_eos, api_key=_api_key(cell.server),
                  request_timeout_s=plan.request_timeout_s, stall_timeout_s=plan.stall_timeout_s,
                  extra_body=server.extra_body or None, tokenizer=tokenizer)
    warmup = plan.warmup_per_slot * cell.batch_size
    progress.cell_started(cell.server.name, cell.batch_size, cell.repeat, warmup + len(requests))
    sampler = MemorySampler(server.pid())
    round_log = getattr(server, "round_log", None)  # the embedded engine logs its rounds
    # open loop: the batch size the server ran is not the cell's; without a round log, sample its running gauge
    gauge = GaugeSampler(lambda: server.scrape().num_running) if cell.request_rate is not None and round_log is None else None
    offsets: dict[str, int | None] = {}
    foreign = ForeignLoad([os.getpid(), server.pid()])
    interrupted = False
    undeclared: str | None = None
    client_load = ClientLoad()
    try:
        sampler.start()
        foreign.start()
        scrapes: list = []

        def reset_and_scrape() -> None:  # a warm-up fills the prefix cache with these very prompts
            server.reset_cache()
            scrapes.append(server.scrape())
            offsets["start"] = log_size(round_log)
            if gauge is not None:
                gauge.start()

        if not warmup:
            reset_and_scrape()
        interrupt.run(run_requests(server.base_url, server.model_name, requests, schedule, records=records,
                                   warmup_requests=warmup, after_warmup=reset_and_scrape if warmup else None,
                                   on_requests=progress.requests, workers=plan.workers, client_load=client_load, **common),
                      loop_factory=event_loop_factory())
        before = scrapes[0]
        after = server.scrape()
        offsets["end"] = log_size(round_log)
        acc = acceptance(before, after)
        row["acceptance_rate"], row["acceptance_length"] = acc.rate, acc.mean_length
        row["num_drafts"], row["num_accepted_tokens"] = acc.num_drafts, acc.num_accepted_tokens  # the counters' deltas
        for i, rate in enumerate(acc.per_pos, start=1):
            row[f"accept_pos_{i}"] = rate
        row["kv_cache_usage"] = after.kv_cache_usage
        row["server_pid"] = server.pid()  # which launch measured the cell (None: attached)
        row["live_num_steps"] = after.num_steps
        undeclared = _undeclared_drafting(plan, cell.server, before, after)
    except KeyboardInterrupt:
        interrupted = True
    except Exception as e:  # a scrape or transport failure fails this cell, not the sweep
        row["status"], row["error"] = "failed", f"{type(e).__name__}: {e}"
    finally:
        mem = sampler.stop()
        row["foreign_cpu_cores"] = foreign.stop()  # other work on this machine during the cell (spectune.hostload)
        row["mem_peak_mb"], row["mem_mean_mb"], row["mem_source"] = mem.peak_mb, mem.mean_mb, mem.source
        gauged = gauge.stop() if gauge is not None else None
    measured = [r for r in records if not r.warmup]
    slo = Slo(ttft_ms=plan.slo_ttft_ms, tpot_ms=plan.slo_tpot_ms, e2e_ms=plan.slo_e2e_ms)
    row.update(summarize_cell(measured, slo if slo != Slo() else None))
    row.update(client_load.row())  # is the client the bottleneck? (spectune.clientload)
    if client_load.saturated:
        progress.message(f"[{cell.server.name}] batch {cell.batch_size}: {client_load.warning(plan.workers)}")
    for source, ran in (("round_log", round_log_batch_mean(round_log, offsets.get("start"), offsets.get("end"))),
                        ("gauge", gauged), ("client", in_flight_mean(measured))):
        if ran is not None:
            row["batch_size_ran"], row["batch_size_ran_source"] = ran, source
            break
    if interrupted:
        row["status"], row["error"] = "partial", "interrupted (Ctrl-C); spectune sweep --resume re-runs this cell"
    elif not server.alive():
        row["status"] = "failed"
        row["error"] = f"server exited during the cell; last log lines: {server.log_tail()}"
    elif undeclared is not None:
        row["status"], row["error"] = "failed", undeclared
    row["finished_at"] = _now()
    frame = None
    if measured:
        frame = request_frame(measured)
        prompts = {r.index: r.prompt if r.prompt is not None else "\n".join(f"{role}: {text}" for role, text in r.messages or ())
                   for r in requests}
        frame["prompt"] = frame["index"].map(prompts)
    with interrupt.critical():  # a finished cell is written whole, whenever Ctrl-C comes
        store.write_cell(row, frame)
    progress.cell_finished(row)
    if interrupted:
        raise KeyboardInterrupt
    return row


def _undeclared_drafting(plan: Plan, spec: ServerSpec, before, after) -> str | None:
    """Why a server the plan calls target-only cannot be measured as one: its counters show it drafting (an
    attached speculative server, or speculation passed in extra_args). Taken for a baseline, it would make every
    speedup wrong. A plan of one server (spectune bench) compares nothing, so there it is only measured."""
    drafts = (after.num_drafts or 0) - (before.num_drafts or 0)
    if spec.is_speculative or len(plan.servers) < 2 or drafts <= 0:
        return None
    tokens = (after.num_draft_tokens or 0) - (before.num_draft_tokens or 0)
    accepted = (after.num_accepted_tokens or 0) - (before.num_accepted_tokens or 0)
    steps = f"{tokens / drafts:.1f} draft tokens a round, {accepted / tokens:.0%} accepted" if tokens > 0 else "its counters"
    return (f"server {spec.name!r} speculates ({drafts:.0f} rounds drafted, {steps}) but its [[servers]] table has no "
            f"`method`, so it would count as target-only; declare what it runs (method, num_speculative_tokens"
            f"{f' = {round(tokens / drafts)}' if tokens > 0 else ''}; attached: engine = \"vllm\", \"sglang\", \"llamacpp\" "
            "or \"embedded\" with its url, not \"openai\"), or point it at a server that does not speculate")


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
        "schedule": plan.schedule,
        "request_rate": cell.request_rate,
        "workload": plan.workload,
        "traffic_digest": digest,
        "status": "ok",
        "error": None,
        "started_at": _now(),
    }


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
