"""The load generator over several processes, and knowing when one client process is the bottleneck.

Real servers on 127.0.0.1: the scripted aiohttp server (in this process: its write stamps are the truth, on the
clock the workers stamp with) and a flood server in its own process that streams as fast as the socket takes.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import pytest
from scripted_server import ScriptedServer, Step, serve_in_thread

from spectune.clientload import ClientLoad, ProbeResult
from spectune.loadgen import run_cell, run_requests
from spectune.loadworkers import split
from spectune.records import Request
from spectune.workload import ClosedLoop, Poisson

pytestmark = pytest.mark.timeout(180)
HERE = Path(__file__).parent


def completion_requests(n: int, max_tokens: int = 16) -> list[Request]:
    return [Request(index=i, prompt=f"prompt {i}", messages=None, max_tokens=max_tokens) for i in range(n)]


@contextmanager
def flood_server() -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, str(HERE / "flood_server.py")], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def test_split_sends_request_i_to_worker_i_mod_n_with_its_own_offset_and_the_cap_shared():
    requests = completion_requests(7)
    offsets = [0.1 * i for i in range(7)]
    shares = split(requests, offsets, 5, 3, is_warmup=False)
    assert [[r.index for r in s.requests] for s in shares] == [[0, 3, 6], [1, 4], [2, 5]]
    assert [s.offsets for s in shares] == [[0.0, 0.30000000000000004, 0.6000000000000001], [0.1, 0.4], [0.2, 0.5]]
    assert [s.max_concurrency for s in shares] == [2, 2, 1]  # 5 in flight in all
    assert [s.max_concurrency for s in split(requests, offsets, None, 2, is_warmup=False)] == [None, None]


def test_two_workers_return_the_records_one_process_does_on_one_clock():
    schedule = Poisson(rate_per_s=60.0, seed=3, max_concurrency=4)
    requests = completion_requests(10)
    runs = {}
    for workers in (1, 2):
        server = ScriptedServer()
        calls: list[int] = []
        load = ClientLoad()
        with serve_in_thread(server) as url:
            records = run_cell(url, "m", requests, schedule, seed=7, warmup_requests=3, workers=workers, client_load=load,
                               after_warmup=lambda: calls.append(len(server.seen)))
        runs[workers] = records
        assert calls == [3]  # once, after every warm-up request (of both workers) had been sent and had ended
        assert len(load.cpu_shares) == workers  # each process measured its own load
        seen_by_index: dict = {}
        for seen in server.seen:  # in arrival order; the body's seed is 7 + the request's index
            seen_by_index.setdefault(seen.index - 7, []).append(seen)
        for r in records:
            assert r.error is None
            seen = seen_by_index[r.index].pop(0)  # warm-up copies of a request come first, in arrival order
            # one clock: the worker's send, the server's receive and writes, the worker's chunk stamps, in order
            assert r.send_ns <= seen.recv_ns <= seen.write_ns[0] <= r.chunk_ns[0]
            assert all(w <= c for w, c in zip(seen.write_ns, r.chunk_ns)) and r.chunk_ns[-1] <= r.end_ns
            if not r.warmup:
                assert r.intended_ns is not None and r.intended_ns <= r.send_ns
    one, two = runs[1], runs[2]
    assert [(r.warmup, r.index) for r in two] == [(r.warmup, r.index) for r in one]  # same set, same order
    offsets = schedule.send_offsets(requests)
    for records in (one, two):
        measured = [r for r in records if not r.warmup]
        base = measured[0].intended_ns - round(offsets[0] * 1e9)
        assert [r.intended_ns - base for r in measured] == pytest.approx([o * 1e9 for o in offsets], abs=2)
    for a, b in zip(one, two):
        assert (a.chunk_tokens, a.text, a.output_tokens, a.token_source, a.prompt_tokens) == \
            (b.chunk_tokens, b.text, b.output_tokens, b.token_source, b.prompt_tokens)
        assert len(a.chunk_ns) == len(b.chunk_ns)


def test_stopping_a_run_over_workers_closes_streams_and_keeps_finished_records():
    server = ScriptedServer(mode="stall", fail_indices={2, 3}, steps=(Step(0.005, 1), Step(0.005, 1)))
    records: list = []

    async def scenario():
        url = await server.start()
        try:
            task = asyncio.create_task(run_requests(url, "m", completion_requests(4), ClosedLoop(4), stall_timeout_s=60,
                                                    records=records, workers=2))
            while len(records) < 2 or server.num_open < 2:  # wait on the condition, not on a clock
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(400):  # the server sees both stalled connections go away
                if server.num_open == 0:
                    break
                await asyncio.sleep(0.005)
            return server.num_open
        finally:
            await server.stop()

    assert asyncio.run(scenario()) == 0
    assert sorted(r.index for r in records) == [0, 1] and all(r.error is None for r in records)


def test_a_client_flooded_with_chunks_is_marked_saturated():
    load = ClientLoad()
    with flood_server() as url:
        records = run_cell(url, "flood", completion_requests(24, max_tokens=20_000), ClosedLoop(8), client_load=load)
    assert all(r.error is None and r.output_tokens == 20_000 and r.counted_tokens == 20_000 for r in records)
    assert load.saturated, load.row()
    assert load.row()["client_saturated"] is True and load.cpu_share > 0.5
    assert "--workers 2" in load.warning(1)
    # several events per read share their read's stamp: the reader did not take one read per chunk
    assert max(len(set(r.chunk_ns)) for r in records) < 20_000


def test_workers_send_records_larger_than_a_pipe_buffer():
    # 20,000 chunks a request: each record with its raw chunks is megabytes, far above a pipe's 64 KiB
    with flood_server() as url:
        records = run_cell(url, "flood", completion_requests(4, max_tokens=20_000), ClosedLoop(2), workers=2)
    assert [r.index for r in records] == [0, 1, 2, 3]
    assert all(r.error is None and r.counted_tokens == 20_000 and r.output_tokens == 20_000 for r in records)


def test_a_quiet_cell_is_not_marked_saturated():
    load = ClientLoad()
    with serve_in_thread(ScriptedServer()) as url:
        records = run_cell(url, "m", completion_requests(4), ClosedLoop(2), client_load=load)
    assert all(r.error is None for r in records)
    assert not load.saturated and load.warning(1) is None
    assert load.cpu_share < 0.5 and load.loop_lag_ms_p99 is not None and len(load.lags_ms) > 5


def test_bench_with_a_saturated_client_says_so_and_records_it(tmp_path, spectune_cmd):
    out = tmp_path / "bench"
    with flood_server() as url:
        proc = subprocess.run([*spectune_cmd, "bench", "--url", url, "--concurrency", "8", "--num-prompts", "24",
                               "--max-tokens", "20000", "--workload", "random", "--out", str(out)],
                              capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "client saturated" in proc.stdout and "--workers 2" in proc.stdout
    cells = pd.read_parquet(out / "cells.parquet")
    assert bool(cells.loc[0, "client_saturated"]) and cells.loc[0, "client_cpu_share"] > 0.5
    assert json.loads((out / "run.json").read_text())["plan"].get("workers", 1) == 1
    report = subprocess.run([*spectune_cmd, "report", str(out), "--out", str(tmp_path / "report")],
                            capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stdout + report.stderr
    assert "client saturated in 1 cell(s) (server batch 8 r0)" in (tmp_path / "report" / "report.md").read_text()


def test_bench_with_two_workers_writes_one_cell_from_both(tmp_path, spectune_cmd):
    server = ScriptedServer()
    out = tmp_path / "bench"
    with serve_in_thread(server) as url:
        proc = subprocess.run([*spectune_cmd, "bench", "--url", url, "--concurrency", "4", "--num-prompts", "8",
                               "--max-tokens", "16", "--workload", "random", "--workers", "2", "--out", str(out)],
                              capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "client saturated" not in proc.stdout
    cells = pd.read_parquet(out / "cells.parquet")
    assert cells.loc[0, "client_processes"] == 2 and not bool(cells.loc[0, "client_saturated"])
    assert cells.loc[0, "num_requests"] == 8 and cells.loc[0, "num_failed"] == 0
    requests = pd.read_parquet(out / "requests.parquet")
    assert sorted(requests["index"]) == list(range(8))
    assert json.loads((out / "run.json").read_text())["plan"]["workers"] == 2


def test_a_saturated_cell_stopped_before_its_first_tick_still_gets_its_warning():
    """CI found it: a cell interrupted (Ctrl-C) while the client was busy had a CPU share but no event-loop lag yet,
    and the warning's format crashed the sweep instead of ending it with the resume command."""
    load = ClientLoad()
    load.add(ProbeResult(lags_ms=[], cpu_s=0.95, wall_s=1.0))
    assert load.saturated and load.loop_lag_ms_p99 is None
    assert load.warning(1).startswith("client saturated (busiest process 95% of a core):")
