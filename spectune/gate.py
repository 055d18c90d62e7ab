"""`spectune gate`: compare a run with a baseline run, for CI, under rules that know each metric's direction and
the run-to-run noise.

A rule names a metric (a cell column such as `output_throughput_tps` or `tpot_ms_p99`, or `speedup`: speculative /
target-only output throughput paired by repeat), the direction that is better, and a threshold: the largest
relative change in the worse direction that is tolerated. Every (server, batch size) the rule selects is compared
on its per-repeat values: the relative change of the means, with a Welch t-interval on it. A change is a
regression when it is beyond the threshold AND its interval excludes zero on the worse side; beyond the threshold
but inside the noise, it is reported as such and passes. The intervals hold at 95% for the run's checks together
(Bonferroni: each at 1 - 5%/m over the m checks with a noise estimate), so a gate with many checks does not fail an
unchanged build more often than one with a few. With one repeat on either side there is no noise
estimate and the threshold alone decides (the output says so). A baseline that is missing, zero or NaN is an
error (exit 2), never a pass.
"""

from __future__ import annotations

import fnmatch
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from spectune.analysis import open_loop, t_quantile, where_text
from spectune.errors import SpectuneError
from spectune.store import atomic_write_bytes, load_run

# Direction by metric name: the first pattern that matches decides. Lower-is-better first, so that e.g.
# "ttft_from_send_ms" is not read as a "send" rate.
LOWER_IS_BETTER = ("ttft", "tpot_ms", "icl_ms", "itl_ms", "e2e", "queue_delay", "mem_", "failure_rate", "num_failed")
HIGHER_IS_BETTER = ("throughput", "speedup", "accept", "goodput", "tokens_per_chunk")
SPECULATIVE_ONLY = ("accept", "speedup", "tpot_speedup")  # undefined for target-only servers
RULE_KEYS = {"name", "metric", "direction", "threshold", "batch_sizes", "smallest_batch_sizes", "servers", "speculative"}


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    metric: str
    direction: str  # "higher" or "lower": which way is better
    threshold: float  # largest tolerated relative change in the worse direction (0.1 = 10%)
    batch_sizes: tuple[int, ...] | None = None  # None: every batch size
    smallest_batch_sizes: int | None = None  # only the N smallest batch sizes of the baseline
    servers: tuple[str, ...] | None = None  # server names or shell-style patterns ("eagle-*")
    speculative: bool | None = None  # True: speculative servers only; False: target-only only

    def describe(self) -> str:
        scope = []
        if self.servers:
            scope.append("servers " + ", ".join(self.servers))
        if self.speculative is not None:
            scope.append("speculative servers" if self.speculative else "target-only servers")
        if self.batch_sizes:
            scope.append("batch sizes " + ", ".join(map(str, self.batch_sizes)))
        if self.smallest_batch_sizes:
            scope.append(f"the {self.smallest_batch_sizes} smallest batch sizes")
        return f"{self.metric} ({self.direction} is better, threshold {self.threshold:.0%}" + (f"; {'; '.join(scope)})" if scope else ")")


DEFAULT_RULES = (
    Rule("target-only throughput", "output_throughput_tps", "higher", 0.10, speculative=False),
    Rule("speedup at small batch sizes", "speedup", "higher", 0.10, smallest_batch_sizes=2),
    Rule("p99 TTFT", "ttft_ms_p99", "lower", 0.25),
    Rule("p99 TPOT", "tpot_ms_p99", "lower", 0.20),
    Rule("acceptance length", "acceptance_length", "higher", 0.05, speculative=True),
)


def known_direction(metric: str) -> str | None:
    if any(p in metric for p in LOWER_IS_BETTER):
        return "lower"
    if any(p in metric for p in HIGHER_IS_BETTER):
        return "higher"
    return None


