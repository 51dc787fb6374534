"""Token costs t(d) (METHODS.md §2 "Problem": token costs come from one `count_tokens` interface backed by a
Hugging Face tokenizer). `TokenCounter.count` is that interface; transformers is imported, and the tokenizer
loaded, on the first count, not at import or construction time."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

from covlab.models.lru import BoundedLRU

# What one cached count holds besides its text's own bytes (sys.getsizeof): the ordered dict's entry and the int.
CACHE_ENTRY_BYTES = 120


class TokenCounter:
    """Counts the tokens of texts with a Hugging Face fast tokenizer (default: the packaged all-MiniLM-L6-v2,
    `covlab.models.encoders.default_base_model()`).

    - a count is the number of tokens the tokenizer gives the text without special tokens ([CLS], [SEP]) and
      without truncation: a text longer than the model's maximum length is counted in full;
    - an empty text counts 0; any other text counts at least 1, including one the tokenizer reduces to nothing
      (only whitespace or zero-width characters), because it still takes a place in the context. A `Pool` needs
      positive costs, so empty texts are to be dropped before one is built;
    - counts are cached per distinct text: a text is tokenized once per counter, however often it is counted;
      with `max_cached_bytes` the cache holds at most that many bytes of texts and counts (`cached_bytes`: each
      text's size in memory and CACHE_ENTRY_BYTES), the least recently counted dropped first, so that a
      long-lived server's memory does not grow with the texts it has seen, however long they are.
    """

    def __init__(self, tokenizer_name_or_path: str = "", max_cached_bytes: int | None = None):
        self.tokenizer_name_or_path = tokenizer_name_or_path
        self.max_cached_bytes = max_cached_bytes
        self._tokenizer = None
        self._counts: BoundedLRU[str, int] = BoundedLRU(max_cached_bytes)

    @property
    def cached_bytes(self) -> int:
        return self._counts.nbytes

    @property
    def tokenizer(self):
        """The fast tokenizer, loaded on first use."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            from covlab.models.encoders import default_base_model

            name = self.tokenizer_name_or_path or default_base_model()
            tokenizer = AutoTokenizer.from_pretrained(name)
            if not tokenizer.is_fast:
                raise ValueError(f"TokenCounter needs a fast (Rust) tokenizer; {name!r} only has a slow one")
            self._tokenizer = tokenizer
        return self._tokenizer

    def count(self, texts: Sequence[str]) -> np.ndarray:
        """Token counts (int64), one per text, in the order of `texts`."""
        if isinstance(texts, str):
            raise TypeError("count takes a sequence of texts, not a single str")
        texts = list(texts)
        for position, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"count takes texts (str); the item at position {position} is a "
                                f"{type(text).__name__}")
        distinct = list(dict.fromkeys(texts))
        counts = {text: count for text in distinct if (count := self._counts.get(text)) is not None}
        unseen = [text for text in distinct if text not in counts]
        if unseen:
            # One batched call over the distinct uncached texts. verbose=False silences the "sequence length
            # is longer than the specified maximum" warning: these ids only get counted, never fed to a model.
            ids = self.tokenizer(unseen, add_special_tokens=False, truncation=False, verbose=False,
                                 return_attention_mask=False, return_token_type_ids=False)["input_ids"]
            for text, row in zip(unseen, ids, strict=True):
                counts[text] = max(len(row), 1) if text else 0
        self._remember(distinct, counts)
        return np.fromiter((counts[text] for text in texts), dtype=np.int64, count=len(texts))

    def _remember(self, distinct: list[str], counts: dict[str, int]) -> None:
        """The call's counts cached as the most recent, then the least recent dropped while the cache is over
        `max_cached_bytes` (this call's too, when they alone are over it)."""
        for text in distinct:
            self._counts.put(text, counts[text], sys.getsizeof(text) + CACHE_ENTRY_BYTES)
