"""Token counting (models/tokens.py, METHODS.md §2 "Problem"): counts worked out by hand with the packaged
MiniLM tokenizer, long texts counted in full without the length warning, one tokenization per distinct text,
order preserved, and the refusals."""

import logging

import numpy as np
import pytest
import transformers

from covlab.models.tokens import TokenCounter


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter()


def test_counts_by_hand(counter):
    # WordPiece of the uncased MiniLM vocabulary, no [CLS]/[SEP]; accents are stripped before lookup.
    by_hand = {
        "hello world": ["hello", "world"],
        "Coverage-aware selection.": ["coverage", "-", "aware", "selection", "."],
        "unbelievably tokenizable": ["un", "##bel", "##ie", "##va", "##bly", "token", "##iza", "##ble"],
        "ünïcödé naïve café": ["unicode", "naive", "cafe"],
    }
    for text, tokens in by_hand.items():
        assert counter.tokenizer.tokenize(text) == tokens
    counts = counter.count(list(by_hand))
    assert counts.dtype == np.int64
    assert counts.tolist() == [2, 5, 8, 3]


def test_empty_text_counts_zero_and_whitespace_at_least_one(counter):
    # "   " and a zero-width space tokenize to nothing, yet are non-empty texts: 1 each.
    assert counter.tokenizer.tokenize("   ") == [] and counter.tokenizer.tokenize("\u200b") == []
    assert counter.count(["", "   ", "\u200b", "a"]).tolist() == [0, 1, 1, 1]
    assert counter.count([]).tolist() == []


def test_long_text_is_counted_in_full_without_the_length_warning(counter, caplog):
    text = " ".join(["hello"] * 1000 + ["coverage-aware"] * 333 + ["x"])  # 1000 + 3 * 333 + 1 = 2,000 tokens
    transformers.utils.logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            assert counter.count([text]).tolist() == [2000]
    finally:
        transformers.utils.logging.disable_propagation()
    assert counter.tokenizer.model_max_length == 512
    assert not [r for r in caplog.records if "longer than the specified maximum" in r.getMessage()]


class CountingTokenizer:
    """The real tokenizer, recording the texts of every call."""
    is_fast = True

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls: list[list[str]] = []

    def __call__(self, texts, **options):
        self.calls.append(list(texts))
        return self.tokenizer(texts, **options)


def test_each_distinct_text_is_tokenized_once(counter, monkeypatch):
    wrapper = CountingTokenizer(counter.tokenizer)
    loads = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda name: loads.append(name) or wrapper)
    fresh = TokenCounter()
    assert loads == []  # nothing is loaded before the first count
    assert fresh.count(["hello world", "a", "hello world", "a", "hello world"]).tolist() == [2, 1, 2, 1, 2]
    assert wrapper.calls == [["hello world", "a"]]
    assert fresh.count(["a", "Coverage-aware selection.", "hello world"]).tolist() == [1, 5, 2]
    assert wrapper.calls == [["hello world", "a"], ["Coverage-aware selection."]]
    assert fresh.count(["hello world", "a"]).tolist() == [2, 1]
    assert len(wrapper.calls) == 2 and len(loads) == 1


def test_order_is_preserved(counter):
    texts = ["one two three four", "one", "one two three", "one two", ""]
    assert counter.count(texts).tolist() == [4, 1, 3, 2, 0]
    assert counter.count(texts[::-1]).tolist() == [0, 2, 3, 1, 4]
    assert counter.count(("one two", "one", "one two")).tolist() == [2, 1, 2]


def test_refusals(counter):
    with pytest.raises(TypeError, match="position 2"):
        counter.count(["a", "b", None])
    with pytest.raises(TypeError, match="position 0"):
        counter.count([b"bytes"])
    with pytest.raises(TypeError, match="single str"):
        counter.count("hello world")


class FastTokenizer:
    """A stand-in fast tokenizer: one token per whitespace-separated word (the cache, not the counts, is tested)."""
    is_fast = True

    def __init__(self):
        self.calls: list[list[str]] = []

    def __call__(self, texts, **options):
        self.calls.append(list(texts))
        return {"input_ids": [text.split() for text in texts]}


def test_the_cache_is_bounded_by_bytes_and_evicts_the_least_recently_used():
    bounded = TokenCounter(max_cached_bytes=10_000)
    bounded._tokenizer = tokenizer = FastTokenizer()
    short = [f"text {i}" for i in range(10)]
    assert bounded.count(short).tolist() == [2] * 10 and bounded.cached_bytes <= 10_000
    long = ["word " * 1_000 + str(i) for i in range(4)]  # ~5 KB each: two at most fit with the short ones
    assert bounded.count(long[:1]).tolist() == [1_001]
    assert bounded.count(short[:5]).tolist() == [2] * 5  # used again: the most recent
    assert bounded.count(long[1:2]).tolist() == [1_001] and bounded.cached_bytes <= 10_000
    tokenizer.calls.clear()
    assert bounded.count(short[:5] + long[1:2]).tolist() == [2] * 5 + [1_001] and tokenizer.calls == []
    assert bounded.count(long[:1]).tolist() == [1_001] and tokenizer.calls == [long[:1]]  # evicted: counted again
    assert bounded.count(long).tolist() == [1_001] * 4 and bounded.cached_bytes <= 10_000  # one call over the bound
    assert bounded.count(short[5:]).tolist() == [2] * 5 and bounded.cached_bytes <= 10_000


def test_many_distinct_long_texts_do_not_grow_a_bounded_cache_s_memory():
    import tracemalloc

    bounded = TokenCounter(max_cached_bytes=2**20)
    bounded._tokenizer = FastTokenizer()
    batches = [[f"request {r} text {i} " + "long words " * 1_000 for i in range(20)] for r in range(60)]  # 13 MB
    tracemalloc.start()
    try:
        bounded.count(batches[0])
        baseline = tracemalloc.get_traced_memory()[0]
        for batch in batches[1:]:
            bounded.count(batch)
        grown = tracemalloc.get_traced_memory()[0] - baseline
    finally:
        tracemalloc.stop()
    assert bounded.cached_bytes <= 2**20 and grown < 2**20, grown