def load_rules(path: str | Path) -> tuple[Rule, ...]:
    """Rules from a TOML file with one [[rules]] table per rule (configs/gate-rules.toml is an example)."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SpectuneError(f"{path}: rules file not found; pass an existing TOML file (see configs/gate-rules.toml)") from None
    except tomllib.TOMLDecodeError as e:
        raise SpectuneError(f"{path}: not valid TOML ({e}); fix the syntax") from None
    entries = raw.get("rules")
    if not isinstance(entries, list) or not entries:
        raise SpectuneError(f"{path}: no [[rules]] tables; add at least one (see configs/gate-rules.toml)")
    return tuple(_rule(entry, f"{path}: rule {i + 1}") for i, entry in enumerate(entries))


def _rule(entry: object, where: str) -> Rule:
    if not isinstance(entry, dict):
        raise SpectuneError(f"{where}: must be a table with metric and threshold")
    where = f"{where} ({entry['name']!r})" if isinstance(entry.get("name"), str) else where
    unknown = sorted(set(entry) - RULE_KEYS)
    if unknown:
        raise SpectuneError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(RULE_KEYS))}")
    metric = entry.get("metric")
    if not isinstance(metric, str) or not metric:
        raise SpectuneError(f"{where}: \"metric\" is required, e.g. metric = \"output_throughput_tps\"")
    direction = entry.get("direction", known_direction(metric))
    if direction is None:
        raise SpectuneError(f"{where}: metric {metric!r} has no known direction; add direction = \"higher\" or \"lower\" (which is better)")
    if direction not in ("higher", "lower"):
        raise SpectuneError(f"{where}: direction {direction!r} must be \"higher\" or \"lower\" (which is better)")
    threshold = entry.get("threshold")
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0 <= threshold < 10:
        raise SpectuneError(f"{where}: \"threshold\" must be a relative change >= 0, e.g. threshold = 0.1 for 10%")
    sizes = entry.get("batch_sizes")
    if sizes is not None and (not isinstance(sizes, list) or not sizes or not all(isinstance(b, int) and b > 0 for b in sizes)):
        raise SpectuneError(f"{where}: \"batch_sizes\" must be a list of positive integers, e.g. [1, 4]")
    smallest = entry.get("smallest_batch_sizes")
    if smallest is not None and (isinstance(smallest, bool) or not isinstance(smallest, int) or smallest < 1):
        raise SpectuneError(f"{where}: \"smallest_batch_sizes\" must be a positive integer, e.g. 2")
    servers = entry.get("servers")
    if servers is not None and (not isinstance(servers, list) or not all(isinstance(s, str) and s for s in servers)):
        raise SpectuneError(f"{where}: \"servers\" must be a list of server names or patterns, e.g. [\"eagle-*\"]")
    speculative = entry.get("speculative")
    if speculative is not None and not isinstance(speculative, bool):
        raise SpectuneError(f"{where}: \"speculative\" must be true or false")
    return Rule(name=str(entry.get("name") or metric), metric=metric, direction=direction, threshold=float(threshold),
                batch_sizes=tuple(sizes) if sizes else None, smallest_batch_sizes=smallest,
                servers=tuple(servers) if servers else None, speculative=speculative)


# --- comparing ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Check:
    """One rule on one (server, batch size)."""

    rule: Rule
    server: str
    batch_size: int
    baseline: tuple[float, ...]  # per-repeat values
    current: tuple[float, ...]
    change: float  # relative change of the means: current / baseline - 1
    ci_low: float  # Welch t-interval on the change at the gate's level (FAMILY_LEVEL); NaN without a noise estimate
    ci_high: float
    verdict: str  # "ok", "improved", "within noise", "regression", "missing"
    request_rate: float = 0.0  # open loop: the cell's rate (req/s); 0 in a closed loop

    @property
    def place(self) -> str:
        return _place(self.batch_size, self.request_rate)

    @property
    def failed(self) -> bool:
        return self.verdict in ("regression", "missing")

    @property
    def has_noise_estimate(self) -> bool:
        return len(self.baseline) >= 2 and len(self.current) >= 2


@dataclass(slots=True)
class GateResult:
    checks: list[Check] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # missing, zero or NaN baselines, metrics absent: exit 2
    notes: list[str] = field(default_factory=list)

    @property
    def regressions(self) -> list[Check]:
        return [c for c in self.checks if c.failed]

    @property
    def exit_code(self) -> int:
        return 2 if self.errors else 1 if self.regressions else 0

    @property
    def verdict(self) -> str:
        return "ERROR" if self.errors else "FAIL" if self.regressions else "PASS"

    def headline(self) -> str:
        noisy = sum(c.verdict == "within noise" for c in self.checks)
        text = f"{self.verdict}: {len(self.checks)} checks, {len(self.regressions)} regression(s)"
        if noisy:
            text += f", {noisy} change(s) beyond a threshold but within run-to-run noise"
        if self.errors:
            text += f", {len(self.errors)} error(s)"
        return text


FAMILY_LEVEL = 0.95  # of all a run's intervals together


def compare_values(baseline: list[float], current: list[float], direction: str, threshold: float,
                   checks: int = 1) -> tuple[float, float, float, str]:
    """(change, ci_low, ci_high, verdict) of current vs baseline per-repeat values; baseline mean must be non-zero.
    The interval is one of `checks` that hold at FAMILY_LEVEL together (Bonferroni)."""
    b, c = np.asarray(baseline, dtype=float), np.asarray(current, dtype=float)
    mb, mc = float(b.mean()), float(c.mean())
    change = mc / mb - 1.0
    worse = -change if direction == "higher" else change  # > 0: got worse
    if b.size < 2 or c.size < 2:  # no noise estimate: the threshold alone
        return change, math.nan, math.nan, "regression" if worse > threshold else "ok"
    vb, vc = float(b.var(ddof=1)) / b.size, float(c.var(ddof=1)) / c.size
    se = math.sqrt(vb + vc)
    if se == 0.0:
        low = high = change
    else:  # Welch-Satterthwaite degrees of freedom; rounded down, so the interval errs wide
        df = se**4 / ((vb**2 / (b.size - 1) if vb else 0.0) + (vc**2 / (c.size - 1) if vc else 0.0))
        half = t_quantile(1 - (1 - FAMILY_LEVEL) / 2 / checks, max(1, math.floor(df))) * se / abs(mb)
        low, high = change - half, change + half
    significant = high < 0 if direction == "higher" else low > 0  # the interval lies on the worse side of zero
    better = low > 0 if direction == "higher" else high < 0
    if worse > threshold:
        verdict = "regression" if significant else "within noise"
    elif -worse > threshold and better:
        verdict = "improved"
    else:
        verdict = "ok"
    return change, low, high, verdict


def compare(results: str | Path, baseline: str | Path, rules: tuple[Rule, ...] = DEFAULT_RULES, *,
            defaults: bool = True) -> GateResult:
    """Every rule on every (server, batch size) it selects. `defaults`: the rules are the built-in ones, so a rule
    that selects nothing (e.g. speedup in a run without speculative servers) is skipped, not an error."""
    now, base = _load(Path(results)), _load(Path(baseline))
    result = GateResult()
    unlike = _unlike(base, now, str(baseline), result)
    pending: list[tuple[Rule, str, int, list[float], list[float]]] = []  # compared once their number is known
    for rule in rules:
        base_values, now_values = _values(base, rule, str(baseline), result), _values(now, rule, str(results), result)
        if base_values is None or now_values is None:
            continue
        keys = _selected(rule, base_values, now_values)
        if not keys:
            if not defaults:
                result.errors.append(f"rule {rule.name!r}: selects no (server, batch size) in {baseline}; check its servers, "
                                     "batch_sizes and speculative filters")
            continue
        for server, bs, rate in keys:
            if (server, bs, rate) in unlike:
                continue
            b = base_values.get((server, bs, rate), [])
            c = now_values.get((server, bs, rate), [])
            where = f"rule {rule.name!r}, server {server}, batch size {_place(bs, rate)}"
            b_finite = [v for v in b if math.isfinite(v)]
            if not b:
                result.errors.append(f"{where}: no baseline value in {baseline} (not measured there, or failed); refresh the baseline")
                continue
            if not b_finite:
                result.errors.append(f"{where}: the baseline's {rule.metric} is NaN in {baseline}; this metric cannot be gated there")
                continue
            if float(np.mean(b_finite)) == 0.0:
                result.errors.append(f"{where}: the baseline's {rule.metric} is 0 in {baseline}; a relative change from 0 is undefined")
                continue
            c_finite = [v for v in c if math.isfinite(v)]
            if not c_finite:
                result.checks.append(Check(rule, server, bs, tuple(b_finite), (), math.nan, math.nan, math.nan, "missing", rate))
                continue
            pending.append((rule, server, bs, rate, b_finite, c_finite))
    m = max(1, sum(len(b) >= 2 and len(c) >= 2 for *_, b, c in pending))
    for rule, server, bs, rate, b, c in pending:
        change, low, high, verdict = compare_values(b, c, rule.direction, rule.threshold, checks=m)
        result.checks.append(Check(rule, server, bs, tuple(b), tuple(c), change, low, high, verdict, rate))
    single = sorted({f"{c.server} bs={c.place}" for c in result.checks if c.verdict != "missing" and not c.has_noise_estimate})
    if single:
        result.notes.append(f"one repeat on a side, no noise estimate: judged on the threshold alone ({', '.join(single[:6])}"
                            + (f" and {len(single) - 6} more" if len(single) > 6 else "") + ")")
    shared = [str(where) for where, cells in ((results, now), (baseline, base)) if not cells.empty and not cells["relaunched"].any()]
    if shared and any(c.has_noise_estimate for c in result.checks):
        result.notes.append(f"the repeats of {' and '.join(shared)} each ran on one launch of every server, so the intervals hold the "
                            "noise within a launch, not how far two launches differ, which a second run always adds: a check "
                            "just past its threshold may be a launch's luck; relaunch = true in the plan measures every repeat "
                            "on a fresh launch and puts that noise in the intervals")
    return result


def _unlike(base: pd.DataFrame, now: pd.DataFrame, baseline: str, result: GateResult) -> set[tuple[str, int, float]]:
    """(server, batch size, rate) cells the two runs measured on different traffic (the requests, their order, output
    lengths, arrival times: the cells' traffic digest) or on different engines: a change there is no regression.
    One error line per kind, naming them."""
    unlike: dict[str, list[tuple[str, int, float]]] = {}
    for column, what in (("traffic_digest", "other traffic (workload, prompts, output lengths or schedule)"),
                         ("engine", "another engine")):
        if column not in base or column not in now:
            continue
        b = base.groupby(["server", "batch_size", "rate"])[column].agg(lambda v: frozenset(v.dropna()))
        c = now.groupby(["server", "batch_size", "rate"])[column].agg(lambda v: frozenset(v.dropna()))
        both = b.index.intersection(c.index)
        differ = [(str(s), int(bs), float(r)) for s, bs, r in both
                  if b[(s, bs, r)] and c[(s, bs, r)] and b[(s, bs, r)] != c[(s, bs, r)]]
        if differ:
            unlike[what] = differ
    for what, keys in unlike.items():
        named = ", ".join(f"{s} bs={_place(bs, r)}" for s, bs, r in keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")
        result.errors.append(f"{baseline} measured {what} than this run at {named}; a change there is not a regression: "
                             "refresh the baseline with the current plan")
    return {key for keys in unlike.values() for key in keys}


def _load(root: Path) -> pd.DataFrame:
    run = load_run(root)
    cells = run.cells
    if cells.empty:
        raise SpectuneError(f"{root}: no finished cells to compare; run spectune sweep first")
    limit = float(run.manifest.get("plan", {}).get("max_failure_rate", 0.05))
    failure_rate = cells["failure_rate"].fillna(0.0) if "failure_rate" in cells else 0.0
    rate = cells["request_rate"].astype(float).fillna(0.0) if "request_rate" in cells else 0.0
    relaunched = bool(run.manifest.get("plan", {}).get("relaunch", False))
    return cells[(cells["status"] == "ok") & (failure_rate <= limit)].assign(rate=rate, relaunched=relaunched)


def _place(batch_size: int, rate: float) -> str:
    """A check's cell: "4", or in an open loop "16 req/s (cap 4)"."""
    return where_text(batch_size, rate or None)


def _values(cells: pd.DataFrame, rule: Rule, where: str, result: GateResult) -> dict[tuple[str, int, float], list[float]] | None:
    """(server, batch size, rate; 0 in a closed loop) -> per-repeat values of the rule's metric, after its server filters."""
    if rule.metric in ("speedup", "tpot_speedup"):
        frame = _speedup_per_repeat(cells, rule, where, result)
        if frame is None:
            return None
    elif rule.metric not in cells:
        some = ", ".join(c for c in ("output_throughput_tps", "tpot_ms_p99", "ttft_ms_p99", "acceptance_length") if c in cells)
        result.errors.append(f"rule {rule.name!r}: no metric {rule.metric!r} in the cells of {where}; use a cell column, e.g. {some}, or speedup")
        return None
    else:
        frame = cells.assign(value=pd.to_numeric(cells[rule.metric], errors="coerce"))
    spec = frame["is_speculative"].astype(bool)
    if rule.speculative is not None:
        frame = frame[spec == rule.speculative]
    elif rule.metric.startswith(SPECULATIVE_ONLY):
        frame = frame[spec]
    if rule.servers:
        frame = frame[frame["server"].map(lambda s: any(fnmatch.fnmatchcase(str(s), p) for p in rule.servers))]
    out: dict[tuple[str, int, float], list[float]] = {}
    for (server, bs, rate), group in frame.groupby(["server", "batch_size", "rate"], sort=True):
        out[(str(server), int(bs), float(rate))] = [float(v) for v in group.sort_values("repeat")["value"]]
    return out


def _speedup_per_repeat(cells: pd.DataFrame, rule: Rule, where: str, result: GateResult) -> pd.DataFrame | None:
    """Speculative / target-only output throughput (tpot_speedup: target / speculative TPOT) per repeat; in an open loop,
    where the arrivals set tok/s, speedup is the TPOT ratio too (spectune.analysis.speedup_table)."""
    targets = sorted(cells.loc[~cells["is_speculative"].astype(bool), "server"].unique())
    if len(targets) != 1:
        if targets or cells["is_speculative"].astype(bool).any():
            result.errors.append(f"rule {rule.name!r}: speedup needs exactly one target-only server in {where} (found "
                                 f"{', '.join(targets) or 'none'}); gate output_throughput_tps instead")
            return None
        return cells.iloc[0:0].assign(value=[])
    metric, invert = ("output_throughput_tps", False) if rule.metric == "speedup" else ("tpot_ms_mean", True)
    if metric not in cells:
        result.errors.append(f"rule {rule.name!r}: {rule.metric} needs {metric} in the cells of {where}")
        return None
    if not invert and "tpot_ms_mean" in cells and open_loop(cells).all():
        metric, invert = "tpot_ms_mean", True
    target = cells.loc[cells["server"] == targets[0], ["batch_size", "rate", "repeat", metric]].rename(columns={metric: "base"})
    spec = cells[cells["is_speculative"].astype(bool)].merge(target, on=["batch_size", "rate", "repeat"])
    ratio = spec["base"] / spec[metric] if invert else spec[metric] / spec["base"]
    return spec.assign(value=ratio.astype(float))


def _selected(rule: Rule, base: dict, now: dict) -> list[tuple[str, int, float]]:
    keys = sorted(set(base) | set(now))
    if rule.batch_sizes:
        keys = [k for k in keys if k[1] in rule.batch_sizes]
    if rule.smallest_batch_sizes:
        sizes = sorted({bs for _, bs, _ in base} or {bs for _, bs, _ in now})[: rule.smallest_batch_sizes]
        keys = [k for k in keys if k[1] in sizes]
    return keys


# --- writing -----------------------------------------------------------------------------------------------


def _mean_text(values: tuple[float, ...]) -> str:
    if not values:
        return "not measured"
    arr = np.asarray(values)
    spread = f" ±{arr.std(ddof=1):.3g}" if arr.size > 1 else ""
    return f"{arr.mean():.4g}{spread} (n={arr.size})"


def _ci_text(c: Check) -> str:
    if c.verdict == "missing":
        return ""
    return f"{c.ci_low:+.1%} to {c.ci_high:+.1%}" if math.isfinite(c.ci_low) else "no noise estimate"


def _rows(result: GateResult) -> list[list[str]]:
    rows = []
    for c in result.checks:
        limit = f"{'-' if c.rule.direction == 'higher' else '+'}{c.rule.threshold:.0%}"
        change = f"{c.change:+.1%}" if math.isfinite(c.change) else ""
        rows.append([c.rule.name, c.server, c.place, _mean_text(c.baseline), _mean_text(c.current), change,
                     _ci_text(c), limit, c.verdict.upper() if c.failed else c.verdict])
    return rows


HEADERS = ["rule", "server", "batch size", "baseline", "now", "change", "CI of change (95% jointly)", "limit", "verdict"]


def print_result(result: GateResult, console=None) -> None:
    """The table (rich), the notes, the errors and the verdict line."""
    import sys

    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 200, highlight=False)
    table = Table(title="spectune gate", title_justify="left", show_lines=False)
    for h in HEADERS:
        table.add_column(h, justify="right" if h in ("batch size", "change", "limit") else "left", no_wrap=h in ("server", "rule"))
    styles = {"regression": "bold red", "missing": "bold red", "within noise": "yellow", "improved": "green"}
    for check, row in zip(result.checks, _rows(result)):
        table.add_row(*row, style=styles.get(check.verdict))
    console.print(table)
    for note in result.notes:
        console.print(f"note: {note}")
    for error in result.errors:
        console.print(f"error: {error}", style="bold red")
    for c in result.regressions:
        console.print(f"REGRESSION: rule {c.rule.name!r} ({c.rule.describe()}): {c.server} batch size {c.place}: "
                      + (f"{c.rule.metric} {c.change:+.1%}" if c.verdict == "regression" else "not measured in the new run"),
                      style="bold red")
    console.print(result.headline(), style="bold green" if result.verdict == "PASS" else "bold red")


