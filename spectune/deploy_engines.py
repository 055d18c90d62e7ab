"""Per engine, the fastest measured speculative method it can run, and the file and command to deploy it.

- SGLang: adaptive_spec.json (the tuned config) and `sglang.launch_server` flags. SGLang runs adaptive steps only
  with EAGLE/EAGLE3 at topk 1, so the launch command exists only when the tuned method is one of them.
- vLLM: a --speculative-config JSON with num_speculative_tokens_per_batch_size, for a method whose model vLLM can
  load: n-gram lookup, or a draft model that is a Hugging Face directory. The embedded engine's EAGLE head and
  parallel drafter are spectune's own formats, which vLLM cannot load.
- llama.cpp: llama-server flags with a GGUF draft model (a Hugging Face directory is converted, as the llamacpp
  adapter does) or n-gram lookup; one draft length for every batch size. It cannot load an EAGLE head.

Each engine gets the method with the highest measured speedup among those it can run (the geometric mean over
batch sizes of each size's best step count, as costmodel.fastest_method ranks them); where that is not the
fastest measured method, its note says what has no equivalent and why. deploy.md beside the files says it for
people (vLLM's JSON cannot carry comments). Model paths are absolute where the model is a local directory.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from spectune.adaptive import AdaptiveConfig
from spectune.analysis import model_pick
from spectune.costmodel import split_failed
from spectune.emit import (
    ADAPTIVE_ALGORITHMS,
    MODEL_FREE_METHODS,
    VllmSpecConfig,
    llamacpp_flags,
    never_drafts,
    schedule_from_optima,
    sglang_flags,
    sglang_launch_steps,
    write_sglang_config,
)
from spectune.errors import SpectuneError
from spectune.store import atomic_write_bytes

EAGLE_DRAFT = "EAGLE_DRAFT_PATH"  # in SGLang's command where no EAGLE checkpoint SGLang can load was measured
TARGET_GGUF = "TARGET_GGUF"  # in llama.cpp's command where the target could not be converted here
DRAFT_MODEL_METHODS = ("draft_model", "standalone")
ENGINE_NAMES = {"sglang": "SGLang", "vllm": "vLLM", "llamacpp": "llama.cpp"}
_VLLM_NAMES = {"standalone": "draft_model", "nextn": "mtp"}  # SGLang's names for vLLM's methods


@dataclass(frozen=True, slots=True)
class MethodScore:
    """A measured static speculative method: how it compared with target-only on the engine it ran on."""

    engine: str
    method: str
    speedup: float  # geometric mean over batch sizes of the best step count's output tokens/s over target-only's
    best_steps: dict[int, int]  # per measured batch size, the step count picked (measured_methods; 0: target-only)
    best_static: int  # the one step count >= 1 with the highest geometric-mean speedup over batch sizes
    server: dict  # the plan's server entry: draft model, n-gram lookup bounds
    open_loop: bool = False  # tokens/s decoded at the batch size each server ran (tune.load_results), not the arrivals'

    def why(self) -> str:
        sizes = ", ".join(str(b) for b in sorted(self.best_steps))
        unit = "decoded tokens/s (sequences it ran at once x 1000 / TPOT; open loop)" if self.open_loop else "output tokens/s"
        return (f"measured {self.speedup:.2f}x {unit} over target-only: the geometric mean over batch sizes {sizes} "
                "of each size's best step count")


@dataclass(frozen=True, slots=True)
class Deployment:
    """What tuning.json's "deploy" lists for one engine."""

    engine: str  # sglang | vllm | llamacpp
    method: str | None  # the method this engine's config runs; None when the engine has no equivalent
    file: Path | None
    command: str | None  # the launch command a user copies
    note: str  # which method and why, or why there is no equivalent

    def to_dict(self) -> dict[str, str | None]:
        return {"engine": self.engine, "method": self.method, "file": str(self.file) if self.file else None,
                "command": self.command, "note": self.note}


