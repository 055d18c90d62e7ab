"""What every engine adapter provides, and the process handling they share.

An adapter turns a ServerSpec into a running server: it launches it (an argument list, never a shell
string), waits until it answers, resets its cache between cells, scrapes its speculative counters, and
stops it and all its children on every exit path.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from spectune import interrupt
from spectune.errors import SpectuneError
from spectune.records import Scrape


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """One server configuration of a sweep plan. `method` None means target-only."""

    name: str  # unique within a plan, e.g. "target", "draft-g4", "ngram-g3"
    engine: str = "embedded"  # embedded | vllm | sglang | llamacpp | openai
    model: str | None = None  # target model path/name (engine default when None)
    tokenizer: str | None = None  # the served model's tokenizer (tokenizer.json or its dir); default: model's, if local
    method: str | None = None  # draft_model | ngram | eagle | eagle3 | mtp | suffix | dflash | ...
    num_speculative_tokens: int | None = None  # g, the draft steps per round
    draft_model: str | None = None
    draft_noise: float | None = None  # embedded draft_model only: the shipped target plus this relative noise as draft
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    adaptive_config: str | None = None  # SGLang-style adaptive_spec.json path
    per_batch_size: tuple[tuple[int, int, int], ...] | None = None  # vLLM [start, end, k] schedule
    url: str | None = None  # attach to a running server instead of launching
    host: str = "127.0.0.1"
    port: int | None = None  # None: pick a free port
    extra_args: tuple[str, ...] = ()  # passed through to the engine's command line
    env: tuple[tuple[str, str], ...] = ()
    api_key_env: str | None = None  # name of the environment variable holding the API key
    ready_timeout_s: float = 300.0

    @property
    def is_speculative(self) -> bool:
        return self.method is not None


class Server(Protocol):
    """The contract every adapter (and the embedded engine's) passes: see tests/test_server_contract.py."""

    spec: ServerSpec
    base_url: str  # e.g. http://127.0.0.1:8000
    model_name: str  # the name to put in request bodies
    extra_body: dict  # engine-specific request fields (e.g. llama-server's timings_per_token)

    def start(self) -> None: ...  # launch (or attach) and block until ready; SpectuneError if it never is
    def reset_cache(self) -> None: ...  # drop prefix caches so repeated prompts are not free
    def scrape(self) -> Scrape: ...  # current counters
    def pid(self) -> int | None: ...  # process to sample memory from (None when attached)
    def alive(self) -> bool: ...
    def stop(self) -> None: ...  # idempotent; stops children too
    def engine_version(self) -> str | None: ...
    def log_tail(self) -> str: ...  # last lines of the server's log, for error messages


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            raise SpectuneError(f"port {host}:{port} is already in use; stop what holds it or choose another port") from None


@dataclass(slots=True, eq=False)  # identity-hashed: kept in the _LIVE set
class ManagedProcess:
    """A server process in its own process group, its output kept in a log file and a short tail."""

    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen | None = None
    _log: object | None = None

    def start(self) -> None:
        if not self.argv or any(not isinstance(a, str) for a in self.argv):
            raise TypeError("argv must be a non-empty list of strings")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        with interrupt.critical():  # a Ctrl-C waits until the process is known to stop_all_servers
            self.popen = subprocess.Popen(
                self.argv,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                start_new_session=True,  # own process group: stop() reaches the engine's children too
                preexec_fn=_die_with_parent,
            )
            _LIVE.add(self)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(deque(f, maxlen=lines)).decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self, grace_s: float = 10.0) -> None:
        p = self.popen
        if p is not None:
            # Signal the whole group and wait for every member, not just the leader: an engine's
            # workers (vLLM's EngineCore) can outlive it and still hold the port and memory.
            if _group_alive(p.pid):
                _signal_group(p.pid, signal.SIGTERM)
                _wait_group_gone(p.pid, grace_s)
            if _group_alive(p.pid):
                _signal_group(p.pid, signal.SIGKILL)
                _wait_group_gone(p.pid, grace_s)
            try:
                p.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None
        _LIVE.discard(self)


def _die_with_parent() -> None:
    """In the child: if spectune itself is SIGKILLed, the kernel sends the server SIGTERM (Linux only)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs (zombies, already dead, do not count)."""
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: a group of zombies still answers, which only makes us wait longer
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the kernel's process table; there is no event to wait on


_LIVE: set[ManagedProcess] = set()


def stop_all_servers() -> None:
    """Stop every process spectune launched; called on every exit path of a sweep."""
    for proc in list(_LIVE):
        proc.stop(grace_s=5.0)


def wait_ready(url: str, proc: ManagedProcess | None, timeout_s: float, what: str) -> None:
    """Poll `url` until it answers 200; fail fast if the process exits, naming its last log lines."""
    deadline = time.monotonic() + timeout_s
    while True:
        interrupt.check()  # a Ctrl-C some library swallowed still stops the wait (engines take minutes to load)
        if proc is not None and not proc.alive():
            code = proc.popen.returncode if proc.popen else None
            raise SpectuneError(
                f"{what} exited with code {code} before it was ready; last log lines:\n{proc.tail()}"
                f"\n(full log: {proc.log_path})"
            )
        try:
            with urllib.request.urlopen(url, timeout=2.0) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            tail = proc.tail() if proc is not None else ""
            raise SpectuneError(
                f"{what} was not ready at {url} after {timeout_s:.0f} s; raise ready_timeout_s or check the server"
                + (f"; last log lines:\n{tail}" if tail else "")
            )
        time.sleep(0.25)  # polling interval, not synchronisation
