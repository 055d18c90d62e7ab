"""spectune's load generator as a client process: closed loop at N streams, records and summary to JSON.

    python -m loadgen_bench.spectune_client URL STREAMS NUM_REQUESTS MAX_TOKENS OUT.json [--cprofile OUT.prof]
        [--workers N]

Uses spectune.loadgen.run_cell and spectune.analysis.summarize_cell exactly as `spectune bench` does, and
writes what spectune.clientload said of its own load (client_saturated).
"""

from __future__ import annotations

import argparse
import cProfile
import json
from dataclasses import asdict
from pathlib import Path

from spectune.analysis import summarize_cell
from spectune.clientload import ClientLoad
from spectune.loadgen import run_cell
from spectune.records import Request
from spectune.workload import ClosedLoop


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("streams", type=int)
    parser.add_argument("num_requests", type=int)
    parser.add_argument("max_tokens", type=int)
    parser.add_argument("out", type=Path)
    parser.add_argument("--cprofile", type=Path, default=None)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    requests = [Request(index=i, prompt=f"request {i}: say something", messages=None, max_tokens=args.max_tokens)
                for i in range(args.num_requests)]
    profiler = cProfile.Profile() if args.cprofile else None
    if profiler:
        profiler.enable()
    load = ClientLoad()
    records = run_cell(args.url, "emitter", requests, ClosedLoop(args.streams), request_timeout_s=600.0,
                       workers=args.workers, client_load=load)
    if profiler:
        profiler.disable()
        profiler.dump_stats(args.cprofile)
    sources = sorted({r.token_source for r in records})
    out = {"records": [asdict(r) for r in records], "summary": summarize_cell(records), "token_source": ",".join(sources),
           "client_load": load.row(), "deferred_cpu_s": load.deferred_cpu_s}
    args.out.write_text(json.dumps(out))


if __name__ == "__main__":
    main()