def measured_methods(cells: pd.DataFrame, manifest: dict, max_failure_rate: float = 0.05,
                     expected: pd.Series | None = None) -> list[MethodScore]:
    """Every measured static speculative (engine, method), fastest first. Each batch size's steps are the fastest
    measured (0 where target-only was faster); with `expected` (spectune.guided.expected_tps), of those measured faster
    than target-only, the one the cost model expects fastest (0 where it expects none faster), as the sweep's
    recommendation picks (analysis.recommendation_table)."""
    usable, _ = split_failed(cells, max_failure_rate)
    if usable.empty:
        return []
    is_spec = usable["is_speculative"].astype(bool)
    static = usable[is_spec & usable["adaptive_config"].isna() & (usable["num_speculative_tokens"] > 0)]
    scores = []
    for (engine, method), group in static.groupby(["engine", "method"]):
        base = usable[~is_spec & (usable["engine"] == engine)].groupby("batch_size")["output_throughput_tps"].mean()
        ratio = group.groupby(["batch_size", "num_speculative_tokens"])["output_throughput_tps"].mean().div(base, level="batch_size")
        ratio = ratio[np.isfinite(ratio) & (ratio > 0)]
        if ratio.empty:
            continue
        model = pd.Series(math.nan, index=ratio.index)
        if expected is not None and len(expected):
            servers = group.groupby(["batch_size", "num_speculative_tokens"])["server"].first()
            model = pd.Series([expected.get((bs, servers[(bs, g)]), math.nan) / base[bs] for bs, g in ratio.index], index=ratio.index)
        best = ratio.groupby(level="batch_size").max()
        picks = {bs: model_pick(r, model[r.index]) for bs, r in ratio.groupby(level="batch_size")}  # (batch_size, g) or None
        steps = {int(bs): int(at[1]) if at is not None and not model[at] <= 1.0 else 0 for bs, at in picks.items()}
        per_g = ratio.groupby(level="num_speculative_tokens").apply(lambda r: float(np.exp(np.log(r).mean())))
        scores.append(MethodScore(engine=str(engine), method=str(method), speedup=float(np.exp(np.log(best).mean())),
                                  best_steps=steps, best_static=int(per_g.idxmax()), server=_server_entry(manifest, engine, method),
                                  open_loop="output_throughput_tps_measured" in usable))
    return sorted(scores, key=lambda s: -s.speedup)


def _server_entry(manifest: dict, engine: str, method: str | None) -> dict:
    for server in manifest.get("plan", {}).get("servers", []):
        if server.get("engine", "embedded") == engine and server.get("method") == method:
            return server
    return {}


@dataclass(frozen=True, slots=True)
class TunedMethod:
    """The method `spectune tune` searched, and what its comparisons found (on the simulated bench)."""

    engine: str
    method: str
    config: AdaptiveConfig
    steps_by_batch_size: dict[int, int]  # the best per-batch-size schedule's step counts
    best_static: int  # the best static step count >= 1


def write_deployments(tuned: TunedMethod, cells: pd.DataFrame, manifest: dict, outdir: Path, *, sglang_version: str = "0.5.23",
                      draft_model: str | None = None, expected: pd.Series | None = None) -> list[Deployment]:
    """Write adaptive_spec.json, vllm_speculative_config.json, llamacpp_flags.txt and deploy.md into `outdir`.
    `expected`: the cost model's tok/s per measured cell (measured_methods)."""
    outdir.mkdir(parents=True, exist_ok=True)
    limit = manifest.get("plan", {}).get("max_failure_rate", 0.05)
    scores = measured_methods(cells, manifest, limit, expected)
    fastest = scores[0] if scores else None
    deployments = [
        _sglang(tuned, scores, manifest, outdir, sglang_version),
        _vllm(tuned, scores, fastest, manifest, outdir, draft_model),
        _llamacpp(tuned, scores, fastest, manifest, outdir, draft_model),
    ]
    write_deploy_md(deployments, outdir / "deploy.md")
    return deployments


