"""Sweeps spread over machines: the cells of one plan shared by workers through one Optuna study on RDB storage.

`spectune sweep PLAN --storage URL --worker` on each machine joins the study named after the plan's digest. The
first worker to create it enqueues one trial per cell (param "cell", the cell id). Every worker then claims waiting
trials (study.ask pops one, atomically in the storage), measures the cell on its own servers into a scratch results
directory, and records it on the trial: the cell row, the per-request frame (Parquet, base64), the slice of the
embedded engine's round log and the machine's hardware. While it measures, a thread records the trial's heartbeat;
a worker that dies stops beating, and after the grace period the next worker to look fails the trial
(optuna.storages.fail_stale_trials) and Optuna's retry callback enqueues the cell again; a worker stopped by
Ctrl-C hands its cell back at once. A worker stops when no cell waits and none is running.

`spectune collect URL --out DIR` writes the finished cells as a results directory in the usual layout
(spectune.store), one directory per hardware (DIR/<hardware> when the workers' machines differ), so that no
comparison mixes machines.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from spectune import interrupt
from spectune.errors import SpectuneError

HEARTBEAT_S = 10.0  # a running cell's heartbeat period
GRACE_FACTOR = 3  # a cell whose worker missed this many heartbeats goes to another
MAX_RETRY = 3  # times a cell is given to another worker after its worker died
POLL_S = 1.0  # how often an idle worker looks for cells freed by a dead worker
READY_TIMEOUT_S = 120.0  # how long a joining worker waits for the first to enqueue the cells


@dataclass(slots=True)
class WorkerOutcome:
    study_name: str
    measured: list[str]  # cell ids this worker finished
    failed: int  # of those, cells whose status is "failed"
    scratch: Path  # its own results directory: the server logs of the cells it measured


def study_name(plan) -> str:
    return f"spectune-sweep-{plan.name}-{plan.digest()[:12]}"


def sweep_storage(url: str, heartbeat_s: float = HEARTBEAT_S):
    """The RDB storage with heartbeats and retry of cells whose worker died (Optuna >= 4.9 names the callback
    RetryHeartbeatStaleTrialCallback; before, RetryFailedTrialCallback)."""
    import warnings

    import optuna.storages

    from spectune.search import storage_for

    # ask/tell with heartbeats is what a worker needs; Optuna flags it as experimental and meant for optimize()
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
    beats = dict(heartbeat_interval=max(1, round(heartbeat_s)), grace_period=max(2, round(GRACE_FACTOR * heartbeat_s)))
    if hasattr(optuna.storages, "RetryHeartbeatStaleTrialCallback"):
        retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY)
        return storage_for(url, **beats, heartbeat_stale_trial_callback=retry)
    return storage_for(url, **beats, failed_trial_callback=optuna.storages.RetryFailedTrialCallback(max_retry=MAX_RETRY))


def join_study(url: str, plan, heartbeat_s: float = HEARTBEAT_S, log: Callable[[str], None] = print):
    """Create the plan's study and enqueue its cells, or join it once the worker that created it has."""
    import optuna
    import sqlalchemy.exc

    from spectune.plan import plan_to_dict
    from spectune.sweep import plan_cells

    if plan.schedule == "poisson" or plan.budget is not None:
        raise SpectuneError("--worker: a shared sweep measures every cell of a closed-loop or trace plan; remove budget / "
                            "request_rates from the plan")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage, name = sweep_storage(url, heartbeat_s), study_name(plan)
    try:
        study = optuna.create_study(storage=storage, study_name=name, direction="maximize")
    except (optuna.exceptions.DuplicatedStudyError, sqlalchemy.exc.IntegrityError):
        study = optuna.load_study(storage=storage, study_name=name)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while "cells" not in study.user_attrs:  # the creator enqueues, then writes "cells" last
            if time.monotonic() > deadline:
                raise SpectuneError(f"study {name}: its cells were never enqueued (the worker that created it died first?); "
                                    "delete the study (optuna delete-study) and start the workers again")
            time.sleep(0.2)
        return study
    ids = [c.id for c in plan_cells(plan)]
    for cid in ids:
        study.enqueue_trial({"cell": cid})
    study.set_user_attr("plan", plan_to_dict(plan))
    study.set_user_attr("cells", ids)
    log(f"study {name}: {len(ids)} cells enqueued")
    return study


