"""`spectune confirm`: is the tuned config better, measured? Run the tuned adaptive config, SGLang's default config,
the best static g and target-only on the embedded engine with the same traffic, pass after pass (one pass = every
server once, the order rotated each pass so that whatever else loads the machine hits every server alike), until
the paired difference of each comparison is settled.

Per pass and comparison (tuned vs SGLang's default, tuned vs the best static g) the gain is the log-ratio of the
tuning objective's metric, signed so that > 0 means the tuned config did better (mean e2e lower, tokens/s higher),
averaged over the batch sizes of a closed-loop pass. Passes pair the servers: the spread between passes (the
machine's load) cancels in the difference.

Stopping rule (a group-sequential design, so that looking again and again does not turn noise into a win): the
rule looks at passes n_1 < ... < n_K (NUM_LOOKS points spread up to --max-passes, the first at --min-passes). At look
k it takes the t-interval of the mean gain at level 1 - a_k, where a_k is what an O'Brien-Fleming-type spending
function (Lan-DeMets: a(t) = 2 - 2 Phi(z_{1-a/2} / sqrt(t)), t = n_k / max passes) allows beyond the earlier looks,
so that the chance of any look claiming a difference that is not there stays within a = 5% (the intervals are
"95%" in that sense; each a_k is recorded). It stops when, for every comparison, the interval excludes 0 or is
narrower than NARROW_PCT percentage points; else at --max-passes. A difference whose interval holds 0 is reported
as "not distinguishable", never as a win.

Every pass is a results directory (RESULTS/confirm/pass-NN, spectune's sweep layout): a run cut short resumes at
the pass it stopped in, and `--run-passes N` runs at most N passes per call (the rest on the next call).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from spectune.analysis import open_loop, t_quantile
from spectune.errors import SpectuneError

ALPHA = 0.05  # chance, over all looks, of calling a difference that is not there
NARROW_PCT = 2.0  # an interval narrower than this (percentage points) settles a comparison too
NUM_LOOKS = 4
DEFAULT_MAX_PASSES = 20
DEFAULT_MIN_PASSES = 4
OUTLIER_SD = 3.0  # interleaved passes: a cell slower than its neighbours by this many robust SDs of the host's spread
# objective -> (cell metric, higher is better, words)
METRICS = {
    "throughput": ("output_throughput_tps", True, "output tokens/s"),
    "latency": ("tpot_ms_mean", False, "mean TPOT"),
    "ttft": ("ttft_ms_mean", False, "mean TTFT"),
    "tpot": ("tpot_ms_mean", False, "mean TPOT"),
    "e2e": ("e2e_ms_mean", False, "mean e2e latency"),
}
TUNED, DEFAULT, STATIC, TARGET = "tuned", "sglang-default", "static", "target"
PLACE = ["batch_size", "request_rate"]  # where a pass's four servers are compared: a batch size, and a rate in an open loop (else 0)
# What the tuned server is compared with. The best static config is whichever of the best speculative static g and
# target-only (g = 0) measured better: the verdict names it, and the rule waits for all three.
COMPARED = {DEFAULT: "SGLang's default", STATIC: "the best speculative static g", TARGET: "target-only"}


# --- statistics -----------------------------------------------------------------------------------------------


def spent_alpha(t: float, alpha: float = ALPHA) -> float:
    """Lan-DeMets O'Brien-Fleming-type spending: the error allowed by information fraction t (0 < t <= 1)."""
    z = statistics.NormalDist().inv_cdf(1 - alpha / 2)
    return 2 * (1 - statistics.NormalDist().cdf(z / math.sqrt(min(1.0, t))))


def look_schedule(min_passes: int, max_passes: int, num_looks: int = NUM_LOOKS) -> tuple[int, ...]:
    """The passes at which the rule looks: num_looks points up to max_passes, none before min_passes."""
    if min_passes < 2 or max_passes < min_passes:
        raise SpectuneError(f"--min-passes {min_passes} / --max-passes {max_passes}: need 2 <= min <= max (an interval needs 2 "
                            f"passes); e.g. --min-passes {max(2, min(min_passes, max_passes))} --max-passes {max(2, max_passes)}")
    return tuple(sorted({max(min_passes, math.ceil(max_passes * k / num_looks)) for k in range(1, num_looks + 1)}))


