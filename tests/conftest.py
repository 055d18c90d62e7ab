import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def spectune_cmd() -> list[str]:
    """The CLI as a user runs it, in a subprocess (exit codes and stderr are what a user sees)."""
    return [sys.executable, "-m", "spectune.cli"]
