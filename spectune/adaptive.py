"""SGLang's adaptive speculative-step policy (as released in 0.5.23), reimplemented to decide exactly as the server does.

The server keeps one *slot* per batch-size lower bound. After every verify pass the slot that the
batch routes to smooths the mean number of accepted drafts per request (the bonus token excluded)
with an EMA, and every `update_interval` passes after `warmup_batches` it moves along its ladder
of candidate step counts. tests/test_adaptive.py drives this module and SGLang's own released code
with the same random traces and requires identical decisions.

Read from sglang/srt/speculative/adaptive_spec_params.py, adaptive_runtime_state.py and
arg_groups/cuda_graph_hook.py of the 0.5.23 wheel. One thing the server does that the policy
cannot see: it pads batch sizes only when it was launched with an explicit `--cuda-graph-bs-decode`
(the worker passes that raw flag, which is None by default, to the policy), so a default launch
routes unpadded; `AdaptivePolicy.from_config(..., cuda_graph_bs=[])` simulates that launch.
"""

from __future__ import annotations

import bisect
import difflib
import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

from spectune.errors import SpectuneError


@dataclass(slots=True)
class SlotConfig:
    """One batch-size slot of adaptive_spec.json; the defaults are SGLang's."""

    candidate_steps: list[int]
    ema_alpha: float = 0.2
    update_interval: int = 5
    warmup_batches: int = 10
    down_hysteresis: float = -0.25
    up_hysteresis: float = 0.0
    ceiling_coeff: float = 0.0  # 0 = no ceiling


SLOT_KEYS = tuple(f.name for f in fields(SlotConfig))
_TUNING_KEYS = SLOT_KEYS[1:]  # may also sit at the top level, as defaults for every slot


@dataclass(slots=True)
class AdaptiveConfig:
    """A validated adaptive_spec.json: slots keyed by the smallest batch size they serve."""

    slots: dict[int, SlotConfig]

    @classmethod
    def from_dict(cls, obj: object, source: str = "adaptive config") -> "AdaptiveConfig":
        """Parse SGLang's JSON shape (top-level tuning keys are defaults merged into every slot).

        Stricter than SGLang: anything it would ignore, crash on or silently reinterpret is a
        SpectuneError naming `source` and the key.
        """
        if not isinstance(obj, dict):
            raise SpectuneError(f'{source}: must be a JSON object of batch-size slots, e.g. {{"1": {{"candidate_steps": [1, 3]}}}}')
        defaults: dict[str, object] = {}
        raw_slots: dict[int, dict] = {}
        for key, value in obj.items():
            if key.isascii() and key.isdigit():
                raw_slots[_slot_bound(key, source)] = _slot_dict(key, value, source)
            elif key in _TUNING_KEYS:
                _check_value(key, value, f'"{key}"', source)
                defaults[key] = value
            else:
                raise SpectuneError(_top_level_key_error(key, source))
        if not raw_slots:
            raise SpectuneError(f'{source}: no batch-size slot; add at least one, e.g. "1": {{"candidate_steps": [1, 3]}} '
                                "(SGLang refuses to start)")
        slots = {bound: SlotConfig(**{**defaults, **raw}) for bound, raw in sorted(raw_slots.items())}
        return cls(slots=slots)

    @classmethod
    def from_file(cls, path: str | Path) -> "AdaptiveConfig":
        return cls.from_dict(read_json(path), source=str(path))

    def to_dict(self) -> dict[str, dict]:
        """SGLang's JSON shape, every field written out per slot so the file reads on its own."""
        out = {}
        for bound, slot in sorted(self.slots.items()):
            out[str(bound)] = {name: getattr(slot, name) for name in SLOT_KEYS}
            out[str(bound)]["candidate_steps"] = list(slot.candidate_steps)
        return out


def read_json(path: str | Path) -> object:
    """Load a JSON file; a missing file, bad JSON or a repeated key is a SpectuneError naming the file."""

    def no_repeats(pairs: list[tuple[str, object]]) -> dict:
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise SpectuneError(f'{path}: key "{key}" appears twice (JSON readers keep only the last); remove one')
            seen[key] = value
        return seen

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise SpectuneError(f"{path}: cannot read ({e.strerror}); check the path") from None
    try:
        return json.loads(text, object_pairs_hook=no_repeats)
    except json.JSONDecodeError as e:
        raise SpectuneError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None