def look_alphas(looks: tuple[int, ...], max_passes: int, alpha: float = ALPHA) -> tuple[float, ...]:
    """Each look's share of alpha: the spending function's increase since the look before."""
    spent = [spent_alpha(n / max_passes, alpha) for n in looks]
    return tuple(s - p for s, p in zip(spent, [0.0, *spent[:-1]]))


@dataclass(frozen=True, slots=True)
class Difference:
    """One comparison after n passes: the mean gain and its interval, as percentages (the metric's relative
    improvement: lower latency or higher tokens/s; > 0 = the tuned config did better)."""

    name: str
    label: str
    passes: int
    mean_pct: float
    lo_pct: float
    hi_pct: float
    level: float  # the interval's own level (1 - a_k)

    @property
    def excludes_zero(self) -> bool:
        return self.lo_pct > 0 or self.hi_pct < 0

    @property
    def width_pct(self) -> float:
        return self.hi_pct - self.lo_pct

    @property
    def settled(self) -> bool:
        return self.excludes_zero or self.width_pct < NARROW_PCT

    def words(self) -> str:
        lo, hi = _shown(self.lo_pct), _shown(self.hi_pct)
        if self.lo_pct == self.hi_pct == 0.0:  # no spread at all: both ran the very same steps
            return f"the same as {self.label} on this traffic (+0.0%, no spread: it runs the same step counts there)"
        if self.lo_pct > 0:
            return f"better than {self.label} by {abs(self.mean_pct):.1f}% [{lo}, {hi}]"
        if self.hi_pct < 0:
            return f"worse than {self.label} by {abs(self.mean_pct):.1f}% [{_shown(-self.hi_pct)}, {_shown(-self.lo_pct)}]"
        return f"not distinguishable from {self.label} on this traffic ({self.mean_pct:+.1f}% [{lo}, {hi}])"


def _shown(pct: float) -> str:
    """A bound for print; beyond +-999% an interval says nothing more."""
    return f"{pct:.1f}" if abs(pct) < 999 else ("<-999" if pct < 0 else ">999")


def to_pct(gain: float, higher_is_better: bool) -> float:
    """A log-ratio gain as the metric's relative improvement in %: tokens/s up by e^g - 1, latency down by 1 - e^-g
    (an interval too wide to mean anything reaches +-inf)."""
    g = gain if higher_is_better else -gain
    value = math.expm1(g) if g < 700 else math.inf
    return 100.0 * (value if higher_is_better else -value)


def difference(name: str, label: str, gains: np.ndarray, level: float, higher_is_better: bool) -> Difference:
    """The t-interval of the mean per-pass gain at `level`, in % (see to_pct)."""
    n = len(gains)
    mean = float(np.mean(gains))
    half = t_quantile(1 - (1 - level) / 2, n - 1) * float(np.std(gains, ddof=1)) / math.sqrt(n) if n > 1 else math.inf
    pct = lambda g: to_pct(g, higher_is_better) if math.isfinite(g) else to_pct(math.copysign(1e9, g), higher_is_better)
    return Difference(name, label, n, pct(mean), pct(mean - half), pct(mean + half), level)


@dataclass(frozen=True, slots=True)
class Decision:
    stop: bool
    look: int | None  # the look taken at this pass count (None: not a look)
    differences: tuple[Difference, ...]


def decide(gains: pd.DataFrame, labels: dict[str, str], higher_is_better: bool, min_passes: int, max_passes: int,
           alpha: float = ALPHA) -> Decision:
    """The stopping rule (module docstring) after len(gains) passes; gains: one column per comparison, one row per
    pass. Between looks (and before the first) nothing stops; the differences shown there are at the next look's
    level."""
    looks = look_schedule(min_passes, max_passes)
    levels = dict(zip(looks, (1 - a for a in look_alphas(looks, max_passes, alpha))))
    n = len(gains)
    level = levels.get(n, levels[min((k for k in looks if k >= n), default=looks[-1])])
    diffs = tuple(difference(c, labels[c], gains[c].to_numpy(float), level, higher_is_better) for c in gains.columns)
    is_look = n in levels
    stop = n >= max_passes or (is_look and all(d.settled for d in diffs))
    return Decision(stop=stop, look=looks.index(n) + 1 if is_look else None, differences=diffs)