# --- SGLang ---

def _sglang(tuned: TunedMethod, scores: list[MethodScore], manifest: dict, outdir: Path, version: str) -> Deployment:
    path = write_sglang_config(tuned.config, outdir / "adaptive_spec.json", version)
    score = next((s for s in scores if (s.engine, s.method) == (tuned.engine, tuned.method)), None)
    tuned_on = f"tuned on {tuned.method}" + (f" ({score.why()})" if score else "")
    fastest = scores[0] if scores else None
    if fastest and fastest.method != tuned.method and fastest.method.upper() not in ADAPTIVE_ALGORITHMS:
        tuned_on += (f"; {fastest.method} measured faster ({fastest.speedup:.2f}x) but has no SGLang adaptive equivalent "
                     f"(adaptive runs with {'/'.join(ADAPTIVE_ALGORITHMS)} only)")
    if tuned.method.upper() not in ADAPTIVE_ALGORITHMS:
        eagles = [s.method for s in scores if s.method.upper() in ADAPTIVE_ALGORITHMS]
        advice = (f"to tune for SGLang, run `spectune tune RESULTS --method {eagles[0]}`" if eagles else
                  "measure an EAGLE draft (a server with method = \"eagle\" in the plan) and tune it for SGLang")
        return Deployment("sglang", None, path, None,
                          f"no SGLang equivalent of {tuned.method}: SGLang runs adaptive steps only with "
                          f"{'/'.join(ADAPTIVE_ALGORITHMS)} (topk 1). adaptive_spec.json is {tuned_on}; its ladders suit an EAGLE "
                          f"draft only if that accepts about as often; {advice}.")
    if never_drafts(tuned.config):
        command = shlex.join(["python", "-m", "sglang.launch_server", "--model-path", _target(manifest, tuned.engine)])
        return Deployment("sglang", "target-only", path.resolve(), command,
                          f"no speculation: the tuned config never drafts (every slot's ladder is [0]): {tuned.method} measured "
                          "no faster than target-only on this bench at any batch size. Launch SGLang without speculative "
                          "decoding; adaptive_spec.json is kept for the record.")
    server = _server_entry(manifest, tuned.engine, tuned.method)
    draft = _local_path(server["draft_model"]) if tuned.engine != "embedded" and server.get("draft_model") else None
    flags = sglang_flags(path.resolve(), sglang_launch_steps(tuned.config), algorithm=tuned.method.upper(),
                         draft_model=draft or EAGLE_DRAFT)
    command = shlex.join(["python", "-m", "sglang.launch_server", "--model-path", _target(manifest, tuned.engine), *flags])
    note = f"{tuned.method}: adaptive steps per batch size, {tuned_on}; SGLang runs adaptive steps with {'/'.join(ADAPTIVE_ALGORITHMS)} only (topk 1)."
    if draft is None:
        note += (f" Replace {EAGLE_DRAFT} with an EAGLE checkpoint for your target: the embedded engine's EAGLE head "
                 "(spectune/engine/eagle.py) is spectune's own format, which SGLang cannot load.")
    return Deployment("sglang", tuned.method, path.resolve(), command, note)


# --- vLLM ---

