"""Launch failures: each must end in one SpectuneError that says why, with no process left behind."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
from engine_fixtures import require_vllm, target_and_draft

from spectune.errors import SpectuneError
from spectune.servers import make_server
from spectune.servers.base import ServerSpec


def _marked(mark: str) -> list[int]:
    """Live processes whose environment carries `mark` (every descendant of a server inherits it)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("SPECTUNE_TEST_MARK") == mark and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except psutil.Error:
            pass
    return found


def test_engine_that_exits_before_ready_shows_its_log(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTUNE_VLLM_PYTHON", sys.executable)  # spectune's own venv: it has no vllm
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    server = make_server(ServerSpec(name="v", engine="vllm", model="/models/target"), tmp_path)
    with pytest.raises(SpectuneError, match=r"(?s)exited with code 1 before it was ready.*No module named .?vllm") as err:
        server.start()
    assert str(tmp_path / "v.log") in str(err.value)
    assert server.pid() is None and not server.alive()
    assert not list((tmp_path / "tmp").iterdir())  # the launch's temp dir went with it


def test_a_launch_has_a_temp_dir_of_its_own_removed_when_it_stops(tmp_path, monkeypatch):
    # vLLM and SGLang leave their ZMQ sockets in the temp dir; every launch gets its own, under the system's
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    # and the one a killed spectune left (a real process that has exited) goes at the next launch; a live one's stays
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    orphaned, live = tmp_path / "tmp" / f"spectune-server-{gone.pid}-abc", tmp_path / "tmp" / f"spectune-server-{os.getppid()}-abc"
    for d in (orphaned, live):
        d.mkdir()
        (d / "socket-left").touch()
    server = make_server(ServerSpec(name="e", engine="embedded"), tmp_path / "logs")
    server.start()
    try:
        own = Path(psutil.Process(server.pid()).environ()["TMPDIR"])
        assert own.parent == tmp_path / "tmp" and own.is_dir() and own.name.startswith(f"spectune-server-{os.getpid()}-")
    finally:
        server.stop()
    assert not own.exists() and sorted((tmp_path / "tmp").iterdir()) == [live]


def test_port_in_use_fails_before_launch(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        server = make_server(ServerSpec(name="e", engine="embedded", port=port), tmp_path)
        with pytest.raises(SpectuneError, match=f"port 127.0.0.1:{port} is already in use"):
            server.start()
    assert not (tmp_path / "e.log").exists()  # nothing was launched


@pytest.mark.engines
def test_vllm_not_ready_in_time_is_stopped_with_its_children(tmp_path):
    require_vllm()
    target, _ = target_and_draft()
    mark = f"not-ready-{os.getpid()}"
    control = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                               env={**os.environ, "SPECTUNE_TEST_MARK": mark})
    assert _marked(mark) == [control.pid]  # the search finds marked processes
    control.stdin.close()
    control.wait()
    spec = ServerSpec(name="slow", engine="vllm", model=str(target), ready_timeout_s=3.0, env=(("SPECTUNE_TEST_MARK", mark),))
    server = make_server(spec, tmp_path)
    with pytest.raises(SpectuneError, match="was not ready at .* after 3 s"):
        server.start()  # vLLM takes far longer than 3 s to load
    assert server.pid() is None
    assert _marked(mark) == []