def verdict_text(diffs: tuple[Difference, ...], metric_words: str, passes: int, source: str, capped: bool,
                 static_steps: int | None = None) -> str:
    """One sentence a user can act on: the tuned config against SGLang's default and against the best static config
    (of the static comparisons, the one the tuned config did least well against)."""
    by_name = {d.name: d for d in diffs}
    shown = [by_name[DEFAULT]] if DEFAULT in by_name else []
    statics = [by_name[c] for c in (STATIC, TARGET) if c in by_name]
    if statics:
        best = min(statics, key=lambda d: d.mean_pct)
        what = "target-only, g=0" if best.name == TARGET else f"static g={static_steps}" if static_steps is not None else "static"
        shown.append(Difference(best.name, f"the best static config ({what})", best.passes, best.mean_pct, best.lo_pct, best.hi_pct,
                                best.level))
    body = " and ".join(d.words() for d in shown)
    tail = f"{source}, {passes} paired passes" + (", stopped at the cap" if capped else "")
    return f"tuned adaptive on {metric_words}: {body} ({tail})"


def naming_run(text: str, results_dir: object) -> str:
    """A verdict's or held-out note's text with its spectune commands naming this run: tuning.json says RESULTS (the
    directory may move), a console line or the report knows which run it is."""
    return re.sub(r"spectune (tune|confirm|sweep --resume) RESULTS", lambda m: f"spectune {m.group(1)} {results_dir}", text)


def action_text(diffs: tuple[Difference, ...], finished: bool, static_steps: int | None = None, exhausted: bool = False) -> str:
    """What to deploy, from a measured verdict: only what the intervals settle (a difference whose interval holds 0
    decides nothing), and nothing before the rule stopped."""
    if not finished and exhausted:
        return ("Not settled: every attempt was run and too many passes were disturbed to reach a look that settles it; "
                "measure again on a quieter machine (a new --out) before deploying on this evidence.")
    if not finished:
        return "Not settled yet: run spectune confirm RESULTS again to add passes before deploying on this evidence."
    by_name = {d.name: d for d in diffs}
    default = by_name.get(DEFAULT)
    statics = [by_name[c] for c in (STATIC, TARGET) if c in by_name]
    beaten_by = [d for d in [default, *statics] if d is not None and d.hi_pct < 0]
    if beaten_by:  # deploy what beat the tuned config by the most
        best = min(beaten_by, key=lambda d: d.mean_pct)
        what = {DEFAULT: "SGLang's default config", TARGET: "target-only (no speculation)"}.get(
            best.name, f"static g={static_steps}" if static_steps is not None else "the best static config")
        return f"Deploy {what}: it measured better than the tuned config on this traffic."
    if default is not None and default.lo_pct > 0:
        rest = "" if all(d.lo_pct > 0 for d in statics) else " (against the best static config the difference is within noise)"
        return f"Deploy the tuned adaptive_spec.json: it measured better than SGLang's default on this traffic{rest}."
    return ("Either will do: on this traffic the tuned config and SGLang's default differ by less than the measurement can tell; "
            "keeping SGLang's default loses nothing measurable.")


# --- running the passes ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConfirmOptions:
    results_dir: Path  # a sweep tuned by `spectune tune` (RESULTS/tuned/tuning.json)
    tuned_dir: Path | None = None  # default RESULTS/tuned
    out_dir: Path | None = None  # default RESULTS/confirm
    max_passes: int = DEFAULT_MAX_PASSES
    min_passes: int = DEFAULT_MIN_PASSES
    run_passes: int | None = None  # run at most this many passes now (resume later); None = until the rule stops
    max_foreign_cores: float = 0.3  # a pass in which any cell saw other work use more of the machine is not counted
    max_slowdown: float = 0.15  # nor one in which any cell ran this much slower than the same server's median pass (speed index)
    batch_sizes: tuple[int, ...] | None = None  # closed-loop objectives: a subset of the sweep's batch sizes


@dataclass(slots=True)
class ConfirmOutcome:
    passes: int
    finished: bool  # the rule stopped (or the cap was reached)
    verdict: dict | None  # what tuning.json "verdict" now holds (None before the first look's data)
    table: pd.DataFrame = field(default_factory=pd.DataFrame)  # per pass and server: the metric
    exhausted: bool = False  # every attempt (twice the cap) was run and too many were disturbed to finish


