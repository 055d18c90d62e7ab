"""Continuous batching bookkeeping: sequences, KV slots, the waiting queue, and how many steps to draft."""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from spectune.engine.config import SpeculativeConfig


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 -> greedy
    ignore_eos: bool = False
    seed: int | None = None  # None -> drawn from the engine's seed


@dataclass(slots=True)
class RequestOutput:
    """What one engine step produced for one request: all tokens it accepted in that step."""

    request_id: int
    new_token_ids: list[int]
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative, including new_token_ids
    finish_reason: str | None = None  # "stop" (EOS), "length" (max_tokens), "abort", "error"
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class Sequence:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    finish_reason: str | None = None
    received_s: float | None = None  # perf_counter() when the server began reading the request (round log only)
    submitted_s: float | None = None  # perf_counter() when it was handed to the engine thread (round log only)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def num_remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]
    is_prefill: bool


class Scheduler:
    """Owns which sequences run. A step either prefills newly admitted sequences or decodes all running ones."""

    def __init__(self, max_num_seqs: int, eos_token_ids: tuple[int, ...], max_prefill_tokens: int = 8192):
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = set(eos_token_ids)
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_slots = list(range(max_num_seqs))  # a heap: lowest slot first keeps running slots contiguous

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        admitted: list[Sequence] = []
        budget = self.max_prefill_tokens
        while self.waiting and self._free_slots and (not admitted or len(self.waiting[0].prompt_ids) <= budget):
            seq = self.waiting.popleft()
            seq.slot = heapq.heappop(self._free_slots)
            budget -= len(seq.prompt_ids)
            admitted.append(seq)
        if admitted:
            self.running.extend(admitted)
            self.running.sort(key=lambda s: s.slot)
            return ScheduledBatch(admitted, is_prefill=True)
        return ScheduledBatch(list(self.running), is_prefill=False)

    def postprocess(self, seqs: list[Sequence], new_tokens: list[list[int]]) -> list[RequestOutput]:
        """Append each sequence's tokens, cut at EOS / max_tokens, free finished slots."""
        outputs = []
        for seq, tokens in zip(seqs, new_tokens):
            tokens = tokens[: seq.num_remaining]
            if not seq.params.ignore_eos:
                for i, token in enumerate(tokens):
                    if token in self.eos_token_ids:
                        tokens = tokens[: i + 1]
                        seq.finish_reason = "stop"
                        break
            seq.output_ids.extend(tokens)
            if seq.finish_reason is None and seq.num_remaining <= 0:
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                self._release(seq)
            outputs.append(RequestOutput(seq.request_id, tokens, len(seq.prompt_ids), len(seq.output_ids), seq.finish_reason))
        return outputs

    def abort(self, request_id: int) -> Sequence | None:
        for seq in [*self.waiting, *self.running]:
            if seq.request_id == request_id:
                seq.finish_reason = "abort"
                if seq in self.waiting:
                    self.waiting.remove(seq)
                else:
                    self._release(seq)
                return seq
        return None

    def abort_all(self, reason: str) -> list[Sequence]:
        seqs = [*self.waiting, *self.running]
        for seq in seqs:
            seq.finish_reason = reason
            if seq.slot is not None and seq in self.running:
                self._release(seq)
        self.waiting.clear()
        return seqs

    def _release(self, seq: Sequence) -> None:
        self.running.remove(seq)
        heapq.heappush(self._free_slots, seq.slot)


class StepPolicy(Protocol):
    """How many draft tokens per request the next verify round uses, given the running batch size."""

    def steps_for_batch(self, batch_size: int) -> int: ...

    def on_verify_complete(self, accepted_drafts_per_req: list[int], batch_size: int) -> None: ...


@dataclass(slots=True)
class StaticSteps:
    num_steps: int

    def steps_for_batch(self, batch_size: int) -> int:
        return self.num_steps

    def on_verify_complete(self, accepted_drafts_per_req: list[int], batch_size: int) -> None:
        pass


@dataclass(slots=True)
class BatchSizeSteps:
    """vLLM dynamic SD: a dense batch size -> k table; gaps carry the previous k, the last k runs to the end."""

    table: list[int]  # index = batch size

    @classmethod
    def build(cls, schedule: tuple[tuple[int, int, int], ...], max_batch_size: int, max_k: int) -> BatchSizeSteps:
        table = [0] * (max_batch_size + 1)
        k = 0
        ranges = iter(schedule)
        current = next(ranges)
        for bs in range(1, max_batch_size + 1):
            while current is not None and bs > current[1]:
                k = current[2]
                current = next(ranges, None)
            if current is not None and bs >= current[0]:
                k = current[2]
            table[bs] = min(k, max_k)
        return cls(table)

    def steps_for_batch(self, batch_size: int) -> int:
        return self.table[min(batch_size, len(self.table) - 1)]

    def on_verify_complete(self, accepted_drafts_per_req: list[int], batch_size: int) -> None:
        pass


class AdaptiveSteps:
    """SGLang's adaptive policy (spectune.adaptive), without CUDA-graph batch padding."""

    def __init__(self, config_path: Path, initial_steps: int):
        from spectune.adaptive import AdaptivePolicy

        self.policy = AdaptivePolicy.from_config(config_path, initial_steps=initial_steps, cuda_graph_bs=[])

    def steps_for_batch(self, batch_size: int) -> int:
        return self.policy.steps_for_batch(batch_size)

    def on_verify_complete(self, accepted_drafts_per_req: list[int], batch_size: int) -> None:
        self.policy.on_verify_complete(accepted_drafts_per_req, batch_size)


def make_step_policy(spec: SpeculativeConfig | None, adaptive_config: Path | None, max_num_seqs: int) -> StepPolicy:
    if spec is None:
        return StaticSteps(0)
    if adaptive_config is not None:
        return AdaptiveSteps(adaptive_config, spec.num_speculative_tokens)
    if spec.num_speculative_tokens_per_batch_size is not None:
        return BatchSizeSteps.build(spec.num_speculative_tokens_per_batch_size, max_num_seqs, spec.num_speculative_tokens)
    return StaticSteps(spec.num_speculative_tokens)
