"""SGLang: `python -m sglang.launch_server` with static or adaptive speculative steps.

What SGLang would only warn about or fail on late is checked before launch: adaptive steps need
EAGLE/EAGLE3 with topk 1 (SGLang otherwise silently turns adaptive off), and the launch step count must be
one of the adaptive config's candidate steps. Live state comes from /server_info (internal_states[0]:
speculative_num_steps, avg_spec_accept_length) and the sglang:spec_* gauges (--enable-metrics).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from spectune.emit import (
    ADAPTIVE_ALGORITHMS,
    sglang_flags,
    sglang_launch_steps,
    validate_sglang_config,
)
from spectune.errors import SpectuneError
from spectune.records import Scrape
from spectune.servers.base import ServerSpec
from spectune.servers.launched import LaunchedServer, option_given
from spectune.servers.scrape import HttpError, http_get, http_post, sglang_scrape

# spectune / vLLM method names -> SGLang's --speculative-algorithm
ALGORITHMS = {
    "eagle": "EAGLE", "eagle3": "EAGLE3", "draft_model": "STANDALONE", "standalone": "STANDALONE",
    "ngram": "NGRAM", "mtp": "NEXTN", "nextn": "NEXTN", "dflash": "DFLASH", "dspark": "DSPARK",
}  # fmt: skip
_NO_DRAFT_PATH = ("NGRAM", "NEXTN")  # drafters that need no separate checkpoint
TOPK_FLAG = "--speculative-eagle-topk"


def sglang_python() -> str:
    return os.environ.get("SPECTUNE_SGLANG_PYTHON") or sys.executable


def _flag_value(args: tuple[str, ...], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def speculative_args(spec: ServerSpec) -> list[str]:
    """The --speculative-* flags for the spec, after the checks SGLang itself skips or defers."""
    if spec.method is None:
        return []
    where = f"server {spec.name!r}"
    algorithm = ALGORITHMS.get(spec.method)
    if algorithm is None:
        raise SpectuneError(f"{where}: method {spec.method!r} has no SGLang algorithm; use one of {sorted(ALGORITHMS)}")
    if spec.per_batch_size:
        raise SpectuneError(f"{where}: per_batch_size is vLLM's schedule; for SGLang use adaptive_config")
    if algorithm == "NGRAM" and spec.draft_model:
        raise SpectuneError(f"{where}: draft_model does not apply to method 'ngram'; remove it")
    if algorithm not in _NO_DRAFT_PATH and not spec.draft_model:
        raise SpectuneError(f"{where}: SGLang {algorithm} needs draft_model (--speculative-draft-model-path)")
    topk_text = _flag_value(spec.extra_args, TOPK_FLAG)
    if topk_text is not None and not topk_text.isdigit():
        raise SpectuneError(f"{where}: extra_args {TOPK_FLAG} {topk_text!r} is not a positive integer")
    topk = int(topk_text) if topk_text is not None else 1
    if spec.adaptive_config:
        return _adaptive_args(spec, algorithm, topk)
    steps = spec.num_speculative_tokens
    if steps is None or steps < 1:
        raise SpectuneError(f"{where}: method {spec.method!r} needs num_speculative_tokens >= 1")
    args = ["--speculative-algorithm", algorithm, "--speculative-num-steps", str(steps)]
    if algorithm != "NGRAM" and topk_text is None:  # NGRAM takes its topk from its BFS breadth
        args += [TOPK_FLAG, "1"]
    # a chain of `steps` drafts plus the root; with topk > 1 the tree size is the user's, in extra_args.
    # SGLang's n-gram trie matches every suffix length itself: prompt_lookup_min/max have no SGLang flag.
    if topk == 1 and not option_given(spec.extra_args, "--speculative-num-draft-tokens"):
        args += ["--speculative-num-draft-tokens", str(steps + 1)]
    if spec.draft_model and algorithm not in _NO_DRAFT_PATH:
        args += ["--speculative-draft-model-path", spec.draft_model]
    return args


def _adaptive_args(spec: ServerSpec, algorithm: str, topk: int) -> list[str]:
    """Adaptive steps run only with EAGLE/EAGLE3 and topk 1 (SGLang otherwise turns them off with a warning),
    from a launch step that is one of the config's candidates (else SGLang refuses to start)."""
    where = f"server {spec.name!r}"
    if algorithm not in ADAPTIVE_ALGORITHMS:
        raise SpectuneError(f"{where}: adaptive_config needs method eagle or eagle3 (SGLang turns adaptive off for "
                            f"{algorithm}); change the method or remove adaptive_config")
    if topk != 1:
        raise SpectuneError(f"{where}: adaptive_config needs {TOPK_FLAG} 1, got {topk}; remove it from extra_args")
    try:
        steps = spec.num_speculative_tokens or sglang_launch_steps(validate_sglang_config(spec.adaptive_config))
        return sglang_flags(spec.adaptive_config, steps, algorithm, spec.draft_model)
    except SpectuneError as e:
        raise SpectuneError(f"{where}: {e}") from None


class SglangServer(LaunchedServer):
    engine = "SGLang"

    def __init__(self, spec: ServerSpec, log_dir: Path, max_batch_size: int | None = None):
        super().__init__(spec, log_dir)
        self.max_batch_size = max_batch_size

    def command(self, port: int) -> list[str]:
        spec = self.spec
        if not spec.model:
            raise SpectuneError(f"server {spec.name!r}: engine sglang needs `model` (a path or model name)")
        argv = [
            sglang_python(), "-m", "sglang.launch_server", "--model-path", spec.model,
            "--host", spec.host, "--port", str(port), "--served-model-name", spec.name, "--enable-metrics",
        ]  # fmt: skip
        argv += speculative_args(spec)
        if self.max_batch_size is not None and not option_given(spec.extra_args, "--max-running-requests"):
            argv += ["--max-running-requests", str(self.max_batch_size)]
        return argv + list(spec.extra_args)

    def scrape(self) -> Scrape:
        info = json.loads(http_get(self.base_url + "/server_info", headers=self.auth_headers()))
        try:
            metrics = http_get(self.base_url + "/metrics", headers=self.auth_headers())
        except HttpError:  # launched without --enable-metrics: /server_info alone still gives steps and accept length
            metrics = None
        return sglang_scrape(info, metrics)

    def reset_cache(self) -> None:
        http_post(self.base_url + "/flush_cache", headers=self.auth_headers())

    def engine_version(self) -> str | None:
        if not self.base_url:
            return None
        try:
            return json.loads(http_get(self.base_url + "/server_info", timeout_s=5.0, headers=self.auth_headers())).get("version")
        except (SpectuneError, ValueError):
            return None
