"""`spectune sweep` with a real SIGINT raised by the sweep itself at a point no signal sent from outside can be
timed to hit (the tests that use it, in test_sweep_sigint.py, say so in their names); everything else is the
real CLI.

    python tests/sigint_injected.py write|sampler|finalizer SWEEP_ARGS...

write      in the middle of writing the first cell file: its data on disk, before the rename that commits it.
sampler    inside threading.Thread.start of the memory sampler of the second cell, before the thread runs (a
           Ctrl-C there used to leave stop() joining a thread never started: RuntimeError instead of exit 130).
finalizer  inside a finalizer the sweep's main thread runs (asyncio's _SelectorTransport.__del__, which sampling
           the main thread shows it does, aiohttp's ClientResponse.__del__ under uvloop, or the finalizer of
           spectune.rawhttp's connections for plain http://), once a cell is finished: Python prints a KeyboardInterrupt raised there
           as "Exception ignored" and drops it, which is how a Ctrl-C used to be lost (the sweep ran to the end).
"""

from __future__ import annotations

import asyncio.selector_events
import os
import signal
import sys
import threading
from pathlib import Path

_fired: list[str] = []


def _once(where: str) -> None:
    if not _fired:
        _fired.append(where)
        signal.raise_signal(signal.SIGINT)  # Python runs the handler right here


def _inject_in_write() -> None:
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        if Path(dst).parent.name == "cells":
            _once(str(dst))
        return real_replace(src, dst, *args, **kwargs)

    os.replace = replace


def _inject_in_sampler_start(out: Path) -> None:
    real_start = threading.Thread.start

    def start(self):
        if self.name == "spectune-memory" and any((out / "cells").glob("*.json")):
            _once("MemorySampler thread start")
        return real_start(self)

    threading.Thread.start = start


def _inject_in_finalizer(out: Path) -> None:
    # asyncio's transport finalizer on asyncio's loop; under uvloop (the measurement loop where it is installed)
    # transports are uvloop's, and aiohttp's response finalizer, run after every request, is the one hit.
    # For plain http:// the client is spectune.rawhttp: its connection protocols are freed when a cell's pool closes.
    from aiohttp.client_reqrep import ClientResponse

    from spectune.rawhttp import _Connection

    for cls in (asyncio.selector_events._SelectorTransport, ClientResponse, _Connection):
        _wrap_del(cls, out)


def _wrap_del(cls: type, out: Path) -> None:
    real_del = getattr(cls, "__del__", None)

    def __del__(self, *args):
        if any((out / "cells").glob("*.json")):
            _once(f"{cls.__name__}.__del__")
        if real_del is not None:
            real_del(self, *args)

    cls.__del__ = __del__


if __name__ == "__main__":
    point, args = sys.argv[1], sys.argv[2:]
    if point == "write":
        _inject_in_write()
    elif point == "sampler":
        _inject_in_sampler_start(Path(args[args.index("--out") + 1]))
    else:
        _inject_in_finalizer(Path(args[args.index("--out") + 1]))
    from spectune.cli import main

    sys.argv = ["spectune", "sweep", *args]
    main()
