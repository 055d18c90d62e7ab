"""Build the shipped request sets from the Python standard library's own source (no downloads).

    python workloads/build.py        # rewrites workloads/{code,quote,random,phase}.jsonl

Deterministic for a given Python version (the stdlib text is the input; the committed files were made
with CPython 3.11.7). Prompts are 150-600 characters (~40-150 tokens of a 2k-vocab BPE).
- code:   the head of a stdlib function; the model continues it (drafts help moderately)
- quote:  "repeat this text", then the text, then its first part again: copying pays (drafts help most)
- random: seeded random words; nothing to copy or predict (drafts help least)
- phase:  quote/code phases alternating with random ones, arriving in bursts of 1, 4 and 16 so both
          acceptance and the number of concurrent requests shift over time (replay with Trace)
- heldout: the phase set's kinds in another order, Poisson arrivals (POISSON_SETS)
- shift:  long quote and random phases at a high and a low request rate (POISSON_SETS): where the step policy matters
- swing:  closed-loop phases of copying and of random words, 24 requests each (CLOSED_SETS): the best g swings with
          the phase at every batch size, so a static g loses in one phase or the other
"""

from __future__ import annotations

import ast
import json
import random
import re
import sysconfig
import textwrap
from pathlib import Path

SEED = 20240601
MAX_TOKENS = 64
SET_SIZE = 128
MIN_CHARS, MAX_CHARS = 150, 600
OUT_DIR = Path(__file__).resolve().parent
STDLIB = Path(sysconfig.get_paths()["stdlib"])
MODULES = (
    "argparse", "base64", "bisect", "calendar", "colorsys", "configparser", "csv", "dataclasses", "difflib",
    "fnmatch", "fractions", "ftplib", "glob", "gzip", "heapq", "ipaddress", "json/decoder", "json/encoder",
    "mimetypes", "ntpath", "optparse", "pathlib", "pickle", "posixpath", "pprint", "quopri", "random", "shlex",
    "shutil", "smtplib", "statistics", "string", "tarfile", "textwrap", "tokenize", "traceback", "typing",
    "urllib/parse", "uuid", "wave", "zipfile", "collections/__init__", "datetime", "email/message", "enum",
    "functools", "http/client", "inspect", "logging/__init__", "os", "socket", "subprocess", "threading",
    "unittest/case", "asyncio/events", "xml/dom/minidom",
)
# Phases of the mixed set: (kind, burst size); each phase is BURSTS_PER_PHASE bursts, BURST_GAP_S apart.
PHASES = (("quote", 1), ("random", 1), ("code", 4), ("random", 4), ("quote", 16), ("random", 16), ("code", 4), ("random", 1))
BURSTS_PER_PHASE = 4
BURST_GAP_S = 0.5
# Open-loop sets with Poisson arrivals: (kind, requests, arrivals per s, max_tokens) per phase.
POISSON_SETS = {
    # The phase set's kinds in another order and arrival process: traffic the replay is checked on, never fitted on.
    "heldout": (("random", 12, 4.0, 48), ("code", 24, 12.0, 48), ("quote", 32, 24.0, 48), ("random", 24, 16.0, 48),
                ("quote", 12, 3.0, 48), ("code", 16, 8.0, 48)),
    # Where the step policy matters: long phases of random words at a high request rate (batches of 8-16, where n-gram
    # drafts cost more to verify than they bring) and of copying at a moderate rate (batches of 1-8, drafts nearly
    # all accepted), so the best g moves with the phase and the batch size, and a policy has time to follow it.
    "shift": (("random", 80, 40.0, 48), ("quote", 64, 8.0, 48), ("random", 80, 40.0, 48), ("quote", 64, 8.0, 48)),
}
# Closed-loop sets (no arrival times: the load generator keeps N requests in flight): (kind, requests) per phase.
CLOSED_SETS = {
    # Phases long next to a batch of 16 (a batch mixes two kinds only at a phase's edge), short enough that a cell at
    # batch 1 stays under 20 s: copying (every draft of 7 accepted 84% of the time with the EAGLE head) and random words
    # (a third draft accepted 24% of the time), so the best g is high in one phase and low in the next.
    "swing": (("quote", 24), ("random", 24), ("quote", 24), ("random", 24)),
}


def module_trees() -> list[tuple[str, ast.Module, str]]:
    out = []
    for name in MODULES:
        source = (STDLIB / f"{name}.py").read_text(encoding="utf-8")
        out.append((name, ast.parse(source), source))
    return out


