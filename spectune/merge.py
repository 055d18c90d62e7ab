"""Runs of one plan, measured at different times, as one results directory: every cell's mean over all their launches.

On a host whose speed drifts, one run measures each cell at one moment; runs hours apart measure it again on fresh
launches, and held out, the model predicts their mean better than any one run (benchmarks/README.md, issue 12). The
runs must have the same plan but for its repeats (the same servers, batch sizes and traffic) and the same hardware; their
repeats are numbered one after another (the first run's 0..r1-1, the next r1.., and so on), each run's round logs and
server logs kept. Each must be complete (a guided sweep's is: every cell it chose). Nothing in them is touched, and
the merged directory appears only once it is whole.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from spectune.errors import SpectuneError
from spectune.store import RunStore, cell_id


@dataclass(slots=True)
class MergeOutcome:
    root: Path
    cells: int
    repeats: list[tuple[Path, int, int]]  # (source, first repeat, last repeat) in the merged run


def merge_runs(sources: list[Path], out: Path) -> MergeOutcome:
    """Write `sources` (results directories of one plan) into `out` as one run."""
    import pandas as pd

    from spectune.distributed import hardware_key
    from spectune.plan import plan_from_dict
    from spectune.sweep import new_manifest

    if len(sources) < 2:
        raise SpectuneError("merge: name two or more results directories of one plan")
    if len({p.resolve() for p in sources}) < len(sources):
        raise SpectuneError("merge: a results directory is named twice; name each run once")
    stores = [RunStore.open(p) for p in sources]
    first = stores[0].manifest
    for store in stores:
        if store.manifest.get("status") != "complete":
            raise SpectuneError(f"{store.root / 'run.json'}: status {store.manifest.get('status')!r}; finish it first "
                                f"(spectune sweep --resume {store.root}), then merge")
    for store in stores[1:]:
        m = store.manifest
        differ = sorted(k for k in set(first["plan"]) | set(m["plan"]) if k != "repeats" and first["plan"].get(k) != m["plan"].get(k))
        if differ:
            raise SpectuneError(f"{store.root / 'run.json'}: plan differs from {sources[0]}'s in {', '.join(differ)}; "
                                "merge only runs of one plan (only repeats may differ)")
        if hardware_key(m.get("hardware") or {}) != hardware_key(first.get("hardware") or {}):
            raise SpectuneError(f"{store.root / 'run.json'}: hardware differs from {sources[0]}'s; runs on different machines are "
                                "never mixed in one comparison (tune them apart)")
    counts = [int(s.manifest["plan"].get("repeats", 1)) for s in stores]
    plan = plan_from_dict({**first["plan"], "repeats": sum(counts)}, source=str(sources[0] / "run.json"))
    manifest = new_manifest(plan, out.name)
    manifest |= {"hardware": first.get("hardware"), "engines": first.get("engines", {}), "git_sha": first.get("git_sha"),
                 "spectune_version": first.get("spectune_version"),
                 "started_at": min(s.manifest["started_at"] for s in stores)}
    if out.exists() and any(out.iterdir()):
        raise SpectuneError(f"{out}: not empty; choose another --out (a merge writes a new results directory)")
    work = out.parent / f".{out.name}.merging"  # renamed to out when complete: a failed merge leaves no half run behind
    shutil.rmtree(work, ignore_errors=True)
    store = RunStore.create(work, manifest)
    offset, spans, merged = 0, [], []
    for source, src, count in zip(sources, stores, counts):
        for cid, row in src.finished_cells().items():
            row = {**row, "repeat": int(row["repeat"]) + offset}
            new = cell_id(row["server"], row["batch_size"], row["repeat"], row.get("request_rate"))
            requests = source / "requests" / f"{cid}.parquet"
            store.write_cell({**row, "cell": new} if "cell" in row else row, pd.read_parquet(requests) if requests.exists() else None)
        for log in sorted((source / "rounds").glob("*.jsonl")):
            with open(store.round_log_path(log.stem), "a") as f:  # as a resumed run's: each launch's rounds after the last
                f.write(log.read_text())
        for log in sorted((source / "logs").glob("*")):
            if log.is_file():
                shutil.copyfile(log, store.log_dir() / f"{source.name}-{log.name}")
        spans.append((source, offset, offset + count - 1))
        merged.append({"path": str(source.resolve()), "run_id": src.manifest.get("run_id"), "repeats": [offset, offset + count - 1],
                       "started_at": src.manifest.get("started_at"), "finished_at": src.manifest.get("finished_at") or src.manifest.get("updated_at"),
                       "git_sha": src.manifest.get("git_sha")})
        offset += count
    finished = store.finished_cells()
    store.manifest["merged_from"] = merged
    store.manifest["progress"] = {"total": manifest["progress"]["total"], "done": sum(r.get("status") == "ok" for r in finished.values()),
                                  "failed": sum(r.get("status") == "failed" for r in finished.values())}
    store.manifest["status"] = "complete"
    store.manifest["finished_at"] = store.manifest["updated_at"] = max(str(m["finished_at"]) for m in merged)
    store.save_manifest()
    store.finalize()
    work.rename(out)
    return MergeOutcome(out, len(finished), spans)
