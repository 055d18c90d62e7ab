"""Each engine's deployable config: the fastest measured method that engine can run, and a note wherever the fastest
measured method has no equivalent there. Cells are built here with chosen throughputs (which method is fastest is
the input under test); the files are real and checked with the engines' rules (emit's validators)."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pandas as pd
import pytest

from spectune.adaptive import AdaptiveConfig
from spectune.deploy_engines import EAGLE_DRAFT, TARGET_GGUF, TunedMethod, measured_methods, write_deployments
from spectune.emit import validate_sglang_config, validate_vllm_config
from spectune.engine.shipped import draft_path, eagle_path, target_path

BATCH_SIZES = (1, 4, 16)
SERVERS = {  # name: (method, g)
    "target": (None, 0),
    "draft-g2": ("draft_model", 2),
    "draft-g4": ("draft_model", 4),
    "eagle-g2": ("eagle", 2),
    "eagle-g4": ("eagle", 4),
    "ngram-g3": ("ngram", 3),
}
PLAN_SERVERS = [
    {"name": "target", "engine": "embedded"},
    {"name": "draft", "engine": "embedded", "method": "draft_model"},
    {"name": "eagle", "engine": "embedded", "method": "eagle"},
    {"name": "ngram", "engine": "embedded", "method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4},
]
CONFIG = AdaptiveConfig.from_dict({"1": {"candidate_steps": [2, 4]}, "16": {"candidate_steps": [0, 2]}})


def cells(speedups: dict[str, dict[int, float]], repeats: int = 2) -> pd.DataFrame:
    """One row per cell; speedups[server][batch size] = its throughput over target-only's (target: 100 tok/s per slot)."""
    rows = []
    for server, (method, g) in SERVERS.items():
        if server != "target" and server not in speedups:
            continue
        for bs in BATCH_SIZES:
            for repeat in range(repeats):
                ratio = 1.0 if server == "target" else speedups[server][bs]
                rows.append({"server": server, "engine": "embedded", "method": method, "is_speculative": method is not None,
                             "num_speculative_tokens": g, "adaptive_config": None, "batch_size": bs, "repeat": repeat,
                             "status": "ok", "failure_rate": 0.0, "output_throughput_tps": 100.0 * bs * ratio,
                             "acceptance_rate": 0.6 if method else float("nan")})
    return pd.DataFrame(rows)


MANIFEST = {"plan": {"max_failure_rate": 0.05, "servers": PLAN_SERVERS}}
EAGLE_FASTEST = {"eagle-g2": {1: 1.5, 4: 1.4, 16: 1.2}, "eagle-g4": {1: 1.6, 4: 1.3, 16: 1.0},
                 "ngram-g3": {1: 1.35, 4: 1.1, 16: 0.95}, "draft-g2": {1: 0.8, 4: 0.85, 16: 0.9}, "draft-g4": {1: 0.7, 4: 0.8, 16: 0.85}}


def tuned(method: str, steps: dict[int, int] | None = None, best_static: int = 2) -> TunedMethod:
    return TunedMethod(engine="embedded", method=method, config=CONFIG, steps_by_batch_size=steps or {1: 4, 4: 2, 16: 2},
                       best_static=best_static)


@pytest.fixture(autouse=True)
def no_llama_cpp(tmp_path, monkeypatch):
    """An empty engine cache: no llama.cpp converter, so no GGUF can be made (the same outcome on every machine)."""
    monkeypatch.setenv("SPECTUNE_CACHE", str(tmp_path / "cache"))


def by_engine(deployments) -> dict:
    return {d.engine: d for d in deployments}


def test_measured_methods_rank_by_geometric_mean_of_each_batch_sizes_best_step_count():
    scores = measured_methods(cells(EAGLE_FASTEST), MANIFEST)
    assert [s.method for s in scores] == ["eagle", "ngram", "draft_model"]
    eagle = scores[0]
    assert eagle.speedup == pytest.approx((1.6 * 1.4 * 1.2) ** (1 / 3))
    assert eagle.best_steps == {1: 4, 4: 2, 16: 2} and eagle.best_static == 2
    ngram = scores[1]
    assert ngram.best_steps == {1: 3, 4: 3, 16: 0}  # slower than target-only at 16: no speculation there
    assert ngram.server["prompt_lookup_max"] == 4