def _slot_bound(key: str, source: str) -> int:
    bound = int(key)
    if bound < 1 or key != str(bound):
        raise SpectuneError(f'{source}: slot key "{key}": must be a batch size >= 1 written without leading zeros, '
                            f'e.g. "{max(bound, 1)}"')
    return bound


def _slot_dict(key: str, value: object, source: str) -> dict:
    where = f'slot "{key}"'
    if not isinstance(value, dict):
        raise SpectuneError(f'{source}: {where} = {_show(value)}: must be an object like {{"candidate_steps": [1, 3]}} '
                            "(SGLang would crash)")
    if "candidate_steps" not in value:
        raise SpectuneError(f'{source}: {where}.candidate_steps is missing: each slot needs its ladder of step counts, e.g. [1, 3]')
    for name, item in value.items():
        if name not in SLOT_KEYS:
            hint = did_you_mean(name, SLOT_KEYS)
            raise SpectuneError(f'{source}: {where} has unknown key "{name}" (SGLang ignores it); {hint}')
        _check_value(name, item, f"{where}.{name}", source)
    return {**value, "candidate_steps": list(value["candidate_steps"])}


def _top_level_key_error(key: str, source: str) -> str:
    if key == "strategy":
        return f'{source}: "strategy" is read only by an unreleased SGLang main, not by 0.5.23 (which ignores it); remove it'
    if key == "candidate_steps":
        return (f'{source}: top-level "candidate_steps" is the flat schema of SGLang 0.5.11-0.5.12, which spectune does not support; '
                f'put it in a slot, e.g. "1": {{"candidate_steps": [1, 3]}}')
    if key.strip().isdecimal():
        return f'{source}: slot key "{key}": write the batch size in plain digits alone, e.g. "{int(key.strip())}"'
    return f'{source}: unknown key "{key}" (SGLang ignores it); {did_you_mean(key, _TUNING_KEYS)}'