def run_worker(plan, url: str, *, scratch: Path | None = None, heartbeat_s: float = HEARTBEAT_S,
               log: Callable[[str], None] = print) -> WorkerOutcome:
    """Claim and measure cells of the plan's shared study until none is left."""
    from optuna.storages import fail_stale_trials
    from optuna.trial import TrialState

    from spectune.store import RunStore
    from spectune.sweep import new_manifest, plan_cells

    study = join_study(url, plan, heartbeat_s, log)
    if plan.interleave:
        log("interleave = true is for one machine: a worker keeps one server up at a time and measures the cells it "
            "claims in the study's order, so a slow stretch of its host falls on the cells it measured meanwhile")
    cells = {c.id: c for c in plan_cells(plan)}
    root = Path(scratch or tempfile.mkdtemp(prefix="spectune-worker-"))
    store = RunStore.open(root) if (root / "run.json").exists() else RunStore.create(root, new_manifest(plan, root.name))
    outcome = WorkerOutcome(study.study_name, [], 0, root)
    worker = f"{socket.gethostname()}:{os.getpid()}"
    server = _Servers(plan, store)
    claimed = None  # (trial, cell id) while this worker holds a cell
    try:
        with interrupt.owned_sigint():
            while True:
                interrupt.check()
                fail_stale_trials(study)  # a dead worker's cell goes back to the queue (the retry callback)
                if not study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
                    if not study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                        break
                    time.sleep(POLL_S)  # a cell is running elsewhere: it finishes, or its worker dies and it returns
                    continue
                with interrupt.critical(stop_after=False):  # a claim is never cut in half by Ctrl-C
                    trial = study.ask()
                    study._storage.record_heartbeat(trial._trial_id)  # from the claim on: a worker that dies now is seen as dead
                    if "fixed_params" not in study._storage.get_trial_system_attrs(trial._trial_id):
                        # another worker took the last waiting cell first, so ask() made a fresh trial: not a cell
                        trial.set_user_attr("spare", "no cell left to claim")
                        study.tell(trial, state=TrialState.FAIL)
                        continue
                    cid = trial.suggest_categorical("cell", list(cells))
                    trial.set_user_attr("worker", worker)
                    claimed = (trial, cid)
                log(f"claimed {cid} (trial {trial.number})")
                with _Heartbeat(study._storage, trial._trial_id, heartbeat_s):
                    row, frame, rounds = server.measure(cells[cid])
                with interrupt.critical(stop_after=False):  # a measured cell is recorded whole
                    claimed = None
                    try:
                        _record(trial, row, frame, rounds)
                        study.tell(trial, float(row.get("output_throughput_tps") or 0.0))
                    except Exception as e:  # e.g. judged dead meanwhile and retried elsewhere: that measurement counts
                        log(f"{cid}: not recorded ({type(e).__name__}: {e})")
                        continue
                outcome.measured.append(cid)
                outcome.failed += row.get("status") == "failed"
                log(f"finished {cid}: {row.get('status')}")
    except KeyboardInterrupt:
        if claimed is not None:
            _hand_back(study, *claimed)
            log(f"interrupted: {claimed[1]} handed back to the study, for another worker (or this one started again)")
        raise
    finally:
        server.stop()
    return outcome


def _hand_back(study, trial, cid: str) -> None:
    """A cell whose worker was stopped by Ctrl-C waits again at once, rather than after the heartbeat's grace."""
    from optuna.trial import TrialState

    try:
        trial.set_user_attr("interrupted", "Ctrl-C; the cell was enqueued again")
        study.tell(trial, state=TrialState.FAIL)
    except Exception:  # already failed as stale by another worker, whose retry enqueued it: once is enough
        return
    study.enqueue_trial({"cell": cid})


class _Servers:
    """The server of the cell being measured; kept running while consecutive cells use it."""

    def __init__(self, plan, store) -> None:
        self.plan, self.store = plan, store
        self.server, self.spec = None, None
        self.repeat: int | None = None  # the repeat the running launch serves (plan.relaunch)

    def measure(self, cell) -> tuple[dict, bytes | None, str]:
        from spectune.progress import PlainProgress
        from spectune.servers import make_server
        from spectune.sweep import _cell_header, _measure_cell, _now, _served_tokenizer, traffic_for

        progress = PlainProgress(lambda _: None)
        rounds_path = self.store.round_log_path(cell.server.name)
        before = rounds_path.stat().st_size if rounds_path.exists() else 0
        relaunch = self.plan.relaunch and cell.repeat != self.repeat
        self.repeat = cell.repeat
        if self.spec != cell.server or relaunch or not self.server.alive():
            self.stop()
            self.server = make_server(cell.server, self.store.log_dir(), round_log=rounds_path, max_batch_size=max(self.plan.batch_sizes))
            self.spec = cell.server
            try:
                self.server.start()
            except SpectuneError as e:
                self.spec = None
                row = {**_cell_header(self.plan, cell, traffic_for(self.plan, cell.batch_size)[2]),
                       "status": "failed", "error": f"server did not start: {e}", "finished_at": _now()}
                return row, None, ""
        row = _measure_cell(self.plan, self.store, self.server, cell, progress, _served_tokenizer(cell.server))
        requests = self.store.root / "requests" / f"{cell.id}.parquet"
        frame = requests.read_bytes() if requests.exists() else None
        rounds = ""
        if rounds_path.exists():
            with open(rounds_path, "rb") as f:
                f.seek(before)
                rounds = f.read().decode()
        return row, frame, rounds

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.server = None


def _hardware_record() -> dict:
    from spectune.sweep import _hardware

    return {**_hardware(), "host": socket.gethostname()}


def hardware_key(hardware: dict) -> str:
    """What makes two machines the same for a comparison: the CPU, its core count, memory and GPUs (not the host name)."""
    same = {k: hardware.get(k) for k in ("machine", "processor", "cpu_count", "memory_gb", "gpus")}
    return hashlib.sha256(json.dumps(same, sort_keys=True).encode()).hexdigest()[:8]