def _vllm(tuned: TunedMethod, scores: list[MethodScore], fastest: MethodScore | None, manifest: dict, outdir: Path,
          override: str | None) -> Deployment:
    refused = {}
    for score in scores:
        model, reason = _vllm_model(score, override)
        if reason:
            refused[score.method] = (reason, score.speedup)
            continue
        is_tuned = (score.engine, score.method) == (tuned.engine, tuned.method)
        steps = tuned.steps_by_batch_size if is_tuned else score.best_steps
        schedule = schedule_from_optima({int(b): int(k) for b, k in steps.items()})
        config = VllmSpecConfig(method=_VLLM_NAMES.get(score.method, score.method),
                                num_speculative_tokens=max(1, max(k for _, _, k in schedule)), model=model,
                                prompt_lookup_min=score.server.get("prompt_lookup_min"),
                                prompt_lookup_max=score.server.get("prompt_lookup_max"),
                                num_speculative_tokens_per_batch_size=schedule)
        source = ("the tuned method's best per-batch-size schedule (fitted model)" if is_tuned
                  else "the step count picked at each batch size as the recommendation picks (of those measured faster than "
                       "target-only, the one the cost model expects fastest)")
        if any(k for _, _, k in schedule):
            note = (f"{score.method}: {_ranked(score, fastest, 'vLLM can load')} ({score.why()}); steps per batch size "
                    f"from {source}: {_schedule_text(schedule)}.")
            return _write_vllm(config, outdir, manifest, score.engine, note + _no_equivalent(refused, "vLLM"))
        # 0 steps at every batch size: the config would switch speculation off everywhere, so launch without one
        note = (f"no speculation: {score.method}, {_ranked(score, fastest, 'vLLM can load')}, measured no faster than "
                f"target-only at any batch size ({score.why()}). Launch vLLM without --speculative-config; "
                "vllm_speculative_config.json (0 steps at every batch size) is kept for the record.")
        kept = _write_vllm(config, outdir, manifest, score.engine, note + _no_equivalent(refused, "vLLM"))
        return Deployment("vllm", "target-only", kept.file, shlex.join(["vllm", "serve", _target(manifest, score.engine)]), kept.note)
    # nothing measured that vLLM loads: n-gram lookup needs no model, but was not measured here
    if (none := _none_beat_target(scores, "vLLM")) is not None:
        (outdir / "vllm_speculative_config.json").unlink(missing_ok=True)  # an earlier tune's, which no longer holds
        return Deployment("vllm", "target-only", None, shlex.join(["vllm", "serve", _target(manifest, tuned.engine)]),
                          none + " Launch vLLM without --speculative-config." + _no_equivalent(refused, "vLLM"))
    g = max(1, tuned.best_static)
    config = VllmSpecConfig(method="ngram", num_speculative_tokens=g, prompt_lookup_min=1, prompt_lookup_max=4)
    note = (f"ngram, NOT MEASURED in this sweep: no measured method has a model vLLM can load, and n-gram lookup needs "
            f"none; {g} tokens per round is the tuned method's best static step count. Measure it (a server with method = "
            "\"ngram\") before relying on it.")
    return _write_vllm(config, outdir, manifest, tuned.engine, note + _no_equivalent(refused, "vLLM"))


def _vllm_model(score: MethodScore, override: str | None) -> tuple[str | None, str | None]:
    """(model path or None, None) when vLLM can load this method as measured; (None, why not) otherwise."""
    if score.method in MODEL_FREE_METHODS:
        return None, None
    if score.method in DRAFT_MODEL_METHODS:
        path = _draft_path(score, override)
        if path is None:
            return None, "no draft model path recorded (pass --draft-model PATH)"
        if Path(path).is_file():
            return None, f"its draft {path} is a file (GGUF?), and vLLM loads a Hugging Face model directory"
        return path, None
    if score.engine in ("embedded", "llamacpp"):
        return None, (f"the embedded engine's {score.method} drafter is spectune's own format (spectune/engine), which vLLM "
                      "cannot load" if score.engine == "embedded" else f"llama.cpp's {score.method} has no vLLM model")
    if score.method == "mtp" or score.method == "nextn":
        return None, None
    if not score.server.get("draft_model"):
        return None, f"no {score.method} model path recorded in the plan"
    return _local_path(score.server["draft_model"]), None


def _write_vllm(config: VllmSpecConfig, outdir: Path, manifest: dict, engine: str, note: str) -> Deployment:
    text = config.to_json()  # validated: the rules vLLM's SpeculativeConfig applies, and the schedule's
    keys = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in json.loads(text).items())  # a key per line
    path = _write(outdir / "vllm_speculative_config.json", "{\n" + keys + "\n}\n")
    command = shlex.join(["vllm", "serve", _target(manifest, engine), "--speculative-config", text])
    return Deployment("vllm", config.method, path, command, note)


