"""`spectune tune RESULTS --refine`: keep, at each measured batch size, the slot that measured best.

The simulator ranks configs; `spectune confirm` measures four of them (the tuned config, SGLang's default, the best
static g, target-only) at every batch size of the sweep. SGLang's slots are independent (each batch size routes to
one slot, with its own EMA and counters), so a config can take, batch-size range by batch-size range, the slots of
whichever of the four measured best there: from measured batch size b up to the next one it runs exactly what that
config runs over the range. A choice made on these passes is biased towards their noise (the best of four means is
too good by construction), so the refined config has no measured verdict of its own until `spectune confirm` has
measured it on new passes (RESULTS/confirm-<round>).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from spectune.adaptive import SGLANG_DEFAULT_CONFIG, AdaptiveConfig, SlotConfig
from spectune.emit import never_drafts
from spectune.errors import SpectuneError

# confirm's server roles, in the order a tie is broken (keep what is already tuned)
ROLES = ("tuned", "sglang-default", "static", "target")
WORDS = {"tuned": "the tuned config", "sglang-default": "SGLang's default", "static": "the best static g", "target": "target-only"}


@dataclass(frozen=True, slots=True)
class SlotChoice:
    """At one measured batch size: the role kept and every role's mean gain over the tuned config (%, > 0 = better
    than tuned), over the confirm's counted passes."""

    batch_size: int
    kept: str
    gain_pct: dict[str, float]


def slot_sources(tuned: AdaptiveConfig, static_steps: int | None) -> dict[str, AdaptiveConfig]:
    """Each confirm role as an adaptive config (a static g is a one-rung ladder, target-only the ladder [0])."""
    sources = {"tuned": tuned, "sglang-default": SGLANG_DEFAULT_CONFIG, "target": AdaptiveConfig({1: SlotConfig([0])})}
    if static_steps is not None:
        sources["static"] = AdaptiveConfig({1: SlotConfig([static_steps])})
    return sources


def choose_slots(by_batch_size: list[dict]) -> list[SlotChoice]:
    """by_batch_size: the measured verdict's rows ({"batch_size", "gain_pct": {role: tuned's gain over it}}). The
    role kept at a batch size is the one the tuned config gained least against (negative: it did better)."""
    choices = []
    for row in sorted(by_batch_size, key=lambda r: int(r["batch_size"])):
        over_tuned = {"tuned": 0.0} | {role: -float(g) for role, g in row["gain_pct"].items() if g is not None}
        kept = max(ROLES, key=lambda r: (over_tuned.get(r, float("-inf")), -ROLES.index(r)))
        choices.append(SlotChoice(int(row["batch_size"]), kept, over_tuned))
    return choices


def merge_slots(choices: list[SlotChoice], sources: dict[str, AdaptiveConfig]) -> AdaptiveConfig:
    """One config that runs, from each measured batch size up to the next (the first from batch size 1), exactly
    what its chosen source runs there: the source's slot routing the range's start, then its slots inside the range.
    Neighbouring ranges that run the same slot of the same source stay one slot (one EMA, as in the source)."""
    starts = [1] + [c.batch_size for c in choices[1:]]
    ends = [*starts[1:], None]
    slots: dict[int, tuple[str, int]] = {}  # new bound -> (source role, the source's bound)
    for choice, start, end in zip(choices, starts, ends):
        source = sources[choice.kept]
        slots[start] = (choice.kept, _routed(source, start))
        slots |= {b: (choice.kept, b) for b in source.slots if b > start and (end is None or b < end)}
    merged: dict[int, tuple[str, int]] = {}
    for bound in sorted(slots):
        if not merged or slots[bound] != merged[max(merged)]:
            merged[bound] = slots[bound]
    return AdaptiveConfig(slots={bound: sources[role].slots[b] for bound, (role, b) in merged.items()})


def _routed(cfg: AdaptiveConfig, batch_size: int) -> int:
    """The slot bound an unpadded batch of this size routes to (SGLang: the largest bound <= it, else the smallest)."""
    below = [b for b in cfg.slots if b <= batch_size]
    return max(below) if below else min(cfg.slots)