def confirm(options: ConfirmOptions, log: Callable[[str], None] = print) -> ConfirmOutcome:
    from spectune.progress import PlainProgress
    from spectune.store import load_run
    from spectune.sweep import run_sweep

    tuned_dir = options.tuned_dir or Path(options.results_dir) / "tuned"
    tuning = read_tuning(tuned_dir)
    out = options.out_dir or default_out_dir(Path(options.results_dir), tuning)
    sweep = load_run(options.results_dir)
    objective = tuning["objective"]
    if objective == "throughput" and open_loop(sweep.cells).any():
        objective = "latency"
        log("open loop: every server gets the same arrivals, which set output tokens/s; the passes compare mean TPOT")
    metric, higher, words = METRICS[objective]
    servers, raw = confirm_plan(sweep.manifest, tuning, tuned_dir, out, options.batch_sizes)
    cost = step_cost(sweep, tuning)
    look_schedule(options.min_passes, options.max_passes)  # bad bounds fail before anything runs
    out.mkdir(parents=True, exist_ok=True)
    check_same_config(out, tuned_dir / "adaptive_spec.json")
    alike = alike_batch_sizes(servers, raw)
    if alike:
        log(f"at batch size {', '.join(map(str, alike))} the tuned config runs SGLang's default's own slots: both are measured, "
            "and there their difference counts as 0 (the two measurements pooled)")
    ran, decision, table, cache = 0, None, pd.DataFrame(), {}
    for i in range(2 * options.max_passes):  # disturbed passes are run again, up to as many more attempts
        pass_dir = out / f"pass-{i + 1:02d}"
        if not pass_complete(pass_dir):
            if options.run_passes is not None and ran >= options.run_passes:
                break
            plan = pass_plan(raw, servers, i)
            log(f"confirm pass {i + 1} (at most {options.max_passes}): {', '.join(s['name'] for s in plan_servers(servers, i))}")
            outcome = run_sweep(plan, pass_dir, resume=(pass_dir / "run.json").exists(), progress=PlainProgress(log))
            ran += 1
            if outcome.interrupted:
                raise KeyboardInterrupt
            if outcome.failed:
                raise SpectuneError(f"{pass_dir}: {outcome.failed} cell(s) failed; their causes are in {pass_dir}/cells/*.json")
        table = pool_alike(pass_table(out, i + 1, metric, options.max_foreign_cores, cost, options.max_slowdown, cache), alike)
        if not table.empty and table.loc[table["pass"] == i + 1, "disturbed"].any():
            log(f"pass {i + 1}: disturbed (other work on this machine, or the engine ran more than {options.max_slowdown:.0%} slower than "
                "in the other passes, or than the pass's other cells beyond the host's usual spread when interleaved); not counted, run again")
        gains = pass_gains(table[~table["disturbed"]], higher) if not table.empty else pass_gains(table, higher)
        # a pass judged disturbed earlier can count later (the median moved): never count more than the cap
        gains = gains.iloc[: options.max_passes]
        # which passes count can change as passes come (the median speed moves), so decide on this table only
        decision = decide(gains, COMPARED, higher, options.min_passes, options.max_passes) if len(gains) >= 2 else None
        if decision is not None and decision.stop:
            break
    n = len(gains) if decision is not None else 0
    verdict = None
    if decision is not None:
        verdict = measured_verdict(decision, n, words, metric, objective, options, servers, out, table, alike,
                                   exhausted=not decision.stop and attempts_used(out, options.max_passes))
        write_verdict(tuned_dir, verdict)
        log(naming_run(verdict["text"], options.results_dir))
    finished = bool(decision and decision.stop)
    exhausted = not finished and attempts_used(out, options.max_passes)
    if exhausted:
        log(f"all {2 * options.max_passes} attempts were run and only {n} passes counted (the others were disturbed): another call "
            "adds nothing here; measure on a quieter machine with a new --out")
    return ConfirmOutcome(passes=n, finished=finished, verdict=verdict, table=table, exhausted=exhausted)


def attempts_used(out: Path, max_passes: int) -> bool:
    """Whether every attempt a confirm may run (twice the cap: disturbed passes are run again) has been run."""
    return all(pass_complete(out / f"pass-{i + 1:02d}") for i in range(2 * max_passes))


def check_same_config(out: Path, config_file: Path) -> None:
    """The passes in `out` measured one tuned config: the first call keeps a copy of it there, a later call with
    another config (re-tuned since) is refused instead of mixing its passes with the old ones."""
    from spectune.store import atomic_write_bytes

    measured = out / "tuned-adaptive.json"
    current = json.loads(config_file.read_text())
    if not measured.exists():
        atomic_write_bytes(measured, (json.dumps(current, indent=2) + "\n").encode())
    elif json.loads(measured.read_text()) != current:
        raise SpectuneError(f"{config_file}: not the config the passes in {out} measured ({measured}); the tuned config changed since. "
                            f"Measure it with --out {out.parent / (out.name + '-new')}, or remove {out} to start over")