# --- llama.cpp ---

def _llamacpp(tuned: TunedMethod, scores: list[MethodScore], fastest: MethodScore | None, manifest: dict, outdir: Path,
              override: str | None) -> Deployment:
    from spectune.servers.llamacpp import NGRAM_DEFAULT

    refused = {}
    for score in scores:
        g = tuned.best_static if (score.engine, score.method) == (tuned.engine, tuned.method) else score.best_static
        g = max(1, g)
        if score.method == "ngram":
            n = score.server.get("prompt_lookup_min") or score.server.get("prompt_lookup_max") or NGRAM_DEFAULT
            flags = llamacpp_flags(g, ngram=True) + ["--spec-ngram-simple-size-n", str(n)]
        elif score.method in DRAFT_MODEL_METHODS:
            gguf, reason = _gguf(_draft_path(score, override))
            if reason:
                refused[score.method] = (reason, score.speedup)
                continue
            flags = llamacpp_flags(g, draft_model_path=gguf)
        else:
            refused[score.method] = ("llama.cpp drafts only with a GGUF draft model or n-gram lookup", score.speedup)
            continue
        if not any(score.best_steps.values()):  # slower than target-only at every batch size: do not speculate
            note = (f"no speculation: {score.method}, {_ranked(score, fastest, 'llama.cpp runs')}, measured slower than "
                    f"target-only at every batch size ({score.why()}), and llama.cpp has no per-batch-size steps; "
                    f"`{shlex.join(flags)}` would add it at draft length {g}.")
            return _write_llamacpp([], outdir, manifest, "target-only", note + _no_equivalent(refused, "llama.cpp"))
        note = (f"{score.method}: {_ranked(score, fastest, 'llama.cpp runs')} ({score.why()}); draft length {g} at every "
                "batch size (llama.cpp has no per-batch-size steps).")
        if slower := sorted(bs for bs, k in score.best_steps.items() if k == 0):
            note += (f" It measured no faster than target-only at batch size {', '.join(map(str, slower))}: where a server "
                     "runs that many requests at once, launch it without these flags.")
        return _write_llamacpp(flags, outdir, manifest, score.method, note + _no_equivalent(refused, "llama.cpp"))
    if (none := _none_beat_target(scores, "llama.cpp")) is not None:
        return _write_llamacpp([], outdir, manifest, "target-only", none + _no_equivalent(refused, "llama.cpp"))
    g = max(1, tuned.best_static)
    flags = llamacpp_flags(g, ngram=True) + ["--spec-ngram-simple-size-n", str(NGRAM_DEFAULT)]
    note = (f"ngram, NOT MEASURED in this sweep: no measured method is one llama.cpp runs; draft length {g} is the tuned "
            "method's best static step count. Measure it before relying on it.")
    return _write_llamacpp(flags, outdir, manifest, "ngram", note + _no_equivalent(refused, "llama.cpp"))


def _gguf(path: str | None) -> tuple[str | None, str | None]:
    """A GGUF file of the model at `path` (the file itself, or a Hugging Face directory converted as the llamacpp
    adapter does), or why there is none."""
    from spectune.servers.llamacpp import gguf_for

    if path is None:
        return None, "no model path recorded (pass --draft-model PATH)"
    try:
        return str(gguf_for(path).resolve()), None
    except SpectuneError as e:
        return None, f"llama.cpp needs a GGUF file and none could be made here ({e})"


def _write_llamacpp(flags: list[str], outdir: Path, manifest: dict, method: str, note: str) -> Deployment:
    path = _write(outdir / "llamacpp_flags.txt", shlex.join(flags) + "\n")
    target = _target(manifest, "llamacpp")
    gguf, reason = _gguf(target) if not target.endswith(".gguf") else (target, None)
    if reason:
        gguf = TARGET_GGUF
        note += f" Replace {TARGET_GGUF} with the target {target} as GGUF" + (" (for the same reason)." if reason in note else f": {reason}.")
    return Deployment("llamacpp", method, path, shlex.join(["llama-server", "-m", gguf, *flags]), note)


