"""What the report shows, as pandas frames and small records: read from a results directory (and its tuned/
tuning.json when `spectune tune` has run). No plotting, no formatting."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from spectune.analysis import OPEN_LOOP_NOTE, open_loop
from spectune.confirm import naming_run
from spectune.drain import request_speeds
from spectune.errors import SpectuneError
from spectune.guided import model_fit, trusted_tps, untrusted_notes
from spectune.holdout import marks_extrapolated
from spectune.store import first_target, load_run

POS_COLUMN = re.compile(r"^accept_pos_(\d+)$")

# Comparison names in tuning.json -> what a reader calls them.
COMPARISON_LABELS = {
    "target_only": "target-only",
    "best_static": "best static g (one g at every batch size)",
    "best_per_batch_schedule": "best g per batch size (schedule)",
    "sglang_default": "SGLang's default adaptive config",
    "conservative": "conservative preset",
    "aggressive": "aggressive preset",
    "oracle": "oracle (best g each moment; a bound, not deployable)",
    "tuned_adaptive": "tuned adaptive (adaptive_spec.json)",
}


@dataclass(frozen=True, slots=True)
class DeployEntry:
    engine: str
    method: str | None
    file: str | None
    command: str | None
    note: str


@dataclass(slots=True)
class Tuning:
    """What tuned/tuning.json says, read defensively: every key may be absent (older or newer spectune)."""

    path: Path
    method: str | None
    objective: str | None
    score: str | None
    comparisons: pd.DataFrame  # name, label, policy, speedup, gain (speedup - 1)
    deploy: list[DeployEntry]
    verdict: str | None
    exhaustive: str | None
    files: list[str]
    notes: list[str]
    # held-out prediction error (spectune.holdout.holdout_summary): holdout, method, cells, <metric>_mean/max_abs_pct
    holdout: pd.DataFrame = field(default_factory=pd.DataFrame)
    holdout_noise_pct: float = math.nan  # spectune.holdout.noise_floor (NaN: not known): what a cell disagrees with itself by
    holdout_one_launch: bool = False  # spectune.holdout.one_launch: the repeats ran on one launch of each server
    holdout_anchor_smoothed: bool = False  # target-only's anchor smoothed over batch sizes (four or more)
    holdout_split: bool = False  # spectune.holdout.marks_extrapolated: "_inside" rows exist wherever a held-out value was inside
    # the measured verdict per batch size: batch_size, then the tuned config's gain (%) over each compared config
    verdict_by_batch_size: pd.DataFrame = field(default_factory=pd.DataFrame)
    refined: str | None = None  # how the tuned config was refined from measurements (spectune.refine), if it was
    unmeasured_steps: str | None = None  # step counts the tuned config runs that the sweep never measured (deploy.unmeasured_steps)


@dataclass(slots=True)
class MethodTuning:
    """One speculative method, from measured cells: the best g per batch size vs one g everywhere."""

    method: str
    steps: tuple[int, ...]  # measured g
    table: pd.DataFrame  # batch_size, best_g, best_tps, best_speedup, single_tps, single_loss
    single_g: int | None  # the g that loses least over all batch sizes
    mean_loss: float  # 1 - geometric mean over batch sizes of tps(single_g) / tps(best g)
    max_loss: float


@dataclass(slots=True)
class ReportData:
    title: str
    results_dir: Path
    manifest: dict
    cells: pd.DataFrame  # usable cells: status ok and failure rate within the plan's limit, one row per repeat
    per_cell: pd.DataFrame  # mean over repeats per (server, batch size), with min/max of throughput
    servers: pd.DataFrame  # server, method, g, is_speculative, is_adaptive, drafted_undeclared: one row per measured server
    recommendation: pd.DataFrame  # spectune.analysis.recommendation_table
    speedups: pd.DataFrame  # spectune.analysis.speedup_table
    predicted: pd.DataFrame  # server, batch_size, predicted_speedup (cost model, per measured g)
    methods: list[MethodTuning]
    tuning: Tuning | None
    flagged: pd.DataFrame
    samples: pd.DataFrame
    notes: list[str] = field(default_factory=list)  # what could not be computed, and why
    model_notes: list[str] = field(default_factory=list)  # where the cost model missed a method's cells (guided.untrusted_notes)

    @property
    def batch_sizes(self) -> list[int]:
        return sorted(int(b) for b in self.cells["batch_size"].unique()) if not self.cells.empty else []


def collect(results: str | Path) -> ReportData:
    results = Path(results)
    run = load_run(results)
    title = str(run.manifest.get("run_id", results.name))
    limit = float(run.manifest.get("plan", {}).get("max_failure_rate", 0.05))
    cells = run.cells
    notes: list[str] = []
    if cells.empty:
        empty = pd.DataFrame()
        return ReportData(title, results, run.manifest, empty, empty, empty, empty, empty, empty, [], read_tuning(results),
                          empty, empty, ["no finished cells yet"])
    if "failure_rate" not in cells:  # a run from before failures were counted
        cells = cells.assign(failure_rate=0.0)
    usable = _no_acceptance_without_drafts(cells[(cells["status"] == "ok") & (cells["failure_rate"].fillna(0.0) <= limit)])
    flagged = _flagged(cells[~cells.index.isin(usable.index)], limit)
    baseline = first_target(run.manifest, usable)
    targets = sorted(set(usable.loc[~usable["is_speculative"].astype(bool), "server"]) - {baseline})
    if baseline is not None and targets:
        notes.append(f"speedups are over {baseline}, the plan's first target-only server; the other target-only "
                     f"server(s) ({', '.join(targets)}) are listed as measured, not compared")
    fit = model_fit(cells, request_speeds(run.requests))
    recommendation, speedups = _speedups(usable, limit, notes, baseline, trusted_tps(fit))
    if "client_saturated" in cells and cells["client_saturated"].fillna(False).astype(bool).any():
        hit = cells[cells["client_saturated"].fillna(False).astype(bool)]
        where = ", ".join(f"{r.server} batch {r.batch_size} r{r.repeat}" for r in hit.itertuples())
        notes.append(f"client saturated in {len(hit)} cell(s) ({where}): their inter-chunk and TTFT figures measure the "
                     "load generator, not the server; sweep again with more load-generator processes (workers = 2 or more)")
    if open_loop(usable).any():
        notes.append(OPEN_LOOP_NOTE)
    if not usable.empty and usable["repeat"].nunique() < 2:
        notes.append("one repeat per cell: no confidence intervals and no noise estimate; sweep with repeats = 3 for them")
    return ReportData(
        title=title,
        results_dir=results,
        manifest=run.manifest,
        cells=usable,
        per_cell=_per_cell(usable),
        servers=_servers(cells),
        recommendation=recommendation,
        speedups=speedups,
        predicted=_predicted(usable, notes),
        methods=method_tuning(usable),
        tuning=read_tuning(results),
        flagged=flagged,
        samples=_samples(run.requests, set(cells.loc[~cells["is_speculative"].astype(bool), "server"])),
        notes=notes,
        model_notes=untrusted_notes(fit),
    )


def drafted_undeclared(cells: pd.DataFrame) -> pd.Series:
    """Cells of servers the plan calls target-only whose counters show them drafting (a speculative server measured
    alone with `spectune bench`, which cannot know what it runs)."""
    if "num_drafts" not in cells:
        return pd.Series(False, index=cells.index)
    return ~cells["is_speculative"].astype(bool) & (cells["num_drafts"].fillna(0) > 0)


def _no_acceptance_without_drafts(cells: pd.DataFrame) -> pd.DataFrame:
    """Target-only servers draft nothing: their acceptance is undefined (engines report 0), not zero. One that drafted
    all the same keeps what its counters say."""
    columns = [c for c in cells.columns if c in ("acceptance_rate", "acceptance_length") or POS_COLUMN.match(c)]
    cells = cells.copy()
    cells.loc[~cells["is_speculative"].astype(bool) & ~drafted_undeclared(cells), columns] = np.nan
    return cells


def _speedups(usable: pd.DataFrame, limit: float, notes: list[str], baseline: str | None,
              expected: pd.Series) -> tuple[pd.DataFrame, pd.DataFrame]:
    from spectune.analysis import recommendation_table, speedup_table

    has_target = not usable.empty and (~usable["is_speculative"].astype(bool)).any()
    has_spec = not usable.empty and usable["is_speculative"].astype(bool).any()
    if not has_target:
        notes.append("no target-only cells: speedups need a target-only server measured on the same traffic")
        return pd.DataFrame(), pd.DataFrame()
    try:
        recommendation = recommendation_table(usable, limit, baseline, expected)
        speedups = speedup_table(usable, baseline=baseline) if has_spec else pd.DataFrame()
    except SpectuneError as e:  # e.g. several target-only servers and no plan saying which one is first
        notes.append(f"speedups not computed: {e}")
        return pd.DataFrame(), pd.DataFrame()
    return recommendation, speedups


def _per_cell(usable: pd.DataFrame) -> pd.DataFrame:
    if usable.empty:
        return pd.DataFrame()
    numeric = [c for c in usable.columns if pd.api.types.is_numeric_dtype(usable[c])
               and c not in ("batch_size", "repeat", "num_speculative_tokens") and not pd.api.types.is_bool_dtype(usable[c])]
    open_loop = "request_rate" in usable and usable["request_rate"].notna().any()
    keys = ["server", "batch_size", "request_rate"] if open_loop else ["server", "batch_size"]  # a rate is a cell of its own
    numeric = [c for c in numeric if c not in keys]
    groups = usable.groupby(keys, dropna=False)
    means = groups[numeric].mean()
    spread = groups["output_throughput_tps"].agg(tps_min="min", tps_max="max")
    firsts = groups[[c for c in ("method", "num_speculative_tokens", "is_speculative", "mem_source") if c in usable]].first()
    repeats = groups["repeat"].nunique().rename("num_repeats")
    return pd.concat([firsts, means, spread, repeats], axis=1).reset_index()


def _servers(cells: pd.DataFrame) -> pd.DataFrame:
    """One row per server measured (failed ones too, so their colour is reserved): method, g, kind."""
    frame = cells.groupby("server", sort=True).first().reset_index()
    is_adaptive = frame["adaptive_config"].notna() if "adaptive_config" in frame else pd.Series(False, index=frame.index)
    method = frame["method"] if "method" in frame else pd.Series(None, index=frame.index)
    drafted = drafted_undeclared(cells).groupby(cells["server"]).any()
    return pd.DataFrame({
        "server": frame["server"],
        "method": method.where(frame["is_speculative"].astype(bool), None),
        "g": frame.get("num_speculative_tokens", pd.Series(0, index=frame.index)).fillna(0).astype(int),
        "is_speculative": frame["is_speculative"].astype(bool),
        "is_adaptive": is_adaptive.astype(bool),
        "drafted_undeclared": frame["server"].map(drafted).fillna(False).astype(bool),
    })


def _predicted(usable: pd.DataFrame, notes: list[str]) -> pd.DataFrame:
    """The cost model's speedup per (server, batch size) for each speculative method's measured g: one fit per
    method (spectune.costmodel.fit_sweep), evaluated at the measured batch sizes."""
    from spectune.costmodel import fit_sweep, prediction_vs_measurement

    needed = {"engine", "method", "adaptive_config", "workload", "acceptance_length", "tpot_ms_mean", "output_throughput_tps"}
    if usable.empty or not needed <= set(usable.columns) or open_loop(usable).any():  # open loop: batch size is only a cap
        return pd.DataFrame(columns=["server", "batch_size", "predicted_speedup"])
    static = usable[usable["is_speculative"].astype(bool) & usable["adaptive_config"].isna()]
    frames = []
    for method in sorted(static["method"].dropna().unique()):
        try:
            fit = fit_sweep(usable, method=method)
            pred = prediction_vs_measurement(fit, usable)
        except (SpectuneError, ValueError, np.linalg.LinAlgError) as e:
            notes.append(f"cost model for {method} not fitted: {e}")
            continue
        pred = pred[pred["g"] > 0]
        frames.append(pred.groupby(["server", "batch_size"], as_index=False)["predicted_speedup"].mean())
    if not frames:
        return pd.DataFrame(columns=["server", "batch_size", "predicted_speedup"])
    return pd.concat(frames, ignore_index=True)


def method_tuning(usable: pd.DataFrame) -> list[MethodTuning]:
    """Per speculative method (static servers): the fastest measured g at each batch size, and the throughput
    lost by running the one g that does best over all batch sizes instead. Only batch sizes where every g of the
    method was measured count, so each g is judged on the same batch sizes."""
    if usable.empty or "method" not in usable:
        return []
    static = usable[usable["is_speculative"].astype(bool) & (usable["num_speculative_tokens"] > 0)]
    if "adaptive_config" in static:
        static = static[static["adaptive_config"].isna()]
    target = usable[~usable["is_speculative"].astype(bool)].groupby("batch_size")["output_throughput_tps"].mean()
    out = []
    for method, group in static.groupby("method", sort=True):
        tps = group.groupby(["batch_size", "num_speculative_tokens"])["output_throughput_tps"].mean().unstack().dropna()
        steps = tuple(int(g) for g in tps.columns)
        if tps.empty:
            continue
        best_g = tps.idxmax(axis=1)
        best = tps.max(axis=1)
        ratio = tps.div(best, axis=0)  # [batch sizes, g], 1 where g is the best
        score = np.exp(np.log(ratio.clip(lower=1e-12)).mean(axis=0))
        single_g = int(score.idxmax())
        table = pd.DataFrame({
            "batch_size": tps.index.astype(int),
            "best_g": best_g.astype(int).to_numpy(),
            "best_tps": best.to_numpy(),
            "best_speedup": (best / target.reindex(tps.index)).to_numpy(),
            "single_tps": tps[single_g].to_numpy(),
            "single_loss": (1.0 - ratio[single_g]).to_numpy(),
        })
        out.append(MethodTuning(str(method), steps, table, single_g, float(1.0 - score[single_g]), float(table["single_loss"].max())))
    return out


def read_tuning(results: Path) -> Tuning | None:
    path = results / "tuned" / "tuning.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(raw, dict):
        return None
    rows = []
    policies = raw.get("policies") if isinstance(raw.get("policies"), dict) else {}
    for entry in raw.get("comparisons") or []:
        if not isinstance(entry, dict) or "name" not in entry:
            continue
        name, speedup = str(entry["name"]), _float(entry.get("speedup"))
        rows.append({"name": name, "label": COMPARISON_LABELS.get(name, name),
                     "policy": describe_policy(policies.get(name), str(entry.get("policy", ""))), "speedup": speedup, "gain": speedup - 1.0})
    deploy = [DeployEntry(engine=str(d.get("engine", "?")), method=d.get("method"), file=d.get("file"), command=d.get("command"),
                          note=str(d.get("note") or "")) for d in raw.get("deploy") or [] if isinstance(d, dict)]
    return Tuning(
        path=path,
        method=raw.get("method"),
        objective=raw.get("objective"),
        score=raw.get("score"),
        comparisons=pd.DataFrame(rows, columns=["name", "label", "policy", "speedup", "gain"]),
        deploy=deploy,
        verdict=naming_run(v, results) if (v := _text(raw.get("verdict"))) else None,
        exhaustive=_text(raw.get("exhaustive")),
        files=[str(f) for f in raw.get("files") or []],
        notes=[str(n) for n in raw.get("notes") or []],
        holdout=pd.DataFrame([r for r in (raw.get("holdout") or {}).get("summary") or [] if isinstance(r, dict)]),
        holdout_noise_pct=_float((raw.get("holdout") or {}).get("noise_floor_pct")),
        holdout_one_launch=bool((raw.get("holdout") or {}).get("noise_floor_one_launch")),
        holdout_anchor_smoothed=bool((raw.get("holdout") or {}).get("anchor_smoothed")),
        holdout_split=marks_extrapolated(raw.get("holdout") or {}),
        verdict_by_batch_size=_by_batch_size(raw.get("verdict")),
        refined=_refined_text(raw.get("refined")),
        unmeasured_steps=u if isinstance(u := raw.get("unmeasured_steps"), str) else None,
    )


def _by_batch_size(verdict: object) -> pd.DataFrame:
    rows = verdict.get("by_batch_size") if isinstance(verdict, dict) else None
    alike = set(verdict.get("alike_batch_sizes") or []) if isinstance(verdict, dict) else set()
    rows = [{"batch_size": r["batch_size"], "alike": r["batch_size"] in alike, **(r.get("gain_pct") or {})}
            for r in rows or [] if isinstance(r, dict) and "batch_size" in r]
    return pd.DataFrame(rows)


def _refined_text(record: object) -> str | None:
    if not isinstance(record, dict) or not isinstance(record.get("slots_kept"), list):
        return None
    from spectune.refine import kept_text

    try:
        kept = kept_text(record)
    except (KeyError, TypeError):
        return None
    return (f"Refined from measurement (round {record.get('round')}): from each measured batch size on, the slots of the config "
            f"that measured best there over {record.get('passes')} passes of the previous round ({kept}); measured again on new passes.")


def describe_policy(policy: object, fallback: str) -> str:
    """A policy from tuning.json in a few words: its steps per batch-size range."""
    if not isinstance(policy, dict):
        return fallback
    slots = sorted((int(k), v) for k, v in policy.items() if str(k).isdigit() and isinstance(v, dict))
    if slots:  # an SGLang adaptive config
        return "; ".join(f"bs ≥ {k}: g in {{{', '.join(str(g) for g in v.get('candidate_steps', []))}}}" for k, v in slots)
    if isinstance(policy.get("schedule"), list) and policy["schedule"]:
        ranges = [r for r in policy["schedule"] if isinstance(r, list) and len(r) == 3]
        return "; ".join(f"bs {a}–{b}: g={k}" if i < len(ranges) - 1 else f"bs ≥ {a}: g={k}" for i, (a, b, k) in enumerate(ranges))
    if "steps" in policy:
        return "no speculation" if policy["steps"] == 0 else f"g={policy['steps']} at every batch size"
    if "picks" in policy:
        return str(policy["picks"])
    return fallback


def _text(value: object) -> str | None:
    if isinstance(value, dict):
        value = value.get("text")
    return str(value) if value else None


def _float(value: object) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _flagged(cells: pd.DataFrame, limit: float) -> pd.DataFrame:
    if cells.empty:
        return pd.DataFrame(columns=["server", "batch_size", "repeat", "status", "failure_rate", "why"])
    why = []
    for row in cells.itertuples():
        error = getattr(row, "error", None)
        if isinstance(error, str) and error:
            why.append(error.strip().splitlines()[0][:200])
        elif row.status == "ok":
            why.append(f"{getattr(row, 'failure_rate', math.nan):.0%} of requests failed (limit {limit:.0%})")
        else:
            why.append(str(row.status))
    return pd.DataFrame({"server": cells["server"], "batch_size": cells["batch_size"], "repeat": cells["repeat"],
                         "status": cells["status"], "failure_rate": cells.get("failure_rate"), "why": why})


def _samples(requests: pd.DataFrame, targets: set[str]) -> pd.DataFrame:
    """Prompt and output of one request on every server, at the smallest batch size: greedy outputs should match
    target-only's (speculative decoding is lossless)."""
    if requests.empty or not {"prompt", "text", "index", "cell"} <= set(requests.columns):
        return pd.DataFrame(columns=["server", "prompt", "output", "same_as_target"])
    parts = requests["cell"].str.split("__", expand=True)
    frame = requests.assign(server=parts[0], bs=parts[1].str[2:].astype(int))
    if "error" in frame:
        frame = frame[frame["error"].isna()]
    if frame.empty:
        return pd.DataFrame(columns=["server", "prompt", "output", "same_as_target"])
    first = frame[(frame["bs"] == frame["bs"].min()) & (frame["index"] == frame["index"].min())].drop_duplicates("server")
    reference = first.loc[first["server"].isin(targets), "text"]
    same = first["text"] == reference.iloc[0] if len(reference) else pd.Series(None, index=first.index, dtype=object)
    return pd.DataFrame({"server": first["server"], "prompt": first["prompt"].fillna(""), "output": first["text"].fillna(""),
                         "same_as_target": same.where(~first["server"].isin(targets), None)})
