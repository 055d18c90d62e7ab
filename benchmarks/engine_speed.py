"""How fast the embedded engine runs here: target-only decode throughput, the draft/target cost ratio c (for the
draft model and for the EAGLE head), and what verifying g+1 tokens costs relative to one token. These are the
inputs of the speedup model E / (g*c + 1). Then drafting K = 1..8 tokens at batch 1 and 16: the EAGLE head (K
sequential steps) beside the dflash head (one pass over a block of K slots), as a share of one target forward;
`--sizes 1x256,2x256,3x384` adds dflash heads of other shapes (layers x head size, random weights: the cost does
not depend on the values), which is how the shipped head was sized.

    python benchmarks/engine_speed.py [--target DIR] [--draft DIR] [--eagle DIR] [--dflash DIR] [--threads N] [--sizes LxH,...]

Defaults: the shipped target, draft and heads. Figures are medians over repeated forwards (ms) and
wall-clock throughput over whole requests (tokens/s, prefill included).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from pathlib import Path

import torch

from spectune.engine.config import EngineConfig
from spectune.engine.dflash import DFlashHead, load_dflash
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


def eagle_chain(eagle: EagleHead, feature: torch.Tensor, token: torch.Tensor, k: int):
    """A case drafting k greedy tokens with the EAGLE head (k sequential steps, as its proposer at temperature 0)."""
    def run() -> None:
        f, t = feature, token
        for _ in range(k):
            f, logits = eagle.step(f, t)
            t = eagle.vocab[logits.argmax(-1)]
    return run


def drafting_ms(eagle: EagleHead, dflash: dict[str, DFlashHead], batches: tuple[int, ...], ks: range, repeats: int) -> dict[tuple[str, int, int], float]:
    """Median wall ms to draft K tokens per row as the proposers do (logits, argmax, draft-vocabulary ids):
    (drafter, batch, K) -> ms. The EAGLE head runs K steps, each dflash head one pass; cases run round-robin."""
    gen = torch.Generator().manual_seed(0)
    d = eagle.config.hidden_size

    def dflash_case(head: DFlashHead, feature: torch.Tensor, recent: torch.Tensor, k: int):
        return lambda: head.vocab[head.draft(feature, recent, k).argmax(-1)]

    cases = {}
    for batch in batches:
        feature = torch.nn.functional.rms_norm(torch.randn(batch, d, generator=gen), (d,))
        for k in ks:
            cases[("eagle", batch, k)] = eagle_chain(eagle, feature, torch.randint(0, eagle.vocab_size, (batch,), generator=gen), k)
            for name, head in dflash.items():
                recent = torch.randint(0, head.vocab_size, (batch, head.config.context_tokens), generator=gen)
                cases[(name, batch, k)] = dflash_case(head, feature, recent, k)
    times: dict[tuple[str, int, int], list[float]] = {key: [] for key in cases}
    with torch.inference_mode():
        for _ in range(repeats + 3):
            for key, run in cases.items():
                t0 = time.perf_counter()
                run()
                times[key].append((time.perf_counter() - t0) * 1000)
    return {key: statistics.median(t[3:]) for key, t in times.items()}


def random_dflash(like: DFlashHead, layers: int, head_size: int, target: Llama) -> DFlashHead:
    """A dflash head of another shape with random weights (timing only), intermediate = 2 x head size."""
    config = dataclasses.replace(like.config, num_layers=layers, head_size=head_size, intermediate_size=2 * head_size)
    weights = {name: 0.02 * torch.randn(shape) for name, shape in config.weight_shapes().items()}
    weights["draft_vocab"] = like.vocab
    return DFlashHead(config, weights, target)


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
    parser.add_argument("--dflash", type=Path, default=None)
    parser.add_argument("--sizes", default="", help="also time random dflash heads of these shapes, e.g. 1x256,3x384 (layers x head size)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if None in (args.target, args.draft, args.eagle, args.dflash):
        from spectune.engine import shipped

        args.target = args.target or shipped.target_path()
        args.draft = args.draft or shipped.draft_path()
        args.eagle = args.eagle or shipped.eagle_path()
        args.dflash = args.dflash or shipped.dflash_path()
    target, draft = load_model(args.target, 1024), load_model(args.draft, 1024)
    eagle, dflash = load_eagle(args.eagle, target), load_dflash(args.dflash, target)
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

    c = dflash.config
    heads = {f"dflash {c.num_layers}x{c.head_size} (shipped)": dflash}
    for size in filter(None, args.sizes.split(",")):
        layers, head_size = (int(v) for v in size.split("x"))
        heads[f"dflash {layers}x{head_size}"] = random_dflash(dflash, layers, head_size, target)
    ks = range(1, c.block_size + 1)
    batches = (1, 16)
    cases = {f"t{b}": (target, b, 1) for b in batches} | {f"v{b}_{k}": (target, b, k + 1) for b in batches for k in ks}
    ms = forward_ms(cases, args.repeats)
    drafts = drafting_ms(eagle, heads, batches, ks, args.repeats)
    for b in batches:
        print(f"\n| batch {b}: drafting K tokens | target verify K+1 tokens (x one target forward) | EAGLE head, K steps | "
              + " | ".join(heads) + " |")
        print("|---" * (3 + len(heads)) + "|")
        for k in ks:
            cells = [f"{drafts[(name, b, k)]:.3f} ms (c = {drafts[(name, b, k)] / ms[f't{b}']:.3f})" for name in ("eagle", *heads)]
            print(f"| K = {k} | {ms[f'v{b}_{k}']:.3f} ms ({ms[f'v{b}_{k}'] / ms[f't{b}']:.2f}) | " + " | ".join(cells) + " |")
        print(f"\ntarget forward, 1 token/row, batch {b}: {ms[f't{b}']:.3f} ms")

if __name__ == "__main__":
    main()