def default_out_dir(results_dir: Path, tuning: dict) -> Path:
    """RESULTS/confirm for a tuned config, RESULTS/confirm-<k> for its k-th round (spectune.refine): a refined
    config is measured on new passes, never on the ones it was chosen on."""
    from spectune.refine import round_in

    round_ = round_in(tuning)
    return results_dir / ("confirm" if round_ == 1 else f"confirm-{round_}")


def read_tuning(tuned_dir: Path) -> dict:
    path = tuned_dir / "tuning.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SpectuneError(f"{path}: not found; run `spectune tune RESULTS` first (confirm measures what it tuned)") from None


def best_static_steps(tuning: dict) -> int:
    """The best static speculative g (>= 1) on the tuning bench."""
    speedups = {int(g): s for g, s in tuning["policies"]["static_speedups"].items() if int(g) > 0}
    return max(speedups, key=speedups.get)


def confirm_plan(manifest: dict, tuning: dict, tuned_dir: Path, out: Path,
                 batch_sizes: tuple[int, ...] | None) -> tuple[list[dict], dict]:
    """The four servers (target-only, the best static g, the tuned config, SGLang's default; all of the tuned
    engine and method, as the sweep launched them) and the traffic of a pass: the replayed traffic on its arrival
    times for the replay objectives, else the sweep's closed loop. On the embedded engine the pass is interleaved
    (plan.interleave), as the sweep plan may ask on any engine."""
    from spectune.adaptive import SGLANG_DEFAULT_CONFIG
    from spectune.emit import write_sglang_config

    plan = dict(manifest["plan"])
    engine, method = tuning["engine"], tuning["method"]
    target, spec = swept_servers(plan, engine, method)
    if target is None or spec is None:
        raise SpectuneError(f"{tuned_dir / 'tuning.json'}: the sweep has no target-only or static {method} server on {engine} to confirm with")
    if attached := attached_servers(plan, engine, method):
        raise SpectuneError(f"{tuned_dir / 'tuning.json'}: the sweep attached {' and '.join(attached)} by url; confirm launches each "
                            "config it compares (tuned, SGLang's default, the best static g) as a server of its own and cannot "
                            "change what a running server runs: sweep with servers spectune launches (no url) to confirm, or "
                            "launch the tuned config with its command in tuned/deploy.md and measure it with spectune bench")
    out.mkdir(parents=True, exist_ok=True)
    default_file = write_sglang_config(SGLANG_DEFAULT_CONFIG, out / "sglang-default-adaptive.json")
    base = {k: v for k, v in spec.items() if k not in ("name", "num_speculative_tokens", "adaptive_config")}
    g = best_static_steps(tuning)
    servers = [
        {**{k: v for k, v in target.items() if k != "name"}, "name": TARGET},
        {**base, "name": f"{STATIC}-g{g}", "num_speculative_tokens": g},
        {**base, "name": TUNED, "adaptive_config": str((tuned_dir / "adaptive_spec.json").resolve())},
        {**base, "name": DEFAULT, "adaptive_config": str(default_file.resolve())},
    ]
    raw = {k: v for k, v in plan.items() if k not in ("servers", "name")}
    raw |= {"name": "confirm", "repeats": 1}
    if engine == "embedded":  # four small servers fit at once: each batch size's four cells run back to back
        raw["interleave"] = True
    if "traffic" in tuning:  # a replay objective: the replayed traffic, once, on its arrival times
        source = tuning.get("traffic_source") or plan["workload"]
        raw |= {"workload": source, "schedule": "trace", "batch_sizes": [tuning["traffic"]["max_num_seqs"]],
                "prompts_per_slot": 1, "min_prompts": tuning["traffic"]["requests"], "warmup_per_slot": 0}
    elif batch_sizes:
        unknown = sorted(set(batch_sizes) - set(plan["batch_sizes"]))
        if unknown:
            raise SpectuneError(f"--batch-sizes: {unknown} were not swept; choose from {plan['batch_sizes']}")
        raw["batch_sizes"] = sorted(batch_sizes)
    return servers, raw


def swept_servers(plan: dict, engine: str, method: str) -> tuple[dict | None, dict | None]:
    """The plan's target-only server and its first static `method` server on `engine`: what confirm launches again."""
    swept = plan.get("servers") or []
    target = next((s for s in swept if not s.get("method") and s.get("engine", "embedded") == engine), None)
    spec = next((s for s in swept if s.get("method") == method and s.get("engine", "embedded") == engine and not s.get("adaptive_config")), None)
    return target, spec


