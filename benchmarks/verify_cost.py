"""What one speculative round's parts cost on the embedded engine, per batch size and step count g (issue 12: which
part of a round is not linear in g?).

    flock /tmp/spectune-cpu.lock python benchmarks/verify_cost.py [--threads 1] [--repeats 30] [--batches 1,2,4,8,16,32]

Per batch size B and g = 0..6, median wall ms of
  verify : the target's forward over g + 1 tokens per row at CONTEXT cached tokens, its logits and the greedy accept
           (what ModelRunner.speculate does after the proposer; g = 0 is a plain decode step);
  eagle  : the EAGLE head drafting g tokens (g sequential steps);
  dflash : the dflash head drafting g tokens (one pass).
Then, per part, the line through g = 2..6 and how far g = 1 lies from it (measured / line): a part whose g = 1 sits
below its line is what makes g = 1 faster than a model linear in g predicts. Threads default to 1, as the sweep's
embedded servers run on this 2-core machine (spectune/servers/embedded.py: cores - 1). Cases run round-robin, so
load from other processes hits them all alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spectune.engine import shipped  # noqa: E402
from spectune.engine.dflash import load_dflash  # noqa: E402
from spectune.engine.eagle import load_eagle  # noqa: E402
from spectune.engine.model import load_model  # noqa: E402
from spectune.engine.speculative import greedy_verify  # noqa: E402

from engine_speed import eagle_chain  # noqa: E402  (benchmarks/, this script's folder)

CONTEXT = 128  # tokens already in each row's KV cache (the code workload's prompts are ~110 tokens)
STEPS = range(0, 7)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--batches", default="1,2,4,8,16,32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    target = load_model(shipped.target_path(), 1024)
    eagle, dflash = load_eagle(shipped.eagle_path(), target), load_dflash(shipped.dflash_path(), target)
    cache = target.new_cache(max(batches))
    gen = torch.Generator().manual_seed(0)
    d = target.config.hidden_size

    def verify(batch: int, g: int) -> Callable[[], None]:
        slots = list(range(batch))
        new = torch.randint(0, target.config.vocab_size, (batch, g + 1), generator=gen)
        draft, num_draft = new[:, 1:], torch.full((batch,), g)

        def run() -> None:
            for s in slots:
                cache.lengths[s] = CONTEXT  # roll back: every repeat sees the same context
            greedy_verify(draft, num_draft, target.logits(target.forward(new, slots, cache)))
        return run

    def eagle_draft(batch: int, g: int) -> Callable[[], None]:
        feature = torch.nn.functional.rms_norm(torch.randn(batch, d, generator=gen), (d,))
        return eagle_chain(eagle, feature, torch.randint(0, eagle.vocab_size, (batch,), generator=gen), g)

    def dflash_draft(batch: int, g: int) -> Callable[[], None]:
        feature = torch.nn.functional.rms_norm(torch.randn(batch, d, generator=gen), (d,))
        recent = torch.randint(0, dflash.vocab_size, (batch, dflash.config.context_tokens), generator=gen)
        return lambda: dflash.vocab[dflash.draft(feature, recent, g).argmax(-1)]

    with torch.inference_mode():
        ids = torch.randint(0, target.config.vocab_size, (max(batches), CONTEXT), generator=gen)
        target.forward(ids, list(range(max(batches))), cache)  # fill every slot's context once
        cases: dict[tuple[str, int, int], Callable[[], None]] = {}
        for b in batches:
            for g in STEPS:
                cases[("verify", b, g)] = verify(b, g)
                if 1 <= g <= dflash.config.block_size:
                    cases[("eagle", b, g)] = eagle_draft(b, g)
                    cases[("dflash", b, g)] = dflash_draft(b, g)
        times: dict[tuple[str, int, int], list[float]] = {key: [] for key in cases}
        for _ in range(args.repeats + 3):
            for key, run in cases.items():
                t0 = time.perf_counter()
                run()
                times[key].append((time.perf_counter() - t0) * 1000)
    ms = {key: statistics.median(t[3:]) for key, t in times.items()}

    print(f"target {target.config.num_layers} layers, hidden {d}; torch threads {torch.get_num_threads()}; "
          f"context {CONTEXT} tokens; {args.repeats} repeats, medians in ms")
    for part in ("verify", "eagle", "dflash"):
        print(f"\n| {part} | " + " | ".join(f"g={g}" for g in STEPS) + " | line through g=2..6: at g=1 | g=1 measured / line |")
        print("|---" * (len(STEPS) + 3) + "|")
        for b in batches:
            row = [ms.get((part, b, g)) for g in STEPS]
            g_fit = np.arange(2, 7)
            line = np.polyfit(g_fit, [ms[(part, b, g)] for g in g_fit], 1)
            at1 = float(np.polyval(line, 1))
            print(f"| batch {b} | " + " | ".join("—" if v is None else f"{v:.2f}" for v in row)
                  + f" | {at1:.2f} | {ms[(part, b, 1)] / at1:.2f} |")


if __name__ == "__main__":
    main()
