"""What a sweep shows while it runs. The sweep reports events to a SweepProgress; it never prints itself.

PlainProgress writes one line per server start and per finished cell (CI logs stay readable line by line);
RichProgress keeps a live panel on a terminal: cells done with ETA, the server and cell in flight, requests in
flight, and the last cell's headline figures, with each finished cell's line scrolling above it.
rich is imported only by RichProgress.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TextIO


class SweepProgress:
    """The events of a sweep; every method does nothing here. Subclasses show them."""

    def start(self, total_cells: int, already_done: int, servers: list[str]) -> None:
        """`total_cells` still to measure in this run; `already_done` finished before (a resume); `servers` to
        launch, in order."""

    def server_starting(self, server: str, engine: str, restart: bool, url: str | None = None) -> None:
        """`url`: the server is attached there, not launched."""

    def server_ready(self, server: str, seconds: float) -> None: ...

    def server_failed(self, server: str, error: str) -> None:
        """`error` says what failed: "server did not start: ..." or "could not attach: ..."."""

    def cell_started(self, server: str, batch_size: int, repeat: int, num_requests: int) -> None:
        """`num_requests` counts the warm-up requests too."""

    def requests(self, in_flight: int, finished: int) -> None:
        """Called by the load generator when a request is sent or ends (warm-up included)."""

    def cell_finished(self, row: dict) -> None: ...

    def message(self, text: str) -> None:
        """A line from a later stage (tuning, the report) or a note."""

    def close(self) -> None: ...


def cell_line(row: dict) -> str:
    """One finished cell: server, batch size, repeat, status and its headline figures."""
    rate = f" rate={row['request_rate']:g}/s" if row.get("request_rate") is not None else ""
    parts = [f"[{row['server']}] bs={row['batch_size']}{rate} r={row['repeat']} {row['status']}"]
    parts += headline(row)
    if row.get("num_failed"):
        parts.append(f"{row['num_failed']} failed requests")
    if row.get("error"):
        parts.append(f"({row['error'].splitlines()[0][:120]})")
    return "  ".join(parts)


def starting_line(engine: str, restart: bool, url: str | None) -> str:
    if url:
        return f"{'server is down; attaching again to' if restart else 'attaching to'} {engine} server at {url}"
    return f"{'server is down; restarting' if restart else 'starting'} {engine} server"


def headline(row: dict) -> list[str]:
    """Output tokens/s, mean TPOT and acceptance rate of a cell, where measured."""
    parts = []
    tput, tpot, acc = row.get("output_throughput_tps"), row.get("tpot_ms_mean"), row.get("acceptance_rate")
    if tput is not None and tput == tput:
        parts.append(f"{tput:.1f} tok/s")
    if tpot is not None and tpot == tpot:
        parts.append(f"TPOT {tpot:.2f} ms")
    if acc is not None and acc == acc:
        parts.append(f"acceptance {acc:.2f}")
    return parts


class PlainProgress(SweepProgress):
    """A line per event that matters in a log: server starts and failures, finished cells, stage messages."""

    def __init__(self, write: Callable[[str], None] = print):
        self.write = write

    def server_starting(self, server: str, engine: str, restart: bool, url: str | None = None) -> None:
        self.write(f"[{server}] {starting_line(engine, restart, url)}")

    def server_failed(self, server: str, error: str) -> None:
        self.write(f"[{server}] {error}")

    def cell_finished(self, row: dict) -> None:
        self.write(cell_line(row))

    def message(self, text: str) -> None:
        self.write(text)


class RichProgress(SweepProgress):
    """A live panel on a terminal (see the module docstring). ETA: rich's estimate over the cells done so far,
    a cell in flight counting as the share of its requests that have finished."""

    def __init__(self, file: TextIO | None = None):
        from rich.console import Console

        self.console = Console(file=file)
        self.live = None
        self.bar = None
        self.task = None
        self.cells_done = 0
        self.servers: list[str] = []
        self.server = ""
        self.server_note = ""
        self.cell = ""
        self.cell_requests = 0
        self.in_flight = 0
        self.finished = 0
        self.last = "none yet"

    def start(self, total_cells: int, already_done: int, servers: list[str]) -> None:
        from rich.live import Live
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.bar = Progress(TextColumn("cells"), BarColumn(), MofNCompleteColumn(), TextColumn("elapsed"), TimeElapsedColumn(),
                            TextColumn("ETA"), TimeRemainingColumn(), console=self.console, speed_estimate_period=3600)
        self.task = self.bar.add_task("cells", total=total_cells)
        self.servers = servers
        if already_done:
            self.console.print(f"{already_done} cells already done (resumed run)")
        self.live = Live(self, console=self.console, refresh_per_second=4, transient=True)
        self.live.start()

    def __rich__(self):
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        where = f"{self.servers.index(self.server) + 1}/{len(self.servers)}: " if self.server in self.servers else ""
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold")
        grid.add_column()
        grid.add_row("server", Text(f"{where}{self.server} {self.server_note}".strip() or "-"))
        grid.add_row("cell", Text(self.cell or "-"))
        grid.add_row("requests", Text(f"{self.in_flight} in flight, {self.finished}/{self.cell_requests} done" if self.cell else "-"))
        grid.add_row("last cell", Text(self.last))
        return Group(self.bar, grid)

    def server_starting(self, server: str, engine: str, restart: bool, url: str | None = None) -> None:
        self.server, self.server_note, self.cell = server, f"({starting_line(engine, restart, url)})", ""

    def server_ready(self, server: str, seconds: float) -> None:
        self.server_note = f"(ready in {seconds:.1f} s)"

    def server_failed(self, server: str, error: str) -> None:
        self.console.print(f"[{server}] {error}", style="red", markup=False, highlight=False)

    def cell_started(self, server: str, batch_size: int, repeat: int, num_requests: int) -> None:
        self.cell, self.cell_requests, self.in_flight, self.finished = f"batch size {batch_size}, repeat {repeat}", num_requests, 0, 0

    def requests(self, in_flight: int, finished: int) -> None:
        self.in_flight, self.finished = in_flight, finished
        if self.bar is not None and self.cell_requests:
            self.bar.update(self.task, completed=self.cells_done + min(1.0, finished / self.cell_requests))

    def cell_finished(self, row: dict) -> None:
        self.cells_done += 1
        self.last = cell_line(row)
        if self.bar is not None:
            self.bar.update(self.task, completed=self.cells_done)
        self.console.print(self.last, highlight=False, markup=False)

    def message(self, text: str) -> None:
        self.console.print(text, highlight=False, markup=False)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