# --- shared ---

def _ranked(score: MethodScore, fastest: MethodScore | None, can: str) -> str:
    if fastest is None or (score.engine, score.method) == (fastest.engine, fastest.method):
        return "the fastest measured method"
    return f"the fastest measured method {can}"


def _no_equivalent(refused: dict[str, tuple[str, float]], engine: str) -> str:
    """The measured methods ahead of this engine's in the ranking that it cannot run, each with why (the fastest
    first; "faster" only where one beat target-only)."""
    if not refused:
        return ""
    return " " + " ".join(f"{m} measured faster but has no {engine} equivalent here: {why}." if speedup > 1.0 else
                          f"{m} (measured {speedup:.2f}x target-only) has no {engine} equivalent here either: {why}."
                          for m, (why, speedup) in refused.items())


def _none_beat_target(scores: list[MethodScore], engine: str) -> str | None:
    """A note when methods were measured and none beat target-only at any batch size: then an unmeasured method is
    no answer for `engine`, and its launch goes without speculation."""
    if not scores or any(any(s.best_steps.values()) for s in scores):
        return None
    measured = ", ".join(f"{s.method} {s.speedup:.2f}x" for s in scores)
    return (f"no speculation: no measured method beat target-only at any batch size ({measured}, output tokens/s over "
            f"target-only); n-gram lookup, which {engine} runs without a draft model, was not measured: sweep a server "
            "with method = \"ngram\" to know whether it does.")


def _schedule_text(schedule: list[tuple[int, int, int]]) -> str:
    ranges = ", ".join(f"batch {a}-{b}: {k}" if a != b else f"batch {a}: {k}" for a, b, k in schedule)
    return f"{ranges} (larger batches keep {schedule[-1][2]})"


def _draft_path(score: MethodScore, override: str | None) -> str | None:
    """The draft the method ran with: --draft-model, the plan's, a noisy copy of the shipped target, or the shipped draft."""
    server = score.server
    if override:
        return _local_path(override)
    if server.get("draft_model"):
        return _local_path(server["draft_model"])
    if score.engine == "embedded":
        from spectune.engine.shipped import draft_path, noisy_draft_path

        return str(noisy_draft_path(server["draft_noise"]) if server.get("draft_noise") is not None else draft_path())
    return None


def _target(manifest: dict, engine: str) -> str:
    """The target model of the sweep's target-only server: an absolute path for a local model."""
    servers = manifest.get("plan", {}).get("servers", [])
    entry = next((s for s in servers if s.get("method") is None and s.get("engine", "embedded") == engine), None)
    entry = entry or next((s for s in servers if s.get("method") is None), {})
    if entry.get("model"):
        return _local_path(entry["model"])
    from spectune.engine.shipped import target_path  # the embedded engine's default target

    return str(target_path().resolve())


def _local_path(model: str) -> str:
    """An existing local path made absolute; anything else (a model hub name) as given."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model


def _write(path: Path, text: str) -> Path:
    atomic_write_bytes(path, text.encode())
    return path.resolve()


def write_deploy_md(deployments: list[Deployment], path: Path) -> Path:
    """The deployments for people: per engine, the file, the method and why, and the command."""
    lines = ["# Deploying the measured answer", "",
             "Written by `spectune tune`, beside the files it describes (vLLM's JSON cannot carry comments).", ""]
    for d in deployments:
        lines += [f"## {ENGINE_NAMES[d.engine]}: {d.method or 'no equivalent'}", "", f"File: `{d.file}`" if d.file else "No file.", "", d.note, ""]
        if d.command:
            lines += ["```bash", d.command, "```", ""]
    return _write(path, "\n".join(lines))

