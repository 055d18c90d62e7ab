"""Writers and validators for the configs spectune hands to engines: SGLang's adaptive_spec.json,
vLLM's --speculative-config, and llama.cpp's speculative flags.

The validators reject what the engines would ignore, crash on later, or silently reinterpret, each
with a one-line SpectuneError naming the file and the key. Engine rules are read from the released
source: SGLang 0.5.23 (srt/speculative/adaptive_spec_params.py, arg_groups/speculative_hook.py),
vLLM 0.33.0 (vllm/config/speculative.py, vllm/v1/spec_decode/dynamic/utils.py), llama.cpp
(common/arg.cpp, common/speculative.cpp of llama-cpp-python 0.3.36).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from spectune.adaptive import AdaptiveConfig, did_you_mean, is_int, read_json
from spectune.errors import SpectuneError

# --- SGLang ---

OLDEST_SGLANG = (0, 5, 13)  # first release with per-batch-size slots; 0.5.11-0.5.12 read a flat file
FIRST_SGLANG_WITH_STEP_0 = (0, 5, 14)
ADAPTIVE_ALGORITHMS = ("EAGLE", "EAGLE3")  # SGLang turns adaptive off, with a warning, for any other


def _sglang_version(version: str) -> tuple[int, ...]:
    try:
        parsed = tuple(int(part) for part in version.split("."))
    except ValueError:
        raise SpectuneError(f"--sglang-version {version!r}: expected a release number like 0.5.23") from None
    if parsed < OLDEST_SGLANG:
        raise SpectuneError(
            f"--sglang-version {version}: spectune writes and checks adaptive configs for SGLang >= 0.5.13 only "
            "(0.5.11-0.5.12 read a flat file without batch-size slots); upgrade SGLang"
        )
    return parsed


def validate_sglang_config(obj_or_path: dict | str | Path, version: str = "0.5.23") -> AdaptiveConfig:
    """Check an adaptive_spec.json (a path, or the parsed object) for the given SGLang release."""
    parsed_version = _sglang_version(version)
    if isinstance(obj_or_path, dict):
        source, cfg = "adaptive config", AdaptiveConfig.from_dict(obj_or_path)
    else:
        source, cfg = str(obj_or_path), AdaptiveConfig.from_file(obj_or_path)
    if parsed_version < FIRST_SGLANG_WITH_STEP_0:
        for bound, slot in cfg.slots.items():
            if 0 in slot.candidate_steps:
                raise SpectuneError(f'{source}: slot "{bound}".candidate_steps = {slot.candidate_steps}: '
                                    "step 0 needs SGLang >= 0.5.14; remove it or upgrade")
    return cfg


def write_sglang_config(cfg: AdaptiveConfig, path: str | Path, version: str = "0.5.23") -> Path:
    """Validate, then write atomically (a reader never sees half a file)."""
    obj = cfg.to_dict()
    validate_sglang_config(obj, version)
    return _write_atomic(Path(path), json.dumps(obj, indent=2) + "\n")


def never_drafts(cfg: AdaptiveConfig) -> bool:
    """Every slot's ladder is [0]: the config is target-only (speculation won nowhere)."""
    return not any(s > 0 for slot in cfg.slots.values() for s in slot.candidate_steps)


