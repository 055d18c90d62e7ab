import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def spectune_cmd() -> list[str]:
    """The CLI as a user runs it, in a subprocess (exit codes and stderr are what a user sees)."""
    return [sys.executable, "-m", "spectune.cli"]


@pytest.fixture(autouse=True)
def _few_threads(monkeypatch):
    # 2 cores: keep torch in subprocesses (engine servers) from oversubscribing them.
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "2"))