def test_eagle_fastest_sglang_runs_it_vllm_and_llamacpp_get_what_they_can_load_with_notes(tmp_path):
    out = tmp_path / "tuned"
    d = by_engine(write_deployments(tuned("eagle"), cells(EAGLE_FASTEST), MANIFEST, out))

    assert d["sglang"].method == "eagle" and d["sglang"].file == (out / "adaptive_spec.json").resolve()
    validate_sglang_config(d["sglang"].file)
    argv = shlex.split(d["sglang"].command)
    assert argv[:5] == ["python", "-m", "sglang.launch_server", "--model-path", str(target_path().resolve())]
    assert argv[argv.index("--speculative-algorithm") + 1] == "EAGLE" and argv[argv.index("--speculative-eagle-topk") + 1] == "1"
    assert argv[argv.index("--speculative-adaptive-config") + 1] == str(d["sglang"].file)
    # the shipped EAGLE head is spectune's own format: a placeholder and a note, never the head's path
    assert argv[argv.index("--speculative-draft-model-path") + 1] == EAGLE_DRAFT and str(eagle_path()) not in d["sglang"].command
    assert "SGLang cannot load" in d["sglang"].note

    vllm = validate_vllm_config(d["vllm"].file)
    assert d["vllm"].method == vllm.method == "ngram" and vllm.model is None
    assert (vllm.prompt_lookup_min, vllm.prompt_lookup_max) == (1, 4)
    assert vllm.num_speculative_tokens_per_batch_size == [(1, 15, 3), (16, 16, 0)]  # measured: ngram loses at 16
    assert "eagle measured faster but has no vLLM equivalent here" in d["vllm"].note
    assert "the fastest measured method vLLM can load" in d["vllm"].note
    assert "batch 1-15: 3, batch 16: 0 (larger batches keep 0)" in d["vllm"].note  # the schedule, as the file has it
    assert json.loads(shlex.split(d["vllm"].command)[-1]) == json.loads(d["vllm"].file.read_text())

    flags = d["llamacpp"].file.read_text().split()
    assert d["llamacpp"].method == "ngram" and "-md" not in flags
    assert flags == ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-m", "3", "--spec-ngram-simple-size-n", "1"]
    assert "eagle measured faster but has no llama.cpp equivalent here" in d["llamacpp"].note
    # one draft length for every batch size: where ngram lost (16), the note says to launch without it
    assert "It measured no faster than target-only at batch size 16: where a server runs that many" in d["llamacpp"].note
    assert shlex.split(d["llamacpp"].command)[:3] == ["llama-server", "-m", TARGET_GGUF] and TARGET_GGUF in d["llamacpp"].note

    md = (out / "deploy.md").read_text()
    assert all(dep.note in md for dep in d.values()) and d["vllm"].command in md


def test_vllm_gets_the_shipped_draft_by_absolute_path_when_it_beats_ngram(tmp_path):
    speedups = {**EAGLE_FASTEST, "draft-g2": {1: 1.3, 4: 1.25, 16: 1.1}}
    d = by_engine(write_deployments(tuned("eagle"), cells(speedups), MANIFEST, tmp_path))
    vllm = validate_vllm_config(d["vllm"].file)
    assert vllm.method == "draft_model" and vllm.model == str(draft_path().resolve()) and Path(vllm.model).is_absolute()
    assert vllm.num_speculative_tokens_per_batch_size == [(1, 16, 2)]
    # llama.cpp would run the draft too, but only as GGUF: with no converter here it falls back to ngram, and says why
    assert d["llamacpp"].method == "ngram"
    assert "draft_model measured faster but has no llama.cpp equivalent here: llama.cpp needs a GGUF file" in d["llamacpp"].note
    assert "-md" not in d["llamacpp"].file.read_text()


def test_llamacpp_gets_a_gguf_draft_by_absolute_path(tmp_path, monkeypatch):
    gguf = tmp_path / "models" / "draft.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    speedups = {"draft-g2": {1: 1.3, 4: 1.2, 16: 1.1}, "draft-g4": {1: 1.2, 4: 1.1, 16: 1.0}, "ngram-g3": {1: 1.1, 4: 1.0, 16: 0.9}}
    d = by_engine(write_deployments(tuned("draft_model"), cells(speedups), MANIFEST, tmp_path / "out", draft_model="models/draft.gguf"))
    assert d["llamacpp"].file.read_text().split() == ["-md", str(gguf), "--spec-type", "draft-simple", "--spec-draft-n-max", "2"]
    # vLLM loads a Hugging Face directory, not that file: the next method it can load, with the reason
    assert d["vllm"].method == "ngram" and "is a file (GGUF?)" in d["vllm"].note


def test_ngram_fastest_sglang_has_no_equivalent_and_says_how_to_tune_for_eagle(tmp_path):
    speedups = {"ngram-g3": {1: 1.6, 4: 1.4, 16: 1.1}, "eagle-g2": {1: 1.2, 4: 1.1, 16: 1.0}}
    d = by_engine(write_deployments(tuned("ngram"), cells(speedups), MANIFEST, tmp_path))
    sglang = d["sglang"]
    assert sglang.method is None and sglang.command is None and sglang.file.is_file()  # still written, and said why
    assert "no SGLang equivalent of ngram" in sglang.note and "EAGLE/EAGLE3" in sglang.note
    assert "spectune tune RESULTS --method eagle" in sglang.note
    # the tuned method's schedule (simulated) where vLLM runs the tuned method itself
    assert validate_vllm_config(d["vllm"].file).num_speculative_tokens_per_batch_size == [(1, 3, 4), (4, 16, 2)]
    assert "the tuned method's best per-batch-size schedule" in d["vllm"].note


