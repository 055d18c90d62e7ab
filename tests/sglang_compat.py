"""Loads modules of SGLang's released 0.5.23 wheel (unpacked by scripts/install-engines.sh) so tests can
hold spectune against SGLang's own code.

SGLang's adaptive module imports server internals (arg resolution, runtime context, CUDA workers)
that would pull in torch and a GPU stack. Only its policy and its config loader are exercised, so
those imports are satisfied by *import stubs*: placeholder modules put into sys.modules while the
file loads, then removed. A stub name called at run time fails loudly, except SGLang's logging helper.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

SGLANG_VERSION = "0.5.23"
CACHE = Path(os.environ.get("SPECTUNE_CACHE", Path.home() / ".cache" / "spectune"))
SGLANG_ROOT = CACHE / f"sglang-{SGLANG_VERSION}"
REPO_ROOT = Path(__file__).resolve().parent.parent

_loaded: dict[str, types.ModuleType] = {}


def sglang_package_dir() -> Path:
    """The unpacked `sglang` package; installs it once if absent, skips the test if it cannot be had."""
    package = SGLANG_ROOT / "sglang"
    if not package.is_dir():
        proc = subprocess.run(
            ["bash", str(REPO_ROOT / "scripts" / "install-engines.sh"), "sglang"],
            capture_output=True, text=True, timeout=900,
        )
        if not package.is_dir():
            pytest.skip(f"SGLang {SGLANG_VERSION} wheel could not be obtained (scripts/install-engines.sh sglang: "
                        f"{(proc.stderr or proc.stdout).strip()[-300:]})")
    return package


def _stub_function(qualified: str):
    if qualified.endswith(".log_info_on_rank0"):
        return lambda logger, msg: logger.info(msg)

    def unavailable(*args, **kwargs):
        raise RuntimeError(f"{qualified} is an import stub in tests/sglang_compat.py; the test reached server code")

    return unavailable


def _import_stubs_for(source: str) -> dict[str, types.ModuleType]:
    """Placeholder modules for every `from sglang... import name` at the top of a module (and their parents)."""
    stubs: dict[str, types.ModuleType] = {}
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "sglang"):
            continue
        parts = node.module.split(".")
        for depth in range(1, len(parts) + 1):
            name = ".".join(parts[:depth])
            if name not in stubs:
                stubs[name] = types.ModuleType(name, "import stub (tests/sglang_compat.py)")
                stubs[name].__path__ = []  # a package, so submodules resolve
        for alias in node.names:
            setattr(stubs[node.module], alias.name, _stub_function(f"{node.module}.{alias.name}"))
    return stubs


def load_sglang_module(relative_path: str) -> types.ModuleType:
    """Import one file of the released wheel, e.g. "srt/speculative/adaptive_spec_params.py", with import stubs."""
    if relative_path in _loaded:
        return _loaded[relative_path]
    path = sglang_package_dir() / relative_path
    source = path.read_text()
    stubs = _import_stubs_for(source)
    saved = {name: sys.modules.get(name) for name in stubs}
    name = "sglang_released_" + relative_path.removesuffix(".py").replace("/", "_")
    try:
        sys.modules.update(stubs)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for stub_name, previous in saved.items():
            if previous is None:
                sys.modules.pop(stub_name, None)
            else:
                sys.modules[stub_name] = previous
    logging.getLogger(module.__name__).setLevel(logging.WARNING)  # its switch log line fires thousands of times
    _loaded[relative_path] = module
    return module


def sglang_adaptive_module() -> types.ModuleType:
    """SGLang's adaptive_spec_params: AdaptiveSpeculativeParams, AdaptiveStepSlot, _load_adaptive_config, DEFAULT_ADAPTIVE_CONFIG."""
    return load_sglang_module("srt/speculative/adaptive_spec_params.py")
