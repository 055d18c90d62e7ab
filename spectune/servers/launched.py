"""What the adapters that launch a server process share: a free port, the process in its own group,
readiness (GET /health, then /v1/models lists the served name), attach mode (spec.url), stop. Each engine
subclass supplies its command line, scrape and cache reset.

Each launch runs with a temp dir of its own (TMPDIR), removed when it stops: vLLM and SGLang name their ZMQ sockets
there (and vLLM its torch.distributed init file) and never remove them, so every launch left files in /tmp. The dir
is named for spectune's pid; one whose spectune was killed is removed at the next launch.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import psutil

from spectune.errors import SpectuneError
from spectune.records import Scrape
from spectune.servers.base import (
    ManagedProcess,
    ServerSpec,
    check_port_free,
    free_port,
    wait_ready,
)
from spectune.servers.scrape import http_get


TMP_PREFIX = "spectune-server-"


def _remove_orphaned_tmp_dirs() -> None:
    """The temp dirs of launches whose spectune is gone (a SIGKILL leaves it no time to remove them)."""
    for d in Path(tempfile.gettempdir()).glob(f"{TMP_PREFIX}*-*"):
        pid = d.name[len(TMP_PREFIX):].split("-")[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def spectune_cache() -> Path:
    """Where install-engines.sh puts the engines: $SPECTUNE_CACHE, else ~/.cache/spectune."""
    return Path(os.environ.get("SPECTUNE_CACHE", Path.home() / ".cache" / "spectune")).expanduser()


class LaunchedServer:
    """Base of the vLLM, SGLang, llama.cpp and embedded adapters. Not a server on its own."""

    engine = "server"  # the engine's name in messages
    health_path = "/health"  # answers 200 once the model is loaded (no API key needed)

    extra_body: dict = {}  # fields every request body to this engine needs (read-only)

    def __init__(self, spec: ServerSpec, log_dir: Path):
        self.spec = spec
        self.log_dir = Path(log_dir)
        self.base_url = spec.url.rstrip("/") if spec.url else ""
        self.model_name = spec.name  # launched servers serve the model under the spec's name
        self._proc: ManagedProcess | None = None
        self._tmp_dir: str | None = None  # the launch's TMPDIR

    # --- what each engine supplies
    def command(self, port: int) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        return dict(self.spec.env)

    def scrape(self) -> Scrape:
        raise NotImplementedError

    def reset_cache(self) -> None:
        raise NotImplementedError

    def engine_version(self) -> str | None:
        return None

    # --- shared
    @property
    def is_attached(self) -> bool:
        return self.spec.url is not None

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.spec.name}.log"

    def start(self) -> None:
        if self.is_attached:
            wait_ready(self.base_url + self.health_path, None, self.spec.ready_timeout_s, f"{self.engine} at {self.base_url}")
            self.model_name = self._attached_model_name()
            return
        if self._proc is not None and self._proc.alive():
            return
        port = self.spec.port
        if port is None:
            port = free_port(self.spec.host)
        else:
            check_port_free(self.spec.host, port)
        argv = self.command(port)
        self.base_url = f"http://{self.spec.host}:{port}"
        if self._tmp_dir is None:
            _remove_orphaned_tmp_dirs()
            self._tmp_dir = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-")  # short: a socket's path has <= 107 bytes
        self._proc = ManagedProcess(argv=argv, log_path=self.log_path, env={"TMPDIR": self._tmp_dir, **self.environment()})
        try:
            self._proc.start()
            wait_ready(self.base_url + self.health_path, self._proc, self.spec.ready_timeout_s, f"{self.engine} server {self.spec.name!r}")
            if self.model_name not in self._listed_models():
                raise SpectuneError(f"{self.base_url}/v1/models does not list {self.model_name!r}; check the server's log {self.log_path}")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        proc, self._proc = self._proc, None  # a second stop finds nothing to signal
        if proc is not None:
            proc.stop()
        tmp_dir, self._tmp_dir = self._tmp_dir, None
        if tmp_dir is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)

    def pid(self) -> int | None:
        if self._proc is None or self._proc.popen is None:
            return None
        return self._proc.popen.pid

    def alive(self) -> bool:
        if not self.is_attached:
            return self._proc is not None and self._proc.alive()
        try:
            http_get(self.base_url + self.health_path, timeout_s=5.0, headers=self.auth_headers())
            return True
        except SpectuneError:
            return False

    def log_tail(self, lines: int = 20) -> str:
        return self._proc.tail(lines) if self._proc is not None else ""

    def auth_headers(self) -> dict[str, str]:
        """Bearer auth from the variable named by spec.api_key_env; the key itself is never logged."""
        if not self.spec.api_key_env:
            return {}
        key = os.environ.get(self.spec.api_key_env)
        if not key:
            raise SpectuneError(
                f"server {self.spec.name!r}: api_key_env names {self.spec.api_key_env}, which is not set; export it"
            )
        return {"Authorization": f"Bearer {key}"}

    def _listed_models(self) -> list[str]:
        """GET /v1/models, with the API key when one is set: also proves the OpenAI API answers."""
        url = self.base_url + "/v1/models"
        try:
            data = json.loads(http_get(url, headers=self.auth_headers()))["data"]
            return [m["id"] for m in data if isinstance(m, dict) and m.get("id")]
        except (ValueError, TypeError, KeyError):
            raise SpectuneError(f"{url} did not answer an OpenAI model list; is this an OpenAI-compatible server?") from None

    def _attached_model_name(self) -> str:
        """spec.model when given (and listed), else the first model the server lists."""
        ids = self._listed_models()
        if self.spec.model:
            if ids and self.spec.model not in ids:
                raise SpectuneError(f"{self.base_url} serves {ids}, not {self.spec.model!r}; fix `model` of server {self.spec.name!r}")
            return self.spec.model
        if not ids:
            raise SpectuneError(f"{self.base_url}/v1/models lists no model; set `model` for server {self.spec.name!r}")
        return ids[0]


def option_given(args: tuple[str, ...] | list[str], *names: str) -> bool:
    """Whether the user already passed one of these flags in extra_args (as `--flag v` or `--flag=v`)."""
    return any(a in names or a.split("=", 1)[0] in names for a in args)