def code_prompts(trees, rng: random.Random) -> list[str]:
    """The first lines of each function, cut at a line end once past a random length (200-450 chars)."""
    prompts = []
    for _, tree, source in trees:
        source_lines = source.splitlines()  # ast.get_source_segment re-splits per call: too slow here
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef):
                continue
            lines = textwrap.dedent("\n".join(source_lines[node.lineno - 1 : node.end_lineno])).splitlines()
            target, head = rng.randint(200, 450), ""
            for line in lines[:-1]:  # leave at least one line to continue
                if len(head) >= target or len(head) + len(line) + 1 > MAX_CHARS:
                    break
                head += line + "\n"
            if len(head) >= MIN_CHARS:
                prompts.append(head)
    return prompts


def passages(trees) -> list[str]:
    """First paragraphs of docstrings, whitespace folded, 90-250 characters."""
    out = []
    for _, tree, _ in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    text = " ".join(doc.split("\n\n")[0].split())
                    if 90 <= len(text) <= 250:
                        out.append(text)
    return sorted(set(out))


def quote_prompt(text: str) -> str:
    cut = text.rfind(" ", 0, len(text) // 2)
    return f"Repeat the following text exactly:\n{text}\n\n{text[:cut]}"


def random_prompt(rng: random.Random, vocab: list[str]) -> str:
    target = rng.randint(MIN_CHARS + 20, 400)
    words = []
    while sum(len(w) + 1 for w in words) < target:
        words.append(rng.choice(vocab))
    return "Continue this list of words: " + " ".join(words)


def build() -> dict[str, list[dict]]:
    rng = random.Random(SEED)
    trees = module_trees()
    code = sorted(set(code_prompts(trees, rng)))
    texts = passages(trees)
    quotes = [quote_prompt(t) for t in texts]
    vocab = sorted({w.lower() for p in texts for w in re.findall(r"\b[A-Za-z]{3,10}\b", p)})
    rng.shuffle(code)
    rng.shuffle(quotes)
    randoms = [random_prompt(rng, vocab) for _ in range(SET_SIZE * 2)]
    pools = {"code": code, "quote": quotes, "random": randoms}
    sets = {kind: [{"prompt": p, "max_tokens": MAX_TOKENS, "tag": kind} for p in pool[:SET_SIZE]] for kind, pool in pools.items()}
    # The mixed set draws from what the single-kind sets did not use.
    next_item = {kind: SET_SIZE for kind in pools}
    phase, t = [], 0.0
    for kind, burst in PHASES:
        for _ in range(BURSTS_PER_PHASE):
            for _ in range(burst):
                prompt = next_prompt(pools, next_item, kind)
                phase.append({"prompt": prompt, "max_tokens": MAX_TOKENS, "arrival_s": round(t, 3), "tag": kind})
            t += BURST_GAP_S
    sets["phase"] = phase
    for name, phases in POISSON_SETS.items():  # after the phase set, so its prompts stay what they were
        sets[name] = poisson_set(pools, next_item, phases, random.Random(f"{SEED}-{name}"))
    for name, phases in CLOSED_SETS.items():  # after those, likewise
        sets[name] = [{"prompt": next_prompt(pools, next_item, kind), "max_tokens": MAX_TOKENS, "tag": kind}
                      for kind, count in phases for _ in range(count)]
    return sets


def next_prompt(pools: dict[str, list[str]], next_item: dict[str, int], kind: str) -> str:
    """The next unused prompt of `kind` (the pools wrap around)."""
    prompt = pools[kind][next_item[kind] % len(pools[kind])]
    next_item[kind] += 1
    return prompt


def poisson_set(pools: dict[str, list[str]], next_item: dict[str, int], phases, rng: random.Random) -> list[dict]:
    """Phases of (kind, requests, rate per s, max_tokens): each request of a phase arrives after an exponential gap at
    that phase's rate (seeded), drawing the next unused prompt of its kind."""
    rows, t = [], 0.0
    for kind, count, rate, max_tokens in phases:
        for _ in range(count):
            prompt = next_prompt(pools, next_item, kind)
            rows.append({"prompt": prompt, "max_tokens": max_tokens, "arrival_s": round(t, 3), "tag": kind})
            t += rng.expovariate(rate)
    return rows


def main() -> None:
    for name, rows in build().items():
        for row in rows:
            assert MIN_CHARS <= len(row["prompt"]) <= MAX_CHARS, (name, len(row["prompt"]))
        with (OUT_DIR / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(f"{name}: {len(rows)} requests")


if __name__ == "__main__":
    main()