def did_you_mean(name: str, valid: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    return f'did you mean "{close[0]}"?' if close else f"expected one of: {', '.join(valid)}"


def _show(value: object) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return (is_int(v) or isinstance(v, float)) and math.isfinite(v)


# name -> (test, what the value must be). SGLang checks none of these but candidate_steps.
_RULES = {
    "ema_alpha": (lambda v: _is_number(v) and 0 < v <= 1, "must be a number with 0 < ema_alpha <= 1 "
                  "(SGLang does not check: 0 freezes the EMA, above 1 makes it oscillate)"),
    "update_interval": (lambda v: is_int(v) and v >= 1, "must be an integer >= 1 (SGLang would crash at run time)"),
    "warmup_batches": (lambda v: is_int(v) and v >= 0, "must be an integer >= 0"),
    "down_hysteresis": (_is_number, "must be a finite number"),
    "up_hysteresis": (_is_number, "must be a finite number"),
    "ceiling_coeff": (lambda v: _is_number(v) and v >= 0, "must be a number >= 0 (0 turns the ceiling off)"),
}


def _check_value(name: str, value: object, where: str, source: str) -> None:
    if name == "candidate_steps":
        problem = _ladder_problem(value)
    elif isinstance(value, bool):
        problem = f"must be a number, not a boolean (SGLang would read it as {int(value)})"
    else:
        test, rule = _RULES[name]
        problem = None if test(value) else rule
    if problem:
        raise SpectuneError(f"{source}: {where} = {_show(value)}: {problem}")


def _ladder_problem(steps: object) -> str | None:
    if not isinstance(steps, list) or not steps:
        return "must be a non-empty list of step counts, e.g. [1, 3, 5] (SGLang refuses to start)"
    if any(isinstance(s, bool) for s in steps):
        return "must hold integers, not booleans (SGLang would read true as 1)"
    if not all(is_int(s) and s >= 0 for s in steps):
        return "must hold integers >= 0 (0 = no speculation)"
    if any(a >= b for a, b in zip(steps, steps[1:])):
        return f"must be sorted ascending without repeats, e.g. {sorted(set(steps))} (SGLang sorts silently)"
    return None


def _preset(obj: dict) -> AdaptiveConfig:
    return AdaptiveConfig.from_dict(obj, source="built-in preset")


# SGLang's built-in config (DEFAULT_ADAPTIVE_CONFIG since 0.5.20), used when no file is given.
SGLANG_DEFAULT_CONFIG = _preset({
    "1": {"candidate_steps": [1, 3, 5, 7], "up_hysteresis": 0.0, "down_hysteresis": -0.25, "ceiling_coeff": 0},
    "8": {"candidate_steps": [0, 1, 3], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
    "32": {"candidate_steps": [0, 1], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
    "64": {"candidate_steps": [0], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
})
# The two presets of SGLang's adaptive-speculation guide (for weak and for strong draft models).
CONSERVATIVE_PRESET = _preset({
    "1": {"candidate_steps": [1, 3, 7], "up_hysteresis": 0.0, "down_hysteresis": -0.25, "ceiling_coeff": 0},
    "8": {"candidate_steps": [1, 3], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
    "32": {"candidate_steps": [1], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
})
AGGRESSIVE_PRESET = _preset({
    "1": {"candidate_steps": [1, 3, 7], "up_hysteresis": 0.0, "down_hysteresis": -0.25, "ceiling_coeff": 0},
    "8": {"candidate_steps": [1, 3, 7], "up_hysteresis": 0.0, "down_hysteresis": -0.25, "ceiling_coeff": 3.0},
    "64": {"candidate_steps": [1, 3], "up_hysteresis": 0.0, "down_hysteresis": -0.25, "ceiling_coeff": 1.67},
    "128": {"candidate_steps": [1, 3], "up_hysteresis": 0.0, "down_hysteresis": -0.25, "ceiling_coeff": 1.2},
})

# The configs every tuning run compares against, by the names its outputs use.
PRESETS = {"sglang_default": SGLANG_DEFAULT_CONFIG, "conservative": CONSERVATIVE_PRESET, "aggressive": AGGRESSIVE_PRESET}


def runs_alike(a: AdaptiveConfig, b: AdaptiveConfig, launch_a: int, launch_b: int, max_batch_size: int) -> bool:
    """Whether two configs decide identically for every batch of 1..max_batch_size requests (unpadded routing): the
    same slots group those batch sizes, each with the same config and the same starting step. Then a run that never
    exceeds max_batch_size runs alike under either, and any difference measured between them there is noise."""
    routes = [(AdaptivePolicy(cfg, launch, []), cfg) for cfg, launch in ((a, launch_a), (b, launch_b))]
    seen: dict[tuple[str, int], tuple[int, int]] = {}
    for n in range(1, max_batch_size + 1):
        bounds = tuple(policy.slot_for_batch(n) for policy, _ in routes)
        (pa, ca), (pb, cb) = routes
        if ca.slots[bounds[0]] != cb.slots[bounds[1]] or pa.slots[bounds[0]].steps != pb.slots[bounds[1]].steps:
            return False
        # one slot in a must be one slot in b (a shared EMA), both ways
        if seen.setdefault(("a", bounds[0]), bounds) != bounds or seen.setdefault(("b", bounds[1]), bounds) != bounds:
            return False
    return True


def sglang_cuda_graph_bs(max_bs: int = 256) -> list[int]:
    """The decode CUDA-graph batch sizes SGLang captures under speculative decoding.

    max_bs defaults to 256, SGLang's choice on an 80-160 GB GPU below tp 4 (smaller GPUs: 8-48,
    tp >= 4: 512).
    """
    sizes = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 257, 8), *range(272, max_bs + 1, 16)]
    sizes = [s for s in sizes if s <= max_bs]
    return sizes if max_bs in sizes else [*sizes, max_bs]


@dataclass(slots=True)
class SlotState:
    """One slot at run time: its ladder, live step count and EMA of accepted drafts per request."""

    config: SlotConfig
    ladder: list[int]  # sorted, without repeats, as SGLang reads candidate_steps
    steps: int
    ema: float
    num_batches: int = 0

    @classmethod
    def start(cls, config: SlotConfig, launch_steps: int) -> "SlotState":
        ladder = sorted(set(config.candidate_steps))
        steps = launch_steps if launch_steps in ladder else ladder[len(ladder) // 2]
        return cls(config=config, ladder=ladder, steps=steps, ema=float(steps - 1))

    def observe(self, accepted_drafts_per_req: list[int]) -> bool:
        """Feed one verify pass; True when the slot switched its step count."""
        if not accepted_drafts_per_req:
            return False
        if self.steps > 0:  # at step 0 nothing was drafted, so there is nothing to learn
            mean = sum(accepted_drafts_per_req) / len(accepted_drafts_per_req)
            alpha = self.config.ema_alpha
            self.ema = (1 - alpha) * self.ema + alpha * mean
        self.num_batches += 1
        since_warmup = self.num_batches - self.config.warmup_batches
        if since_warmup <= 0 or since_warmup % self.config.update_interval != 0:
            return False
        old = self.steps
        self.steps = self._next_steps()
        return self.steps != old

    def _next_steps(self) -> int:
        ladder, cfg, old = self.ladder, self.config, self.steps
        i = ladder.index(old)
        if old == 0:  # probe one rung up; a slot that started at 0 has no EMA yet
            target = ladder[min(i + 1, len(ladder) - 1)]
            if target > 0 and self.ema < 0:
                self.ema = float(target - 1)
            return target
        start = i
        # Step down while the EMA would not fill the rung below (reaching 0 needs an EMA near 0).
        while i > 0 and self.ema <= (0.5 if ladder[i - 1] == 0 else ladder[i - 1] - 0.5) + cfg.down_hysteresis:
            i -= 1
        if i == start:
            while i < len(ladder) - 1 and self.ema > ladder[i] - 0.5 + cfg.up_hysteresis:
                i += 1
        if cfg.ceiling_coeff > 0:  # caps only a stay or a step down, never a step up
            ceiling = max(1, math.ceil(self.ema * cfg.ceiling_coeff))
            if ceiling < ladder[i] <= old:
                while i > 0 and ladder[i] > ceiling:
                    i -= 1
        return ladder[i]


class AdaptivePolicy:
    """Routes each batch to its slot and feeds it verify results, as SGLang's adaptive worker does.

    Per decode round the server asks `steps_for_batch` before drafting (and switches to that step),
    then calls `on_verify_complete` with the round's accepted drafts (and switches if it returns a
    step). With the overlap scheduler the verify results of round n arrive after round n+1 was
    drafted; the policy itself is unaffected.
    """

    def __init__(self, config: AdaptiveConfig, initial_steps: int, cuda_graph_bs: list[int]):
        union = sorted({s for slot in config.slots.values() for s in slot.candidate_steps})
        if initial_steps not in union:
            raise SpectuneError(f"--speculative-num-steps {initial_steps}: not among the config's candidate steps {union} "
                                "(SGLang refuses to start)")
        self.candidate_steps = union
        self.slots = {bound: SlotState.start(config.slots[bound], initial_steps) for bound in sorted(config.slots)}
        self._bounds = list(self.slots)
        self._cuda_graph_bs = sorted(cuda_graph_bs)

    @classmethod
    def from_config(
        cls,
        cfg: dict | str | Path | AdaptiveConfig,
        initial_steps: int,
        cuda_graph_bs: list[int] | None = None,
    ) -> "AdaptivePolicy":
        """cuda_graph_bs: the captured batch sizes to pad to; None = SGLang's default list
        (sglang_cuda_graph_bs()), [] = no padding (CUDA graphs off, or a 0.5.23 server launched
        without --cuda-graph-bs-decode)."""
        if isinstance(cfg, dict):
            cfg = AdaptiveConfig.from_dict(cfg)
        elif isinstance(cfg, (str, Path)):
            cfg = AdaptiveConfig.from_file(cfg)
        return cls(cfg, initial_steps, sglang_cuda_graph_bs() if cuda_graph_bs is None else cuda_graph_bs)

    def slot_for_batch(self, batch_size: int) -> int:
        """The bound of the slot a batch routes to: pad up to a captured size, then the largest
        bound <= that size (the smallest bound when none is)."""
        i = bisect.bisect_left(self._cuda_graph_bs, batch_size)
        padded = self._cuda_graph_bs[i] if i < len(self._cuda_graph_bs) else batch_size
        return self._bounds[max(0, bisect.bisect_right(self._bounds, padded) - 1)]

    def steps_for_batch(self, batch_size: int) -> int:
        return self.slots[self.slot_for_batch(batch_size)].steps

    def on_verify_complete(self, accepted_drafts_per_req: list[int], batch_size: int) -> int | None:
        """accepted_drafts_per_req: accepted draft tokens per request, bonus token excluded.
        Returns the slot's new step count if it switched, else None."""
        slot = self.slots[self.slot_for_batch(batch_size)]
        return slot.steps if slot.observe(accepted_drafts_per_req) else None