class _Heartbeat:
    """Records a running trial's heartbeat every period from a thread until the block ends."""

    def __init__(self, storage, trial_id: int, period_s: float) -> None:
        self.storage, self.trial_id, self.period_s = storage, trial_id, period_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self) -> None:
        while True:
            self.storage.record_heartbeat(self.trial_id)
            if self.stop.wait(self.period_s):
                return

    def __enter__(self) -> "_Heartbeat":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def _pack(data: bytes) -> str:
    return base64.b64encode(gzip.compress(data)).decode()


def _unpack(text: str) -> bytes:
    return gzip.decompress(base64.b64decode(text))


def _record(trial, row: dict, frame: bytes | None, rounds: str) -> None:
    hardware = _hardware_record()
    row = {**row, "hardware_key": hardware_key(hardware), "host": hardware["host"]}  # columns of the collected cells
    trial.set_user_attr("hardware", hardware)
    trial.set_user_attr("row", json.loads(json.dumps(row, default=_json_default)))
    if frame is not None:
        trial.set_user_attr("requests_parquet", _pack(frame))
    if rounds:
        trial.set_user_attr("rounds", _pack(rounds.encode()))


def _json_default(o: object) -> object:
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def collect(url: str, out: Path, study: str | None = None, log: Callable[[str], None] = print) -> list[Path]:
    """Write the study's finished cells as results directories (one per hardware); returns their paths."""
    import io

    import optuna
    import pandas as pd
    from optuna.trial import TrialState

    from spectune.plan import plan_from_dict
    from spectune.search import redact, storage_for
    from spectune.store import RunStore, cell_id
    from spectune.sweep import new_manifest

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise SpectuneError(f"{out}: not empty; choose another --out, or remove it to collect again (collect writes a new "
                            "results directory from the study)")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = storage_for(url)
    names = [s.study_name for s in optuna.get_all_study_summaries(storage) if s.study_name.startswith("spectune-sweep-")]
    if study is None:
        if len(names) != 1:
            raise SpectuneError(f"{redact(url)}: {len(names)} sweep studies ({', '.join(names) or 'none'}); name one with --study")
        study = names[0]
    elif study not in names:
        raise SpectuneError(f"--study {study}: not in {redact(url)} (sweep studies: {', '.join(names) or 'none'})")
    s = optuna.load_study(study_name=study, storage=storage)
    plan = plan_from_dict(s.user_attrs["plan"], source=f"study {study}")
    done: dict[str, optuna.trial.FrozenTrial] = {}
    for t in s.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        row = t.user_attrs.get("row")
        if row is None:
            continue
        done.setdefault(cell_id(row["server"], row["batch_size"], row["repeat"], row.get("request_rate")), t)
    groups: dict[str, list] = {}
    for t in done.values():
        groups.setdefault(t.user_attrs["row"]["hardware_key"], []).append(t)
    if not groups:
        raise SpectuneError(f"study {study}: no finished cell yet; run workers first (spectune sweep PLAN --storage URL --worker)")
    work = out.parent / f".{out.name}.collecting"  # renamed to out when complete: a failed collect leaves no half run behind
    shutil.rmtree(work, ignore_errors=True)
    paths, said = [], []
    for key, trials in sorted(groups.items()):
        name = out.name if len(groups) == 1 else f"hw-{key}"
        root = work if len(groups) == 1 else work / name
        manifest = new_manifest(plan, name)
        manifest["hardware"] = trials[0].user_attrs["hardware"]
        manifest["collected_from"] = {"storage": redact(url), "study": study,
                                      "workers": sorted({t.user_attrs.get("worker", "?") for t in trials})}
        store = RunStore.create(root, manifest)
        rounds: dict[str, list[str]] = {}
        for t in sorted(trials, key=lambda t: t.number):
            row = t.user_attrs["row"]
            packed = t.user_attrs.get("requests_parquet")
            store.write_cell(row, pd.read_parquet(io.BytesIO(_unpack(packed))) if packed else None)
            if "rounds" in t.user_attrs:
                rounds.setdefault(row["server"], []).append(_unpack(t.user_attrs["rounds"]).decode())
        for server, parts in rounds.items():
            store.round_log_path(server).write_text("".join(parts))
        finished = store.finished_cells()
        store.manifest["progress"] = {"total": len(s.user_attrs["cells"]), "done": sum(r.get("status") == "ok" for r in finished.values()),
                                      "failed": sum(r.get("status") == "failed" for r in finished.values())}
        if len(groups) == 1 and len(finished) == len(s.user_attrs["cells"]):
            store.manifest["status"] = "complete"
        store.save_manifest()
        store.finalize()
        paths.append(out if len(groups) == 1 else out / name)
        said.append(f"{paths[-1]}: {len(trials)} cells (hardware {key}: "
                    f"{manifest['hardware'].get('processor') or manifest['hardware'].get('machine')}, {manifest['hardware'].get('cpu_count')} cores)")
    work.rename(out)
    for line in said:
        log(line)
    return paths
