"""Compare a run with a baseline run, cell by cell, for CI: fail on a regression beyond a tolerance."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path

from spectune.errors import SpectuneError
from spectune.store import atomic_write_bytes, load_run


@dataclass(frozen=True, slots=True)
class CellComparison:
    server: str
    batch_size: int
    baseline: float
    current: float

    @property
    def change(self) -> float:
        return self.current / self.baseline - 1.0 if self.baseline else float("nan")


@dataclass(slots=True)
class GateResult:
    metric: str
    max_regression: float
    cells: list[CellComparison] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # baseline cells the new run lacks

    @property
    def regressions(self) -> list[CellComparison]:
        return [c for c in self.cells if c.change < -self.max_regression]

    @property
    def passed(self) -> bool:
        return not self.regressions and not self.missing

    def lines(self) -> list[str]:
        out = [f"{c.server} bs={c.batch_size}: {self.metric} {c.baseline:.2f} -> {c.current:.2f} ({c.change:+.1%})"
               + ("  REGRESSION" if c in self.regressions else "") for c in self.cells]
        out += [f"{m}: in the baseline but not measured now" for m in self.missing]
        verdict = "PASS" if self.passed else "FAIL"
        out.append(f"{verdict}: {len(self.regressions)} regression(s) beyond {self.max_regression:.0%}, {len(self.missing)} missing cell(s)")
        return out


def _means(root: Path, metric: str):
    cells = load_run(root).cells
    if cells.empty:
        raise SpectuneError(f"{root}: no finished cells to compare")
    if metric not in cells:
        raise SpectuneError(f"{root}: no metric {metric!r} in cells; use e.g. output_throughput_tps")
    ok = cells[cells["status"] == "ok"]
    return ok.groupby(["server", "batch_size"])[metric].mean()


def compare(results: Path, baseline: Path, *, metric: str, max_regression: float) -> GateResult:
    now, base = _means(Path(results), metric), _means(Path(baseline), metric)
    result = GateResult(metric=metric, max_regression=max_regression)
    for (server, bs), value in base.items():
        if (server, bs) not in now.index:
            result.missing.append(f"{server} bs={bs}")
            continue
        result.cells.append(CellComparison(str(server), int(bs), float(value), float(now[(server, bs)])))
    return result


def write_junit(result: GateResult, path: Path) -> None:
    cases = []
    for c in result.cells:
        name = html.escape(f"{c.server} bs={c.batch_size}", quote=True)
        body = (f'<failure message="{html.escape(f"{result.metric} {c.change:+.1%}", quote=True)}"/>'
                if c in result.regressions else "")
        cases.append(f'<testcase classname="spectune.gate" name="{name}">{body}</testcase>')
    for m in result.missing:
        cases.append(f'<testcase classname="spectune.gate" name="{html.escape(m, quote=True)}"><failure message="missing"/></testcase>')
    failures = len(result.regressions) + len(result.missing)
    xml = (f'<?xml version="1.0" encoding="utf-8"?>\n<testsuite name="spectune-gate" tests="{len(cases)}" failures="{failures}">'
           + "".join(cases) + "</testsuite>\n")
    atomic_write_bytes(path, xml.encode())
