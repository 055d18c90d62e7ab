"""`spectune sweep` with a real SIGINT raised in the middle of writing the first cell file: after its data is on
disk, before the rename that commits it. No signal sent from outside can be timed to land there, so the test
that uses this (test_sweep_sigint.py) injects it; everything else is the real CLI.

    python tests/sigint_during_write.py SWEEP_ARGS...
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

_real_replace = os.replace
_fired: list[str] = []


def _replace_with_sigint(src, dst, *args, **kwargs):
    if Path(dst).parent.name == "cells" and not _fired:
        _fired.append(str(dst))
        signal.raise_signal(signal.SIGINT)  # Python runs its handler right here, mid-write
    return _real_replace(src, dst, *args, **kwargs)


if __name__ == "__main__":
    os.replace = _replace_with_sigint
    from spectune.cli import main

    sys.argv = ["spectune", "sweep", *sys.argv[1:]]
    main()
