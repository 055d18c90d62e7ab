"""Tokens per streamed chunk (spectune.tokens), counted once a request has ended, from the best source a server
sends, the served model's tokenizer, or not at all (and then said so)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

import spectune
from spectune.errors import SpectuneError
from spectune.tokens import count_tokens, load_tokenizer, spread_counts, tokenizer_path

TOKENIZER = Tokenizer.from_file(str(Path(spectune.__file__).parent / "engine" / "assets" / "target" / "tokenizer.json"))


def chunk(text: str, **extra) -> dict:
    return {"choices": [{"index": 0, "text": text, **extra.pop("choice", {})}], **extra}


def stream(*chunks: dict, total: int | None = None) -> list[tuple[int, dict]]:
    items = [chunk("")] + list(chunks)  # a role-only first chunk, as servers send
    if total is not None:
        items.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": total}})
    return [(1000 * i, c) for i, c in enumerate(items)]


def test_server_counts_win_and_each_source_is_named():
    usage = stream(chunk("ab", usage={"completion_tokens": 2}), chunk("c", usage={"completion_tokens": 5}), total=5)
    counted = count_tokens(usage, TOKENIZER)
    assert (counted.chunk_tokens, counted.source, counted.output_tokens, counted.prompt_tokens) == ([2, 3], "usage", 5, 5)
    assert counted.chunk_ns == [1000, 2000] and counted.text == "abc"
    timings = stream(chunk("ab", timings={"predicted_n": 3}), chunk("c", timings={"predicted_n": 4}))
    assert (count_tokens(timings).chunk_tokens, count_tokens(timings).source) == ([3, 1], "timings")
    ids = stream(chunk("ab", choice={"token_ids": [1, 2]}), chunk("c", choice={"token_ids": [3]}), total=3)
    assert (count_tokens(ids).chunk_tokens, count_tokens(ids).source) == ([2, 1], "token_ids")


def test_the_tokenizer_counts_a_token_split_over_two_chunks_once_where_it_ends():
    # "The quick" is The | Ġ | qui | ck with this tokenizer: "qui" starts in the first chunk and ends in the second
    counted = count_tokens(stream(chunk("The qu"), chunk("ick"), total=4), TOKENIZER)
    assert (counted.chunk_tokens, counted.source) == ([2, 2], "tokenizer")


def test_without_counts_or_tokenizer_only_a_confirming_total_makes_one_per_chunk_exact():
    assert count_tokens(stream(chunk("a"), chunk("b"), total=2)).source == "text"
    unknown = count_tokens(stream(chunk("ab"), chunk("cd"), total=5))
    assert (unknown.source, unknown.chunk_tokens, unknown.output_tokens) == ("unknown", [1, 1], 5)
    assert count_tokens(stream(chunk("ab"), chunk("cd"))).source == "unknown"  # no total at all
    assert count_tokens(stream()).source == ""  # nothing streamed


def test_spread_keeps_the_sum_to_the_total_in_proportion_and_never_below_one():
    assert spread_counts([2, 3, 1, 4, 1], 12) == [2, 3, 1, 5, 1]
    assert spread_counts([2, 3, 1, 4, 1], 9) == [2, 2, 1, 3, 1]
    assert spread_counts([3, 3], 8) == [4, 4]
    assert spread_counts([2, 3, 1, 4, 1], 4) is None  # fewer tokens than chunks: cannot be
    counted = count_tokens(stream(chunk("The qu"), chunk("ick"), total=6), TOKENIZER)
    assert (counted.chunk_tokens, counted.source) == ([3, 3], "tokenizer+spread")
    too_few = count_tokens(stream(chunk("The qu"), chunk("ick"), total=1), TOKENIZER)
    assert (too_few.chunk_tokens, too_few.source) == ([2, 2], "tokenizer")  # left as counted: a mismatch to flag


def test_the_served_models_tokenizer_is_found_or_none(tmp_path):
    shipped = Path(spectune.__file__).parent / "engine" / "assets" / "target"
    assert tokenizer_path(None, None, "embedded") == shipped
    assert tokenizer_path(str(shipped), None, "vllm") == shipped
    assert tokenizer_path("meta-llama/Llama-3.1-8B", None, "vllm") is None  # a hub name: nothing local
    assert tokenizer_path("meta-llama/Llama-3.1-8B", str(tmp_path / "t.json"), "openai") == tmp_path / "t.json"
    assert load_tokenizer(shipped, "here").get_vocab_size() == TOKENIZER.get_vocab_size()
    with pytest.raises(SpectuneError, match="server 'x': tokenizer: cannot read a tokenizer at .*missing"):
        load_tokenizer(tmp_path / "missing", "server 'x': tokenizer")