def attached_servers(plan: dict, engine: str, method: str) -> list[str]:
    """Of those, the ones the sweep attached by url: confirm cannot run its configs on them."""
    return [s["name"] for s in swept_servers(plan, engine, method) if s is not None and s.get("url")]


def alike_batch_sizes(servers: list[dict], raw: dict) -> tuple[int, ...]:
    """The batch sizes of a pass at which the tuned config decides exactly as SGLang's default for every batch the
    run can form (1 up to that size: spectune.adaptive.runs_alike), e.g. where spectune.refine kept the default's
    slots."""
    from spectune.adaptive import AdaptiveConfig, runs_alike
    from spectune.emit import never_drafts, sglang_launch_steps

    configs = {s["name"]: AdaptiveConfig.from_file(s["adaptive_config"]) for s in servers if s["name"] in (TUNED, DEFAULT)}
    tuned, default = configs[TUNED], configs[DEFAULT]
    if never_drafts(tuned):
        return ()
    launch = (sglang_launch_steps(tuned), sglang_launch_steps(default))
    return tuple(b for b in raw["batch_sizes"] if runs_alike(tuned, default, *launch, b))


def pool_alike(table: pd.DataFrame, alike: tuple[int, ...]) -> pd.DataFrame:
    """At the batch sizes where the tuned config and SGLang's default are one config (alike_batch_sizes), each pass's
    two measurements of it are pooled: both get their mean, so their difference is 0 there and the comparisons with
    the static servers use both measurements."""
    if table.empty or not alike:
        return table
    pair = table["role"].isin([TUNED, DEFAULT]) & table["batch_size"].isin(alike)
    pooled = table[pair].groupby(["pass", *PLACE])["value"].transform("mean")
    return table.assign(value=table["value"].where(~pair, pooled))


def plan_servers(servers: list[dict], index: int) -> list[dict]:
    """Pass `index`'s server order: the list rotated by one server per pass."""
    shift = index % len(servers)
    return servers[shift:] + servers[:shift]


def pass_plan(raw: dict, servers: list[dict], index: int):
    from spectune.plan import plan_from_dict

    return plan_from_dict({**raw, "servers": plan_servers(servers, index)}, source=f"confirm pass {index + 1}")


def pass_complete(pass_dir: Path) -> bool:
    path = pass_dir / "run.json"
    return path.exists() and json.loads(path.read_text()).get("status") == "complete"


def step_cost(sweep, tuning: dict):
    """The tuning sweep's calibrated step costs, to tell how fast the engine ran in a pass (None without step clocks)."""
    from spectune.calibration import calibrate
    from spectune.steplog import has_step_clocks

    if tuning.get("engine") != "embedded" or not has_step_clocks(sweep):
        return None
    return calibrate(sweep, tuning["engine"], tuning["method"]).cost


def pass_table(out: Path, num_passes: int, metric: str, max_foreign_cores: float = math.inf, cost=None,
               max_slowdown: float = math.inf, cache: dict | None = None) -> pd.DataFrame:
    """One row per finished pass, server and batch size: the metric (role: tuned, sglang-default, static, target), the
    cores other work used meanwhile, the engine's speed index (spectune.calibration.speed_index, with `cost`), and
    whether the pass was disturbed: a cell above max_foreign_cores, or with a speed index more than max_slowdown
    above the median of the same server and batch size over the passes (in an interleaved pass: of the pass's cells at
    that batch size, run back to back, so a slowdown all four shared cancels in their differences). A disturbed pass
    is not counted. `cache`
    keeps each finished pass's rows between calls (reading its round logs is the slow part)."""
    cache = {} if cache is None else cache
    frames = []
    for i in range(1, num_passes + 1):
        pass_dir = out / f"pass-{i:02d}"
        if i not in cache and pass_complete(pass_dir):
            cache[i] = _pass_rows(pass_dir, i, metric, cost)
        if i in cache:
            frames.append(cache[i])
    table = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["pass", "server", "role", *PLACE, "value",
                                                                                       "foreign_cpu_cores", "speed_index", "interleaved"])
    if not table.empty and table.groupby(PLACE)["traffic_digest"].nunique().max() > 1:
        raise SpectuneError(f"{out}: the passes sent different traffic (traffic digests differ); start over with a new --out")
    if table.empty:
        return table.assign(speed_index=np.nan, disturbed=False)
    return mark_disturbed(table, max_foreign_cores, max_slowdown)


