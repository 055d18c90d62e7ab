"""The engine: step = schedule -> run -> postprocess (nano-vllm), plus a thread that serves it to the HTTP server."""

from __future__ import annotations

import itertools
import json
import os
import queue
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from spectune.engine.config import EngineConfig
from spectune.engine.model import ModelConfig, load_model
from spectune.engine.dflash import load_dflash
from spectune.engine.eagle import load_eagle
from spectune.engine.proposers import DFlashProposer, DraftModelProposer, EagleProposer, NgramProposer, Proposer
from spectune.engine.runner import ModelRunner, RoundResult
from spectune.engine.scheduler import RequestOutput, SamplingParams, Scheduler, Sequence, make_step_policy
from spectune.errors import SpectuneError


@dataclass(slots=True)
class EngineMetrics:
    """Lifetime counters, vLLM's meaning: drafts count request-rounds with >= 1 draft; accepted excludes the bonus."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_spec_request_rounds: int = 0  # request-rounds with speculation on, for SGLang's avg_spec_accept_length
    num_spec_round_tokens: int = 0  # tokens those request-rounds produced (accepted + bonus/correction)

    @property
    def avg_spec_accept_length(self) -> float:
        return self.num_spec_round_tokens / self.num_spec_request_rounds if self.num_spec_request_rounds else 0.0


class LLMEngine:
    """Token ids in, token ids out. Not thread-safe: drive it from one thread (EngineThread does)."""

    def __init__(self, config: EngineConfig):
        threads = config.num_threads or int(os.environ.get("SPECTUNE_TORCH_THREADS", "0"))
        if threads:
            torch.set_num_threads(threads)
        self.config = config
        self.model_path = config.model or _shipped().target_path()
        limit = ModelConfig.from_dir(self.model_path).max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise SpectuneError(f"--max-model-len: {config.max_model_len} exceeds the model's max_position_embeddings {limit}")
        self.max_model_len = config.max_model_len or limit
        target = load_model(self.model_path, self.max_model_len)
        spec = config.speculative
        proposer: Proposer | None = None
        if spec is not None and spec.method == "draft_model":
            draft_path = spec.model or _shipped().draft_path()
            draft = load_model(draft_path, self.max_model_len)
            if draft.config.vocab_size != target.config.vocab_size:
                raise SpectuneError(f"{draft_path}: draft vocab_size {draft.config.vocab_size} != target's "
                                    f"{target.config.vocab_size}; the draft must share the target's tokenizer")
            proposer = DraftModelProposer(draft, config.max_num_seqs)
        elif spec is not None and spec.method == "eagle":
            proposer = EagleProposer(load_eagle(spec.model or _shipped().eagle_path(), target), config.max_num_seqs)
        elif spec is not None and spec.method == "dflash":
            head_path = spec.model or _shipped().dflash_path()
            head = load_dflash(head_path, target)
            if spec.num_speculative_tokens > head.config.block_size:
                raise SpectuneError(f"--speculative-config.num_speculative_tokens: {spec.num_speculative_tokens} exceeds the dflash "
                                    f"head's block_size {head.config.block_size} ({head_path / 'config.json'}); use at most that")
            proposer = DFlashProposer(head, config.max_num_seqs)
        elif spec is not None:
            proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        self.vocab_size = target.config.vocab_size
        self.eos_token_ids = target.config.eos_token_ids or _tokenizer_eos(self.model_path)
        self.runner = ModelRunner(target, proposer, config.max_num_seqs)
        self.scheduler = Scheduler(config.max_num_seqs, self.eos_token_ids)
        try:
            self.step_policy = make_step_policy(spec, config.adaptive_config, config.max_num_seqs)
        except ValueError as exc:
            raise SpectuneError(f"{config.adaptive_config}: {exc}") from None
        self.num_steps = self.step_policy.steps_for_batch(1)  # live value, for /server_info
        self.metrics = EngineMetrics(accepted_per_pos=[0] * (spec.num_speculative_tokens if spec else 0))
        self.metrics_lock = threading.Lock()
        self._ids = itertools.count()
        self._seeds = random.Random(config.seed)
        self._start = time.perf_counter()
        self._round_log = config.round_log.open("a", buffering=1) if config.round_log else None

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (a client error) if the request cannot run."""
        if not prompt_ids:
            raise ValueError("prompt: must not be empty")
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt: token ids must be in [0, {self.vocab_size})")
        if params.max_tokens < 1:
            raise ValueError("max_tokens: must be >= 1")
        if params.temperature < 0:
            raise ValueError("temperature: must be >= 0")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds max_model_len {self.max_model_len}")

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: int | None = None,
                    received_s: float | None = None, submitted_s: float | None = None) -> int:
        self.check_request(prompt_ids, params)
        request_id = next(self._ids) if request_id is None else request_id
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        generator = torch.Generator().manual_seed(seed)
        self.scheduler.add(Sequence(request_id, list(prompt_ids), params, generator, received_s=received_s, submitted_s=submitted_s))
        return request_id

    def new_request_id(self) -> int:
        return next(self._ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        start_s = time.perf_counter()
        batch = self.scheduler.schedule()
        with torch.inference_mode():
            if batch.is_prefill:
                new_tokens = self.runner.prefill(batch.seqs)
                self._record_prefill(batch.seqs, start_s)
            else:
                num_steps = self.step_policy.steps_for_batch(len(batch.seqs))
                result = self.runner.speculate(batch.seqs, num_steps)
                self.step_policy.on_verify_complete(result.accepted, len(batch.seqs))
                self._record_round(result, [s.request_id for s in batch.seqs], start_s)
                new_tokens = result.new_tokens
        outputs = self.scheduler.postprocess(batch.seqs, new_tokens)
        with self.metrics_lock:
            if batch.is_prefill:
                self.metrics.prompt_tokens += sum(len(s.prompt_ids) for s in batch.seqs)
            self.metrics.generation_tokens += sum(len(o.new_token_ids) for o in outputs)
        return outputs

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
        """Run requests to completion; returns each one's output token ids (for tests and benchmarks)."""
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        outputs: dict[int, list[int]] = {i: [] for i in ids}
        while self.has_unfinished():
            for out in self.step():
                outputs[out.request_id].extend(out.new_token_ids)
        return [outputs[i] for i in ids]

    def abort_request(self, request_id: int) -> RequestOutput | None:
        seq = self.scheduler.abort(request_id)
        return None if seq is None else RequestOutput(request_id, [], len(seq.prompt_ids), len(seq.output_ids), "abort")

    def kv_cache_usage(self) -> float:
        used = sum(seq.num_tokens for seq in list(self.scheduler.running))
        return used / (self.config.max_num_seqs * self.max_model_len)

    def _record_round(self, result: RoundResult, request_ids: list[int], start_s: float) -> None:
        self.num_steps = result.num_steps
        with self.metrics_lock:
            m = self.metrics
            for proposed, accepted in zip(result.proposed, result.accepted):
                if result.num_steps > 0:
                    m.num_spec_request_rounds += 1
                    m.num_spec_round_tokens += accepted + 1
                if proposed == 0:
                    continue
                m.num_drafts += 1
                m.num_draft_tokens += proposed
                m.num_accepted_tokens += accepted
                if proposed > len(m.accepted_per_pos):
                    m.accepted_per_pos.extend([0] * (proposed - len(m.accepted_per_pos)))
                for pos in range(accepted):
                    m.accepted_per_pos[pos] += 1
        if self._round_log is not None:
            now = time.perf_counter()
            line = {
                "t_s": round(now - self._start, 6),
                "batch_size": len(result.proposed),
                "num_steps": result.num_steps,
                "proposed": result.proposed,
                "accepted": result.accepted,
                "round_ms": round(result.round_ms, 4),
                **_clocks(start_s, now),
                "request_ids": request_ids,
            }
            self._round_log.write(json.dumps(line) + "\n")

    def _record_prefill(self, seqs: list[Sequence], start_s: float) -> None:
        """A prefill step in the round log: the request-level simulator fits prefill and step costs from the gaps
        between consecutive lines (spectune.costmodel.read_step_log); trace readers skip these lines."""
        if self._round_log is None:
            return
        now = time.perf_counter()
        line = {
            "t_s": round(now - self._start, 6),
            "prefill": True,
            "batch_size": len(seqs),
            "prompt_tokens": [len(s.prompt_ids) for s in seqs],
            "num_running": len(self.scheduler.running) - len(seqs),  # decoding before this step: > 0 means no idle gap
            **_clocks(start_s, now),
            "request_ids": [s.request_id for s in seqs],
            "received_s": [_clock(s.received_s) for s in seqs],
            "submitted_s": [_clock(s.submitted_s) for s in seqs],
        }
        self._round_log.write(json.dumps(line) + "\n")

    def close(self) -> None:
        if self._round_log is not None:
            self._round_log.close()


def _clock(t: float | None) -> float | None:
    return None if t is None else round(t, 6)


def _clocks(start_s: float, end_s: float) -> dict[str, float]:
    """A step's start and end on the machine's monotonic clock (time.perf_counter(), CLOCK_MONOTONIC on Linux: the
    load generator's perf_counter_ns stamps share it), so a replay can be checked against the client's chunk times."""
    return {"start_s": round(start_s, 6), "end_s": round(end_s, 6)}


def _shipped():
    from spectune.engine import shipped  # written by the training work; only needed when no model dir is given

    return shipped


def _tokenizer_eos(path: Path) -> tuple[int, ...]:
    """EOS from tokenizer_config.json's eos_token when config.json has none."""
    config_file, tokenizer_file = path / "tokenizer_config.json", path / "tokenizer.json"
    if not config_file.is_file() or not tokenizer_file.is_file():
        return ()
    eos = json.loads(config_file.read_text()).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if not eos:
        return ()
    from tokenizers import Tokenizer

    token_id = Tokenizer.from_file(str(tokenizer_file)).token_to_id(eos)
    return () if token_id is None else (token_id,)


class EngineThread:
    """Runs an LLMEngine in its own thread. submit/abort are thread-safe; outputs go to per-request callbacks,
    which run on the engine thread (the server hops them onto its event loop)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._callbacks: dict[int, Callable[[RequestOutput], None]] = {}
        self._thread = threading.Thread(target=self._run, name="spectune-engine", daemon=True)
        self._stopping = False
        self._pending_adds = 0  # submitted, not yet in the scheduler: they count as waiting
        self._pending_lock = threading.Lock()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._inbox.put(("stop", None, None))
        self._thread.join()
        self.engine.close()

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_output: Callable[[RequestOutput], None],
               received_s: float | None = None) -> int:
        """Validate (ValueError on a bad request) and queue; returns the request id. received_s: when the server began
        reading the request (perf_counter), for the round log."""
        self.engine.check_request(prompt_ids, params)
        request_id = self.engine.new_request_id()
        with self._pending_lock:
            self._pending_adds += 1
        self._inbox.put(("add", request_id, (prompt_ids, params, on_output, received_s, time.perf_counter())))
        return request_id

    def abort(self, request_id: int) -> None:
        self._inbox.put(("abort", request_id, None))

    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._pending_adds

    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def _run(self) -> None:
        while not self._stopping:
            self._drain(block=not self.engine.has_unfinished())
            if self._stopping or not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception:  # a bug in the engine: fail the requests in flight instead of hanging them
                error = traceback.format_exc()
                print(error, file=sys.stderr, flush=True)
                outputs = [
                    RequestOutput(s.request_id, [], len(s.prompt_ids), len(s.output_ids), "error", error.strip().splitlines()[-1])
                    for s in self.engine.scheduler.abort_all("error")
                ]
            for out in outputs:
                self._deliver(out)

    def _drain(self, block: bool) -> None:
        while True:
            try:
                kind, request_id, payload = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if kind == "add":
                prompt_ids, params, on_output, received_s, submitted_s = payload
                self._callbacks[request_id] = on_output
                self.engine.add_request(prompt_ids, params, request_id, received_s, submitted_s)
                with self._pending_lock:
                    self._pending_adds -= 1
            elif kind == "abort":
                out = self.engine.abort_request(request_id)
                if out is not None:
                    self._deliver(out)
            else:
                return

    def _deliver(self, out: RequestOutput) -> None:
        callback = self._callbacks.get(out.request_id)
        if out.finished:
            self._callbacks.pop(out.request_id, None)
        if callback is not None:
            callback(out)
