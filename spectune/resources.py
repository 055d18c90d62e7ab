"""Files shipped with spectune and read as package data: sweep plans (configs/) and workload sets (workloads/).

In the repository they live in the top-level configs/ and workloads/ folders, where users look for them;
spectune/_data/ holds two symbolic links to those folders, so the wheel carries the same files (setuptools copies
what the links point to) and git holds one copy. pip installs wheels unzipped, so the data are plain files."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from spectune.errors import SpectuneError


def shipped_dir(kind: str) -> Path:
    """The shipped folder `kind` ("configs" or "workloads") as a filesystem path."""
    return Path(str(files("spectune").joinpath("_data", kind)))


def shipped_plans() -> list[str]:
    return sorted(p.stem for p in shipped_dir("configs").glob("*.toml"))


def default_plan() -> Path:
    return shipped_dir("configs") / "embedded.toml"


def resolve_plan(plan: str | Path | None) -> Path:
    """A plan file: the path itself when it exists, else a shipped plan by name (`embedded`, `vllm-cpu`, ...)."""
    if plan is None:
        return default_plan()
    path = Path(plan).expanduser()
    if path.is_file():
        return path
    name = path.name.removesuffix(".toml")
    if path.parent in (Path("."), Path("configs")) and name in shipped_plans():  # "vllm-cpu" or "configs/vllm-cpu.toml"
        return shipped_dir("configs") / f"{name}.toml"
    raise SpectuneError(f"{plan}: plan file not found; pass an existing TOML file or a shipped plan: {', '.join(shipped_plans())}")