def write_junit(result: GateResult, path: str | Path) -> Path:
    """JUnit XML (one testcase per check, an error testcase per error), built with ElementTree."""
    import xml.etree.ElementTree as ET

    suite = ET.Element("testsuite", name="spectune gate", tests=str(len(result.checks) + len(result.errors)),
                       failures=str(len(result.regressions)), errors=str(len(result.errors)), skipped="0")
    for c, row in zip(result.checks, _rows(result)):
        case = ET.SubElement(suite, "testcase", classname=f"spectune.gate.{c.rule.name}", name=f"{c.server} bs={c.place}")
        detail = "; ".join(f"{h}: {v}" for h, v in zip(HEADERS, row))
        if c.failed:
            message = f"{c.rule.metric} {c.change:+.1%}" if c.verdict == "regression" else "not measured in the new run"
            ET.SubElement(case, "failure", message=f"rule {c.rule.name!r}: {message}", type=c.verdict).text = detail
        else:
            ET.SubElement(case, "system-out").text = detail
    for i, error in enumerate(result.errors):
        case = ET.SubElement(suite, "testcase", classname="spectune.gate", name=f"error {i + 1}")
        ET.SubElement(case, "error", message=error, type="baseline")
    if result.notes:
        ET.SubElement(suite, "system-out").text = "\n".join(result.notes)
    path = Path(path)
    atomic_write_bytes(path, ET.tostring(ET.ElementTree(suite).getroot(), encoding="utf-8", xml_declaration=True))
    return path