def mark_disturbed(table: pd.DataFrame, max_foreign_cores: float, max_slowdown: float) -> pd.DataFrame:
    """pass_table's `disturbed` column: every row of a pass with a cell above max_foreign_cores, or one that ran slow.
    One server after another, slow is a speed index more than max_slowdown above the same server's median over the
    passes. In an interleaved pass a slowdown all of a batch size's cells share cancels in their differences, so slow
    is against the pass's other cells at that batch size: by more than max_slowdown and by more than OUTLIER_SD robust
    standard deviations of that ratio over every interleaved cell (a noisy host's routine spread is no disturbance)."""
    across = table.groupby(["server", *PLACE])["speed_index"].transform("median")
    interleaved = table["interleaved"].astype(bool)
    ratio = np.log(table["speed_index"] / table.groupby(["pass", *PLACE])["speed_index"].transform("median"))
    spread = 1.4826 * float(ratio[interleaved].abs().median()) if interleaved.any() else 0.0
    limit = max(math.log1p(max_slowdown), OUTLIER_SD * spread) if math.isfinite(spread) else math.log1p(max_slowdown)
    slow = (ratio > limit).where(interleaved, table["speed_index"] > across * (1 + max_slowdown))
    bad = (table["foreign_cpu_cores"] > max_foreign_cores) | slow.astype(bool)
    return table.assign(disturbed=bad.groupby(table["pass"]).transform("any").to_numpy(bool))


def _pass_rows(pass_dir: Path, number: int, metric: str, cost) -> pd.DataFrame:
    from spectune.calibration import speed_index
    from spectune.store import load_run

    run = load_run(pass_dir)
    cells = run.cells[run.cells["status"] == "ok"]
    speed = speed_index(run, cost).reindex(cells["cell"]).to_numpy() if cost is not None else np.full(len(cells), np.nan)
    rate = cells.get("request_rate", pd.Series(np.nan, index=cells.index)).fillna(0.0)
    return pd.DataFrame({"pass": number, "server": cells["server"], "role": cells["server"].map(_role), "batch_size": cells["batch_size"],
                         "request_rate": rate, "value": cells[metric], "traffic_digest": cells["traffic_digest"],
                         "foreign_cpu_cores": cells.get("foreign_cpu_cores", pd.Series(np.nan, index=cells.index)), "speed_index": speed,
                         "interleaved": bool(run.manifest["plan"].get("interleave", False))})


def _role(server: str) -> str:
    return STATIC if server.startswith(STATIC + "-g") else server


def pass_gains(table: pd.DataFrame, higher_is_better: bool) -> pd.DataFrame:
    """Per pass (rows) and comparison (columns): the tuned server's log-ratio gain, averaged over batch sizes."""
    if table.empty:
        return pd.DataFrame(columns=list(COMPARED))
    wide = table.pivot_table(index=["pass", *PLACE], columns="role", values="value")
    sign = 1.0 if higher_is_better else -1.0
    gains = pd.DataFrame({c: sign * np.log(wide[TUNED] / wide[c]) for c in COMPARED})
    return gains.groupby(level="pass").mean().dropna()


def batch_size_gains(table: pd.DataFrame, higher_is_better: bool, passes: int) -> list[dict]:
    """Per batch size: the tuned server's mean gain (%) over each compared server, over the first `passes` counted
    passes (the ones the verdict counts)."""
    if table.empty:
        return []
    counted = sorted(table["pass"].unique())[:passes]
    wide = table[table["pass"].isin(counted)].pivot_table(index=["pass", "batch_size"], columns="role", values="value")
    sign = 1.0 if higher_is_better else -1.0
    rows = []
    for b, part in wide.groupby(level="batch_size"):
        gains = {c: _finite(to_pct(float(np.mean(sign * np.log(part[TUNED] / part[c]))), higher_is_better)) for c in COMPARED if c in part}
        rows.append({"batch_size": int(b), "gain_pct": gains})
    return rows