def refine(tuned_dir: Path) -> tuple[AdaptiveConfig, dict]:
    """The refined config from tuned_dir/tuning.json's measured verdict, and the record tuning.json keeps of it.
    Archives the measured round's files in tuned_dir/round-<k>/."""
    path = tuned_dir / "tuning.json"
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise SpectuneError(f"{path}: not found; run `spectune tune RESULTS` and `spectune confirm RESULTS` first") from None
    verdict = report.get("verdict") or {}
    if verdict.get("source") == "measured" and verdict.get("by_batch_size") == []:
        raise SpectuneError(f"{path}: the measured verdict compared one batch size only, so there is nothing to combine (refining "
                            "keeps at each batch size the slots of whichever config measured best there); deploy what the "
                            "verdict says, or sweep and confirm at two batch sizes or more")
    if verdict.get("source") != "measured" or not verdict.get("by_batch_size"):
        raise SpectuneError(f"{path}: no measured verdict by batch size to refine from; run `spectune confirm RESULTS` first "
                            "(with this spectune version)")
    if not verdict.get("finished") and verdict.get("attempts_exhausted"):
        raise SpectuneError(f"{path}: the measured verdict did not settle in every attempt its confirm allows ({verdict.get('passes')} "
                            "passes counted); measure again on a quieter machine (spectune confirm RESULTS --out NEW_DIR), then refine")
    if not verdict.get("finished"):
        raise SpectuneError(f"{path}: the measured verdict is not settled yet ({verdict.get('passes')} passes); run `spectune confirm "
                            "RESULTS` until it stops, then refine")
    tuned = AdaptiveConfig.from_dict(report["policies"]["tuned_adaptive"], source=f"{path}: policies.tuned_adaptive")
    static = report.get("policies", {}).get("best_static", {}).get("steps")
    choices = choose_slots(verdict["by_batch_size"])
    refined = merge_slots(choices, slot_sources(tuned, int(static) if static is not None else None))
    previous_round = round_in(report)
    sizes = ", ".join(str(c.batch_size) for c in choices)
    kept = {c.kept for c in choices}
    if refined.to_dict() == tuned.to_dict() or kept == {"tuned"}:
        raise SpectuneError(f"{path}: the tuned config measured best at every batch size ({sizes}); nothing to refine")
    if len(kept) == 1:
        raise SpectuneError(f"{path}: {WORDS[kept.pop()]} measured best at every batch size ({sizes}); deploy it, there is nothing to combine")
    if never_drafts(refined):
        raise SpectuneError(f"{path}: the slots that measured best never draft (target-only or g = 0 at every batch size: {sizes}); "
                            "launch without speculative decoding")
    archive = tuned_dir / f"round-{previous_round}"
    archive.mkdir(parents=True, exist_ok=True)
    for name in ("adaptive_spec.json", "tuning.json", "deploy.md"):
        if (tuned_dir / name).exists():
            shutil.copy2(tuned_dir / name, archive / name)
    record = {
        "round": previous_round + 1,
        "from_round": str(archive),
        "from_config": tuned.to_dict(),
        "from_verdict": verdict["text"],
        "passes": verdict["passes"],
        "slots_kept": [{"batch_size": c.batch_size, "kept": c.kept, "gain_over_tuned_pct": c.gain_pct} for c in choices],
        "meaning": ("from each measured batch size up to the next, the slots of whichever confirmed config measured best "
                    "there (gain over the tuned config, mean of the counted passes); chosen on those passes, so measured "
                    "again on new ones"),
    }
    return refined, record


def round_in(report: dict) -> int:
    """A tuning.json's round: 1 as tuned, k after k - 1 refinements."""
    return int(report.get("refined", {}).get("round", 1))


def kept_text(record: dict) -> str:
    return "; ".join(f"batch {c['batch_size']}: {WORDS[c['kept']]}" for c in record["slots_kept"])