def test_nothing_vllm_or_llamacpp_can_run_was_measured_gives_ngram_marked_not_measured(tmp_path):
    d = by_engine(write_deployments(tuned("eagle", best_static=4), cells({"eagle-g4": {1: 1.5, 4: 1.3, 16: 1.1}}), MANIFEST, tmp_path))
    vllm = validate_vllm_config(d["vllm"].file)
    assert (vllm.method, vllm.num_speculative_tokens) == ("ngram", 4) and "NOT MEASURED" in d["vllm"].note
    assert "eagle measured faster but has no vLLM equivalent here" in d["vllm"].note
    assert d["llamacpp"].method == "ngram" and "NOT MEASURED" in d["llamacpp"].note


def test_an_unmeasured_ngram_is_not_offered_where_every_measured_method_lost_to_target_only(tmp_path):
    (tmp_path / "vllm_speculative_config.json").write_text("{}")  # an earlier tune's, when eagle still won
    slower = {"eagle-g4": {1: 0.8, 4: 0.6, 16: 0.45}}  # geometric mean 0.60
    d = by_engine(write_deployments(tuned("eagle", {1: 0, 4: 0, 16: 0}, best_static=4), cells(slower), MANIFEST, tmp_path))
    for engine, name in (("vllm", "vLLM"), ("llamacpp", "llama.cpp")):
        assert d[engine].method == "target-only" and "NOT MEASURED" not in d[engine].note
        assert d[engine].note.startswith("no speculation: no measured method beat target-only at any batch size (eagle 0.60x")
        assert f"n-gram lookup, which {name} runs without a draft model, was not measured" in d[engine].note
        assert f"eagle (measured 0.60x target-only) has no {name} equivalent here either" in d[engine].note
        assert "measured faster" not in d[engine].note
    assert d["vllm"].file is None and not (tmp_path / "vllm_speculative_config.json").exists()
    assert d["vllm"].command.startswith("vllm serve ") and "--speculative-config" not in d["vllm"].command
    assert d["llamacpp"].file.read_text().strip() == "" and "--spec-type" not in d["llamacpp"].command


def test_written_files_get_the_mode_open_would_give_them(tmp_path):
    old = os.umask(0o027)
    try:
        deployments = write_deployments(tuned("eagle"), cells(EAGLE_FASTEST), MANIFEST, tmp_path)
    finally:
        os.umask(old)
    for path in [d.file for d in deployments] + [tmp_path / "deploy.md"]:
        assert path.is_absolute() and oct(path.stat().st_mode & 0o777) == oct(0o640), path


def test_llamacpp_does_not_speculate_with_a_method_slower_than_target_only_everywhere(tmp_path, monkeypatch):
    gguf = tmp_path / "models" / "draft.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    slower = {"draft-g2": {1: 0.8, 4: 0.9, 16: 0.95}, "eagle-g2": {1: 1.4, 4: 1.3, 16: 1.2}}
    d = by_engine(write_deployments(tuned("eagle"), cells(slower), MANIFEST, tmp_path / "out", draft_model="models/draft.gguf"))
    # llama.cpp has no per-batch-size steps: a draft slower at every batch size means running without one
    assert d["llamacpp"].method == "target-only" and d["llamacpp"].file.read_text().strip() == ""
    assert "-md" not in d["llamacpp"].command and "slower than target-only at every batch size" in d["llamacpp"].note
    assert f"-md {gguf}" in d["llamacpp"].note  # how to add it anyway


def test_vllm_does_not_speculate_when_every_batch_sizes_best_is_target_only(tmp_path):
    slower = {"ngram-g3": {1: 0.9, 4: 0.95, 16: 0.8}, "eagle-g2": {1: 1.4, 4: 1.3, 16: 1.2}}
    d = by_engine(write_deployments(tuned("eagle"), cells(slower), MANIFEST, tmp_path))
    # ngram is what vLLM can run here; slower than target-only at every batch size, it is not switched on
    assert d["vllm"].method == "target-only" and "--speculative-config" not in d["vllm"].command
    assert d["vllm"].note.startswith("no speculation: ngram") and "kept for the record" in d["vllm"].note
    assert json.loads(d["vllm"].file.read_text())["method"] == "ngram"  # the schedule's file: 0 steps everywhere
    faster = {"ngram-g3": {1: 1.2, 4: 0.95, 16: 0.8}, "eagle-g2": {1: 1.4, 4: 1.3, 16: 1.2}}
    d = by_engine(write_deployments(tuned("eagle"), cells(faster), MANIFEST, tmp_path / "faster"))
    assert d["vllm"].method == "ngram" and "--speculative-config" in d["vllm"].command  # faster at batch 1: on there


def test_a_tuned_config_that_never_drafts_deploys_sglang_without_speculation(tmp_path):
    never = AdaptiveConfig.from_dict({"1": {"candidate_steps": [0]}})
    slower = {"eagle-g2": {1: 0.9, 4: 0.8, 16: 0.7}}
    method = TunedMethod(engine="embedded", method="eagle", config=never, steps_by_batch_size={1: 0, 4: 0, 16: 0}, best_static=2)
    d = by_engine(write_deployments(method, cells(slower), MANIFEST, tmp_path))
    assert d["sglang"].method == "target-only" and "--speculative" not in d["sglang"].command
    assert "never drafts" in d["sglang"].note and d["sglang"].file.is_file()
