"""The results directory: durable, append-only, and loadable after a crash at any moment.

Layout of results/<run>/:
  run.json                    manifest: plan, digests, engine versions, hardware, git sha, progress (rewritten atomically)
  cells/<cell>.json           one finished cell: metrics, acceptance, memory, status (written last: the commit marker);
                              <cell> = <server>__bs<N>__r<R>, open-loop cells <server>__bs<N>__rate<req/s>__r<R>
  requests/<cell>.parquet     that cell's per-request rows (raw chunk timestamps + derived latencies)
  rounds/<server>.jsonl       per-round log of the embedded engine (what the adaptive simulator replays)
  logs/<server>.log           server output
  cells.parquet, requests.parquet, summary.parquet   rebuilt from the files above by finalize()

Every file is written to a temporary name and renamed, so a SIGKILL leaves either the old file or the new
one, never half of one; a cell counts as done only once its cells/<cell>.json exists.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spectune.errors import SpectuneError

if TYPE_CHECKING:
    import pandas as pd


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; a written file gets the mode open() would give it
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process umask (reading it means setting it: set it straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n").encode())


def _json_default(o: object) -> object:
    if hasattr(o, "item"):  # numpy scalars
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def cell_id(server: str, batch_size: int, repeat: int, request_rate: float | None = None) -> str:
    """`target__bs16__r0`; an open-loop cell also names its rate (requests/s): `target__bs16__rate2.5__r0`."""
    if request_rate is None or request_rate != request_rate:  # None or NaN: closed loop or trace
        return f"{server}__bs{batch_size}__r{repeat}"
    return f"{server}__bs{batch_size}__rate{request_rate:g}__r{repeat}"


@dataclass(slots=True)
class RunStore:
    """One run's results directory."""

    root: Path
    manifest: dict = field(default_factory=dict)

    @classmethod
    def create(cls, root: Path, manifest: dict) -> "RunStore":
        if (root / "run.json").exists():
            raise SpectuneError(f"{root}: already holds a run; use --resume {root} to continue it, or choose another --out")
        store = cls(root=root, manifest=manifest)
        for sub in ("cells", "requests", "rounds", "logs"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        store.save_manifest()
        return store

    @classmethod
    def open(cls, root: Path) -> "RunStore":
        path = root / "run.json"
        try:
            manifest = json.loads(path.read_text())
        except FileNotFoundError:
            raise SpectuneError(f"{path}: no run here; pass the results directory a sweep wrote (results/<run>)") from None
        except json.JSONDecodeError as e:
            raise SpectuneError(f"{path}: unreadable manifest ({e}); the cells/ files are intact, re-run with a new --out") from None
        return cls(root=root, manifest=manifest)

    def save_manifest(self) -> None:
        atomic_write_json(self.root / "run.json", self.manifest)

    def finished_cells(self) -> dict[str, dict]:
        out = {}
        for path in sorted((self.root / "cells").glob("*.json")):
            try:
                row = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue  # cannot happen with atomic writes; a hand-edited file is simply re-run
            out[path.stem] = row
        return out

    def write_cell(self, row: dict, requests: "pd.DataFrame | None") -> None:
        cid = cell_id(row["server"], row["batch_size"], row["repeat"], row.get("request_rate"))
        if requests is not None:
            import io

            buf = io.BytesIO()
            requests.to_parquet(buf, index=False)
            atomic_write_bytes(self.root / "requests" / f"{cid}.parquet", buf.getvalue())
        atomic_write_json(self.root / "cells" / f"{cid}.json", row)

    def round_log_path(self, server: str) -> Path:
        return self.root / "rounds" / f"{server}.jsonl"

    def log_dir(self) -> Path:
        return self.root / "logs"

    def finalize(self) -> None:
        """Rebuild the combined Parquet files from the per-cell files."""
        run = load_run(self.root)
        _write_parquet(self.root / "cells.parquet", run.cells)
        _write_parquet(self.root / "requests.parquet", run.requests)
        ok = run.cells[run.cells["status"] == "ok"] if not run.cells.empty else run.cells
        if not ok.empty and (~ok["is_speculative"]).any() and ok["is_speculative"].any():
            from spectune.analysis import speedup_table

            _write_parquet(self.root / "summary.parquet", speedup_table(ok, baseline=first_target(self.manifest, ok)))


def first_target(manifest: dict, cells: "pd.DataFrame") -> str | None:
    """The plan's first target-only server with cells: the speedups' baseline when a plan lists several (a plan
    puts its baseline first); None when the manifest names none."""
    measured = set(cells.loc[~cells["is_speculative"].astype(bool), "server"])
    return next((s["name"] for s in manifest.get("plan", {}).get("servers", []) if not s.get("method") and s.get("name") in measured), None)


def _write_parquet(path: Path, frame: "pd.DataFrame") -> None:
    import io

    buf = io.BytesIO()
    frame.to_parquet(buf, index=False)
    atomic_write_bytes(path, buf.getvalue())


@dataclass(slots=True)
class Run:
    """A loaded results directory."""

    root: Path
    manifest: dict
    cells: "pd.DataFrame"
    requests: "pd.DataFrame"
    round_logs: dict[str, Path]


def load_run(root: str | Path) -> Run:
    """Load a results directory, also one a crash left behind (only finished cells count)."""
    import pandas as pd

    root = Path(root)
    store = RunStore.open(root)
    rows = list(store.finished_cells().values())
    cells = pd.DataFrame(rows)
    if not cells.empty:
        order = ["server", "batch_size", "request_rate", "repeat"] if "request_rate" in cells else ["server", "batch_size", "repeat"]
        cells = cells.sort_values(order, kind="stable").reset_index(drop=True)
    frames = []
    for path in sorted((root / "requests").glob("*.parquet")):
        if (root / "cells" / f"{path.stem}.json").exists():
            frame = pd.read_parquet(path)
            frame.insert(0, "cell", path.stem)
            frames.append(frame)
    requests = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    round_logs = {p.stem: p for p in sorted((root / "rounds").glob("*.jsonl"))}
    return Run(root=root, manifest=store.manifest, cells=cells, requests=requests, round_logs=round_logs)