def sglang_launch_steps(cfg: AdaptiveConfig) -> int:
    """A --speculative-num-steps SGLang accepts (it must be in some slot's ladder): the step the
    smallest slot would start at by itself (its middle rung), else the smallest positive step."""
    smallest = cfg.slots[min(cfg.slots)]
    ladder = sorted(set(smallest.candidate_steps))
    if ladder[len(ladder) // 2] > 0:
        return ladder[len(ladder) // 2]
    positive = sorted({s for slot in cfg.slots.values() for s in slot.candidate_steps if s > 0})
    if not positive:
        raise SpectuneError("adaptive config: every slot's ladder is [0], so nothing is ever drafted; "
                            "launch without speculative decoding")
    return positive[0]


def sglang_flags(
    cfg_path: str | Path,
    steps: int,
    algorithm: str = "EAGLE",
    draft_model: str | None = None,
    cuda_graph_bs: list[int] | None = None,
) -> list[str]:
    """`sglang.launch_server` flags for adaptive speculative decoding with the config at cfg_path.

    cuda_graph_bs: pass the capture list explicitly (--cuda-graph-bs-decode); SGLang 0.5.23 pads
    batch sizes for slot routing only when this flag is given, so give it when the config was tuned
    with padding.
    """
    if algorithm not in ADAPTIVE_ALGORITHMS:
        raise SpectuneError(f"algorithm {algorithm!r}: SGLang runs adaptive steps only with {' or '.join(ADAPTIVE_ALGORITHMS)}")
    union = sorted({s for slot in validate_sglang_config(cfg_path).slots.values() for s in slot.candidate_steps})
    if steps not in union or steps < 1:
        raise SpectuneError(f"--speculative-num-steps {steps}: must be a positive step of the config's ladders {union} "
                            "(SGLang refuses to start)")
    flags = ["--speculative-algorithm", algorithm]
    if draft_model is not None:
        flags += ["--speculative-draft-model-path", str(draft_model)]
    flags += [
        "--speculative-num-steps", str(steps),
        "--speculative-eagle-topk", "1",  # adaptive needs topk 1
        "--speculative-num-draft-tokens", str(steps + 1),  # SGLang forces steps + 1 anyway
        "--speculative-adaptive",
        "--speculative-adaptive-config", str(cfg_path),
    ]
    if cuda_graph_bs:
        flags += ["--cuda-graph-bs-decode", *(str(b) for b in sorted(cuda_graph_bs))]
    return flags


def describe_sglang_config(cfg: AdaptiveConfig) -> str:
    slots = ", ".join(f"bs>={bound} {slot.candidate_steps}" for bound, slot in cfg.slots.items())
    if never_drafts(cfg):
        return f"{len(cfg.slots)} slot(s): {slots}; never drafts: launch without speculative decoding"
    return f"{len(cfg.slots)} slot(s): {slots}; launch with --speculative-num-steps {sglang_launch_steps(cfg)}"


# --- vLLM ---

VLLM_METHODS = ("ngram", "ngram_gpu", "suffix", "draft_model", "eagle", "eagle3", "mtp", "dflash", "dspark", "custom_class")
NGRAM_METHODS = ("ngram", "ngram_gpu")
MODEL_FREE_METHODS = ("ngram", "ngram_gpu", "suffix")
NEEDS_MODEL = ("draft_model", "eagle", "eagle3", "dflash", "custom_class")  # mtp and dspark default to the target
MANAGED_KEYS = ("method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max",
                "num_speculative_tokens_per_batch_size")
# Other keys a user may set in vLLM 0.33's SpeculativeConfig; spectune passes them through unchanged.
VLLM_OTHER_KEYS = (
    "enforce_eager", "draft_tensor_parallel_size", "quantization", "moe_backend", "attention_backend", "kv_cache_dtype",
    "max_model_len", "revision", "code_revision", "index_share_for_mtp_iteration", "disable_padded_drafter_batch",
    "disable_eagle_block_drop", "disable_lookahead_block_hashes", "draft_lm_head_quantization", "use_local_argmax_reduction",
    "use_heterogeneous_vocab", "parallel_drafting", "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob", "draft_load_config", "rejection_sample_method",
    "synthetic_acceptance_rates", "synthetic_acceptance_length", "enable_adaptive_verification", "draft_sample_method",
    "dspark_draft_topk", "xpress_topc", "fly_window_size", "fly_entropy_threshold", "fly_entropy_top_k",
)
SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"


@dataclass(slots=True)
class VllmSpecConfig:
    """vLLM's --speculative-config. The schedule is [(first_bs, last_bs, k), ...], inclusive ranges."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    num_speculative_tokens_per_batch_size: list[tuple[int, int, int]] | None = None
    extra: dict[str, object] = field(default_factory=dict)  # other vLLM keys, passed through unchanged

    def to_dict(self) -> dict[str, object]:
        """Only the keys this method reads (vLLM rejects unknown keys; spectune rejects unused ones)."""
        out: dict[str, object] = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.model is not None:
            out["model"] = self.model
        if self.method in NGRAM_METHODS:
            out.update({k: getattr(self, k) for k in ("prompt_lookup_min", "prompt_lookup_max") if getattr(self, k) is not None})
        if self.num_speculative_tokens_per_batch_size is not None:
            out[SCHEDULE_KEY] = [list(entry) for entry in self.num_speculative_tokens_per_batch_size]
        out.update(self.extra)
        return out

    def to_json(self) -> str:
        """Validated JSON for `vllm serve --speculative-config`."""
        obj = self.to_dict()
        validate_vllm_config(obj)
        return json.dumps(obj)


def validate_vllm_config(obj_or_path: dict | str | Path) -> VllmSpecConfig:
    """Check a vLLM speculative config: a dict, a JSON file, or the inline JSON text of --speculative-config."""
    if isinstance(obj_or_path, dict):
        source, obj = "speculative config", obj_or_path
    elif isinstance(obj_or_path, str) and obj_or_path.lstrip().startswith("{"):
        source = "--speculative-config"
        try:
            obj = json.loads(obj_or_path)
        except json.JSONDecodeError as e:
            raise SpectuneError(f"{source}: not valid JSON ({e.msg} at column {e.colno})") from None
    else:
        source, obj = str(obj_or_path), read_json(obj_or_path)
    if not isinstance(obj, dict):
        raise SpectuneError(f'{source}: must be a JSON object, e.g. {{"method": "ngram", "num_speculative_tokens": 3}}')
    for key in obj:
        if key not in MANAGED_KEYS and key not in VLLM_OTHER_KEYS:
            hint = ('vLLM wants "draft_tensor_parallel_size"' if key == "tensor_parallel_size"
                    else did_you_mean(key, MANAGED_KEYS + VLLM_OTHER_KEYS))
            raise SpectuneError(f'{source}: unknown key "{key}" (vLLM rejects it); {hint}')

    method = obj.get("method")
    if method not in VLLM_METHODS:
        hint = "state it, vLLM would guess it from \"model\"" if method is None else did_you_mean(str(method), VLLM_METHODS)
        raise SpectuneError(f"{source}: method = {json.dumps(method)}: must be one of {', '.join(VLLM_METHODS)}; {hint}")
    k = obj.get("num_speculative_tokens")
    if not is_int(k) or k < 1:
        raise SpectuneError(f"{source}: num_speculative_tokens = {json.dumps(k)}: must be an integer > 0")

    model = obj.get("model")
    if method in MODEL_FREE_METHODS and model is not None:
        raise SpectuneError(f'{source}: model = {json.dumps(model)}: method "{method}" uses no model; remove it')
    if method in NEEDS_MODEL and not (isinstance(model, str) and model):
        raise SpectuneError(f'{source}: model is missing: method "{method}" needs the draft model path or name')

    lookup = {name: obj.get(name) for name in ("prompt_lookup_min", "prompt_lookup_max")}
    for name, value in lookup.items():
        if value is None:
            continue
        if method not in NGRAM_METHODS:
            raise SpectuneError(f'{source}: {name}: only the ngram methods read it (vLLM ignores it for "{method}"); remove it')
        if not is_int(value) or value < 1:
            raise SpectuneError(f"{source}: {name} = {json.dumps(value)}: must be an integer >= 1")
    if None not in lookup.values() and lookup["prompt_lookup_min"] > lookup["prompt_lookup_max"]:
        raise SpectuneError(f"{source}: prompt_lookup_min = {lookup['prompt_lookup_min']} must be <= prompt_lookup_max = "
                            f"{lookup['prompt_lookup_max']}")

    schedule = None if obj.get(SCHEDULE_KEY) is None else _check_schedule(obj[SCHEDULE_KEY], k, source)
    return VllmSpecConfig(
        method=method, num_speculative_tokens=k, model=model,
        prompt_lookup_min=lookup["prompt_lookup_min"], prompt_lookup_max=lookup["prompt_lookup_max"],
        num_speculative_tokens_per_batch_size=schedule,
        extra={key: value for key, value in obj.items() if key not in MANAGED_KEYS},
    )


def _check_schedule(entries: object, max_k: int, source: str) -> list[tuple[int, int, int]]:
    """vLLM's rules, plus two it does not enforce: ranges in ascending order as written, and k <= num_speculative_tokens."""
    if not isinstance(entries, list) or not entries:
        raise SpectuneError(f"{source}: {SCHEDULE_KEY}: must be a non-empty list of [first_bs, last_bs, k], "
                            "e.g. [[1, 8, 4], [9, 64, 2]]")
    schedule = []
    previous_end = 0
    for i, entry in enumerate(entries):
        where = f"{source}: {SCHEDULE_KEY}[{i}] = {json.dumps(entry)}"
        if not isinstance(entry, list | tuple) or len(entry) != 3 or not all(is_int(v) for v in entry):
            raise SpectuneError(f"{where}: must be three integers [first_bs, last_bs, k]")
        start, end, k = entry
        if i == 0 and start != 1:
            raise SpectuneError(f"{where}: the first range must start at batch size 1 (vLLM refuses otherwise)")
        if start > end:
            raise SpectuneError(f"{where}: first_bs must be <= last_bs")
        if start <= previous_end:
            raise SpectuneError(f"{where}: ranges must be ascending and must not overlap "
                                f"(the previous one ends at {previous_end})")
        if k < 0:
            raise SpectuneError(f"{where}: k must be >= 0 (0 = no speculation)")
        if k > max_k:
            raise SpectuneError(f"{where}: k must be <= num_speculative_tokens = {max_k} (vLLM would silently cap it)")
        schedule.append((start, end, k))
        previous_end = end
    return schedule


def schedule_from_optima(best_k_by_bs: dict[int, int]) -> list[tuple[int, int, int]]:
    """Per-batch-size schedule from the best k measured at some batch sizes.

    Each measured batch size's k holds from there up to the next measured size (the first from 1;
    the last runs to vLLM's max batch size); neighbours with equal k merge.
    """
    if not best_k_by_bs:
        raise SpectuneError("schedule: no measured batch sizes; measure at least one batch size")
    for bs, k in best_k_by_bs.items():
        if not (is_int(bs) and bs >= 1 and is_int(k) and k >= 0):
            raise SpectuneError(f"schedule: batch size {bs!r} -> k {k!r}: need an integer batch size >= 1 and an integer k >= 0")
    sizes = sorted(best_k_by_bs)
    schedule: list[tuple[int, int, int]] = []
    for i, bs in enumerate(sizes):
        start = 1 if i == 0 else bs
        end = sizes[i + 1] - 1 if i + 1 < len(sizes) else bs
        k = best_k_by_bs[bs]
        if schedule and schedule[-1][2] == k:
            schedule[-1] = (schedule[-1][0], end, k)
        else:
            schedule.append((start, end, k))
    return schedule


def describe_vllm_config(cfg: VllmSpecConfig) -> str:
    text = f"method={cfg.method}, num_speculative_tokens={cfg.num_speculative_tokens}"
    if cfg.model:
        text += f", model={cfg.model}"
    if cfg.num_speculative_tokens_per_batch_size:
        ranges = [f"{a}-{b}:{k}" for a, b, k in cfg.num_speculative_tokens_per_batch_size]
        text += f", schedule {', '.join(ranges)} (larger batches keep the last)"
    return text


# --- llama.cpp ---

def llamacpp_flags(g: int, draft_model_path: str | Path | None = None, ngram: bool = False) -> list[str]:
    """llama-server flags drafting g tokens per round, with a draft model or by n-gram lookup.

    ngram-simple drafts the m-gram after a match and ignores --spec-draft-n-max, so its draft length
    is set with --spec-ngram-simple-size-m.
    """
    if not is_int(g) or g < 1:
        raise SpectuneError(f"draft length g = {g!r}: must be an integer >= 1 (run the target alone for no speculation)")
    if (draft_model_path is None) == (not ngram):
        raise SpectuneError("llama.cpp speculation: give either a draft model path or ngram=True, not both or neither")
    if ngram:
        return ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-m", str(g)]
    return ["-md", str(draft_model_path), "--spec-type", "draft-simple", "--spec-draft-n-max", str(g)]


# --- shared ---

def describe_config_file(path: str | Path, engine: str, sglang_version: str = "0.5.23") -> str:
    """Validate a config file for an engine; a one-line summary, or SpectuneError."""
    if engine == "sglang":
        return describe_sglang_config(validate_sglang_config(path, sglang_version))
    if engine == "vllm":
        return describe_vllm_config(validate_vllm_config(Path(path)))
    raise SpectuneError(f"--engine {engine!r}: must be sglang or vllm")


def _write_atomic(path: Path, text: str) -> Path:
    from spectune.store import atomic_write_bytes

    atomic_write_bytes(path, text.encode())
    return path