def markdown_summary(result: GateResult, results: str | Path, baseline: str | Path) -> str:
    """A Markdown summary for $GITHUB_STEP_SUMMARY: verdict, the checks that matter first, the rest folded."""
    from spectune.report.render import code_span, md_escape

    mark = {"PASS": "✅", "FAIL": "❌", "ERROR": "⚠️"}[result.verdict]
    lines = [f"## {mark} spectune gate: {result.verdict}", "",
             f"{md_escape(result.headline())}. New run {code_span(results)} against baseline {code_span(baseline)}.", ""]
    for error in result.errors:
        lines.append(f"- **error**: {md_escape(error)}")
    order = {"regression": 0, "missing": 0, "within noise": 1, "improved": 2, "ok": 3}
    ranked = sorted(zip(result.checks, _rows(result)), key=lambda cr: order.get(cr[0].verdict, 9))
    header = ["", "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    notable = [row for c, row in ranked if c.verdict != "ok"]
    if notable:
        lines += header + ["| " + " | ".join(md_escape(v) for v in row) + " |" for row in notable]
    if ranked:  # every check, folded: GitHub renders <details> in a step summary
        lines += ["", f"<details><summary>All {len(ranked)} checks</summary>", *header]
        lines += ["| " + " | ".join(md_escape(v) for v in row) + " |" for _, row in ranked] + ["", "</details>"]
    lines += [""] + [f"_Note: {md_escape(n)}_" for n in result.notes]
    lines += ["", "A change counts as a regression when it is beyond the rule's limit and its Welch interval over "
              "repeats lies on the worse side of zero; beyond the limit but inside the noise, it passes as \"within noise\". "
              "The intervals hold at 95% for all the checks together (Bonferroni), so more checks do not mean more false alarms."]
    return "\n".join(lines) + "\n"


def write_summary(result: GateResult, results: str | Path, baseline: str | Path, path: str | Path | None) -> list[Path]:
    """Write the Markdown summary to `path`, and append it to $GITHUB_STEP_SUMMARY when that is set."""
    text = markdown_summary(result, results, baseline)
    written = []
    if path is not None:
        atomic_write_bytes(Path(path), text.encode())
        written.append(Path(path))
    step_summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if step_summary:
        with open(step_summary, "a", encoding="utf-8") as f:
            f.write(text)
        written.append(Path(step_summary))
    return written
