"""spectune installed like a package: the wheel built from this tree (`pip wheel --no-deps`), installed into a fresh
virtual environment, runs `spectune sweep` from an empty directory with the plans and workloads it carries as
package data, and writes results/ and reports/ there.

The fresh venv reaches the dependencies (torch, pandas, ...) through a .pth line naming this interpreter's
site-packages, so nothing is downloaded; that directory holds at most an editable spectune, whose own .pth files
Python does not process from there, and the test checks that `spectune` is the one installed in the venv."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from sweep_helpers import TINY_NGRAM_PLAN

REPO = Path(__file__).resolve().parent.parent
PLAN = TINY_NGRAM_PLAN.replace('name = "tiny"', 'name = "installed"')


def _run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kwargs)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout}\n{proc.stderr}"
    return proc


def _build_wheel(tmp: Path) -> Path:
    src = tmp / "src"  # a copy, so the build leaves nothing in the checkout
    shutil.copytree(REPO, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", "results", "reports", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "tests", "benchmarks"))
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]  # offline when it can be
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-w", tmp / "wheels", src])
    return next((tmp / "wheels").glob("spectune-*.whl"))


def _fresh_venv(tmp: Path, wheel: Path) -> Path:
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "spectune-test-deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel])
    return venv


def test_wheel_installed_in_a_fresh_venv_sweeps_from_an_empty_directory(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert {"spectune/_data/configs/embedded.toml", "spectune/_data/workloads/quote.jsonl",
            "spectune/engine/assets/target/model.safetensors"} <= set(names)
    assert not any(n.endswith("workloads/build.py") for n in names)  # package data, not the script that makes it

    venv = _fresh_venv(tmp_path, wheel)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["SPECTUNE_CACHE"] = str(tmp_path / "cache")  # no GGUF of this venv's copy of the target left in the real cache
    work = tmp_path / "work"
    work.mkdir()
    where = _run([venv / "bin" / "python", "-c", "import spectune, spectune.resources as r; print(spectune.__file__); print(r.default_plan())"],
                 cwd=work, env=env).stdout.split()
    assert all(p.startswith(str(venv)) for p in where), where  # the installed copy, not this checkout

    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    proc = _run([venv / "bin" / "spectune", "sweep", plan, "--trials", "3"], cwd=work, env=env)
    assert sorted(p.name for p in work.iterdir()) == ["reports", "results"]
    (run,) = (work / "results").iterdir()
    assert run.name.startswith("installed-") and (run / "cells.parquet").is_file()
    assert {"adaptive_spec.json", "vllm_speculative_config.json", "llamacpp_flags.txt"} <= {p.name for p in (run / "tuned").iterdir()}
    assert (work / "reports" / run.name / "report.html").is_file()
    assert str(work / "reports" / run.name / "report.html") in proc.stdout
    assert str(REPO) not in proc.stdout  # no path into the checkout: the plan's workload came from the wheel