def split_text(by_batch_size: list[dict]) -> str:
    """Where another measured config did better on average than the tuned config, when keeping the better one's slots
    at each batch size gives a config of its own (spectune.refine); else ""."""
    from spectune.refine import choose_slots

    kept = [c.kept for c in choose_slots(by_batch_size)]
    if len(set(kept)) < 2:  # the tuned config, or one other config, did best everywhere: the verdict already says which
        return ""
    behind = [str(r["batch_size"]) for r, k in zip(sorted(by_batch_size, key=lambda r: r["batch_size"]), kept) if k != TUNED]
    return (f" On average over these passes another config did better at batch size {', '.join(behind)}: "
            "`spectune tune RESULTS --refine` keeps the best measured slots at each batch size, and `spectune confirm RESULTS` "
            "measures that on new passes.")


def measured_verdict(decision: Decision, passes: int, words: str, metric: str, objective: str, options: ConfirmOptions,
                     servers: list[dict], out: Path, table: pd.DataFrame, alike: tuple[int, ...] = (), exhausted: bool = False) -> dict:
    capped = decision.stop and not all(d.settled for d in decision.differences)
    disturbed = sorted(int(p) for p in table.loc[table["disturbed"], "pass"].unique())
    table = table[~table["disturbed"]]
    means = table.groupby("role")["value"].mean()
    higher = METRICS[objective][1]
    by_batch_size = batch_size_gains(table, higher, passes) if table["batch_size"].nunique() > 1 else []
    split = split_text(by_batch_size) if decision.stop else ""
    return {
        "text": verdict_text(decision.differences, words, passes, "measured", capped, _static_steps(servers)) + ". "
                + action_text(decision.differences, decision.stop, _static_steps(servers), exhausted) + split + _alike_text(alike),
        "by_batch_size": by_batch_size,
        "alike_batch_sizes": list(alike),
        "source": "measured",
        "objective": objective,
        "metric": metric,
        "passes": passes,
        "finished": decision.stop,
        "stopped_by": ("cap" if capped else "rule") if decision.stop else None,
        "comparisons": [{"name": d.name, "label": d.label, "mean_pct": d.mean_pct, "lo_pct": _finite(d.lo_pct), "hi_pct": _finite(d.hi_pct),
                         "interval_level": d.level, "excludes_zero": d.excludes_zero, "settled": d.settled} for d in decision.differences],
        "mean_by_server": {role: float(v) for role, v in means.items()},
        "per_pass": table.pivot_table(index="pass", columns="role", values="value").reset_index().to_dict("records"),
        "foreign_cpu_cores": {"mean": _finite(table["foreign_cpu_cores"].mean()), "max": _finite(table["foreign_cpu_cores"].max()),
                              "meaning": "cores other work on the machine used during the cells (spectune.hostload)"},
        "stopping_rule": (f"paired passes, server order rotated; looks at passes {list(look_schedule(options.min_passes, options.max_passes))} "
                          f"(cap {options.max_passes}); at each, the t-interval of the mean log-ratio at the level an O'Brien-Fleming-type "
                          f"alpha-spending function allows (overall {100 * (1 - ALPHA):.0f}%); stop when every interval excludes 0 or is "
                          f"narrower than {NARROW_PCT:g} points; a pass is run again, not counted, when in any cell other work used "
                          f"more than {options.max_foreign_cores:g} cores of the machine or the engine's steps ran more than "
                          f"{options.max_slowdown:.0%} slower (against the tuning sweep's step costs) than in the same server's median pass "
                          f"(in an interleaved pass: than the median of that pass's cells at the batch size, and by more than "
                          f"{OUTLIER_SD:g} robust SDs of that ratio over the interleaved cells)"),
        "passes_not_counted": disturbed,
        "attempts_exhausted": exhausted,
        "servers": [s["name"] for s in servers],
        "confirm_dir": str(out),
    }


def _alike_text(alike: tuple[int, ...]) -> str:
    if not alike:
        return ""
    return (f" At batch size {', '.join(map(str, alike))} the tuned config runs SGLang's default's own slots, so there the two "
            "differ by 0 by construction (both were measured; their measurements are pooled).")


def _static_steps(servers: list[dict]) -> int | None:
    return next((int(s["num_speculative_tokens"]) for s in servers if s["name"].startswith(STATIC + "-g")), None)


def _finite(x: float) -> float | None:
    return float(x) if x == x and math.isfinite(x) else None


def write_verdict(tuned_dir: Path, verdict: dict) -> None:
    """Put `verdict` into tuning.json (the other keys untouched)."""
    from spectune.store import atomic_write_bytes

    path = tuned_dir / "tuning.json"
    report = json.loads(path.read_text())
    report["verdict"] = verdict
    atomic_write_bytes(path, (json.dumps(report, indent=2, allow_nan=False) + "\n").encode())
