"""How fast the embedded engine runs here: target-only decode throughput, the draft/target cost ratio c (for the
draft model and for the EAGLE head), and what verifying g+1 tokens costs relative to one token. These are the
inputs of the speedup model E / (g*c + 1).

    python benchmarks/engine_speed.py [--target DIR] [--draft DIR] [--eagle DIR] [--threads N]

Defaults: the shipped target, draft and EAGLE head. Figures are medians over repeated forwards (ms) and
wall-clock throughput over whole requests (tokens/s, prefill included).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from spectune.engine.config import EngineConfig
from spectune.engine.eagle import EagleHead, load_eagle
from spectune.engine.engine import LLMEngine
from spectune.engine.model import Llama, load_model
from spectune.engine.scheduler import SamplingParams

CONTEXT = 128  # tokens already in the KV cache when timing single forwards


def forward_ms(cases: dict[str, tuple[Llama, int, int]], repeats: int) -> dict[str, float]:
    """Median wall ms of one forward per case (model, batch, new tokens per row) at CONTEXT cached tokens,
    logits included. Cases run round-robin, so load from other processes hits them all alike."""
    setups = {}
    with torch.inference_mode():
        for name, (model, batch, tokens) in cases.items():
            cache = model.new_cache(batch)
            ids = torch.randint(0, model.config.vocab_size, (batch, CONTEXT + tokens))
            model.forward(ids[:, :CONTEXT], list(range(batch)), cache)
            setups[name] = (model, cache, ids[:, CONTEXT:])
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(repeats + 3):
            for name, (model, cache, new) in setups.items():
                slots = list(range(new.shape[0]))
                for s in slots:
                    cache.lengths[s] = CONTEXT  # roll back: every repeat sees the same context
                t0 = time.perf_counter()
                model.logits(model.forward(new, slots, cache))
                times[name].append((time.perf_counter() - t0) * 1000)
    return {name: statistics.median(t[3:]) for name, t in times.items()}


def eagle_step_ms(head: EagleHead, batch: int, repeats: int) -> float:
    """Median wall ms of one EAGLE draft step (head and argmax over its vocabulary) at `batch` rows."""
    feature = torch.nn.functional.rms_norm(torch.randn(batch, head.config.hidden_size), (head.config.hidden_size,))
    tokens = torch.randint(0, head.vocab_size, (batch,))
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 3):
            t0 = time.perf_counter()
            _, logits = head.step(feature, tokens)
            head.vocab[logits.argmax(-1)]
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times[3:])


def decode_tokens_per_s(target: Path, batch: int, max_tokens: int) -> float:
    engine = LLMEngine(EngineConfig(model=target, max_num_seqs=batch))
    vocab = engine.vocab_size
    prompts = [torch.randint(2, vocab, (32,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(batch)]
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)] * batch
    engine.generate(prompts, [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * batch)  # warm-up
    t0 = time.perf_counter()
    outputs = engine.generate(prompts, params)
    return sum(map(len, outputs)) / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=None)
    parser.add_argument("--draft", type=Path, default=None)
    parser.add_argument("--eagle", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.target is None or args.draft is None or args.eagle is None:
        from spectune.engine import shipped

        args.target = args.target or shipped.target_path()
        args.draft = args.draft or shipped.draft_path()
        args.eagle = args.eagle or shipped.eagle_path()
    target, draft = load_model(args.target, 1024), load_model(args.draft, 1024)
    eagle = load_eagle(args.eagle, target)
    print(f"target {args.target} ({target.config.num_layers} layers, hidden {target.config.hidden_size}); "
          f"draft {args.draft} ({draft.config.num_layers} layers, hidden {draft.config.hidden_size}); "
          f"torch threads {torch.get_num_threads()}; context {CONTEXT} tokens; load average {os.getloadavg()[0]:.1f}")

    print("\n| target-only decode | tokens/s |\n|---|---|")
    for batch in (1, 16):
        print(f"| batch {batch}, 128 tokens/request | {decode_tokens_per_s(args.target, batch, 128):.0f} |")

    gs = (1, 2, 3, 5, 7)
    cases = {"t1": (target, 1, 1), "d1": (draft, 1, 1), "t16": (target, 16, 1), "v16": (target, 16, 4)}
    cases |= {f"v{g}": (target, 1, g + 1) for g in gs}
    ms = forward_ms(cases, args.repeats)
    ms["e1"], ms["e16"] = eagle_step_ms(eagle, 1, args.repeats), eagle_step_ms(eagle, 16, args.repeats)
    print("\n| forward, batch 1 | ms | ratio |\n|---|---|---|")
    print(f"| target, 1 token | {ms['t1']:.3f} | 1.00 |")
    print(f"| draft model, 1 token | {ms['d1']:.3f} | c = {ms['d1'] / ms['t1']:.2f} |")
    print(f"| EAGLE head, 1 step | {ms['e1']:.3f} | c = {ms['e1'] / ms['t1']:.2f} |")
    for g in gs:
        print(f"| target verify g={g} ({g + 1} tokens) | {ms[f'v{g}']:.3f} | {ms[f'v{g}'] / ms['t1']:.2f} |")
    print(f"\n| forward, batch 16 | ms | ratio |\n|---|---|---|\n| target, 1 token/row | {ms['t16']:.3f} | 1.00 |")
    print(f"| target verify g=3 (4 tokens/row) | {ms['v16']:.3f} | {ms['v16'] / ms['t16']:.2f} |")
    print(f"| EAGLE head, 1 step | {ms['e16']:.3f} | c = {ms['e16'] / ms['t16']:.2f} |")

if __name__ == "__main__":
    main()
