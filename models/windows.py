"""Which part of a long document the coverage estimator reads [chosen detail of METHODS.md §1].

A cross-encoder reads `[CLS] subquestion [SEP] document [SEP]` cut at max_length tokens. Plain truncation
keeps the document's first tokens, so an answer stated further on is never seen: on long chunks (~220
tokens) at max_length 128 most nuggets fall outside. Window selection instead splits a document that
does not fit into overlapping token windows that do fit beside the subquestion, scores every window
against the subquestion with a bi-encoder (mean-pooled, normalised; the packaged MiniLM by default) and
lets the cross-encoder read the best window. The same selection runs on the training pairs and on the
pairs of the estimated matrices, so the estimator is trained on what it later scores.

A pair that fits keeps its document unchanged: datasets of short items (ArgKP, demo) are not affected.

Window size: max_length minus the special tokens minus the subquestion's length rounded up to a multiple
of QUESTION_STEP tokens. The rounding makes the windows of a document depend only on that bucket, not on
the exact subquestion, so subquestions of similar length share one split (each distinct window is
encoded once) and a pair's window does not depend on which other pairs are scored with it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import torch

from covlab.models.encoders import CPU
from covlab.models.runtime import DEFAULT_RUNTIME

QUESTION_STEP = 16  # tokens: the subquestion's share of a pair is rounded up to a multiple of this
WINDOW_MODES = ("first", "bi_encoder")


@dataclass(frozen=True)
class WindowSelection:
    """How a (subquestion, document) pair longer than max_length is cut down.

    mode: `first` keeps the document's first tokens (the tokenizer's truncation); `bi_encoder` keeps the
    window most similar to the subquestion. stride: tokens between the starts of consecutive windows.
    encoder: the bi-encoder that scores windows (path or name; empty: the packaged MiniLM)."""
    mode: Literal["first", "bi_encoder"] = "bi_encoder"
    stride: int = 64
    encoder: str = ""

    def __post_init__(self) -> None:
        if self.mode not in WINDOW_MODES:
            raise ValueError(f"unknown window selection {self.mode!r}; expected one of {WINDOW_MODES}")
        if self.stride < 1:
            raise ValueError(f"window stride must be >= 1 token, got {self.stride}")

    def to_info(self) -> dict:
        """The settings as saved in an estimator's covlab.json."""
        return asdict(self)

    @classmethod
    def from_info(cls, info: dict | None) -> WindowSelection:
        """The settings saved with an estimator; a model saved without them truncated (`first`)."""
        return cls(**info) if info else cls(mode="first")


@dataclass(frozen=True)
class Window:
    """Tokens [start, end) of a document and the text they span."""
    start: int
    end: int
    text: str


def token_windows(text: str, offsets: Sequence[tuple[int, int]], word_starts: np.ndarray,
                  sentence_starts: np.ndarray, size: int, stride: int) -> list[Window]:
    """Overlapping windows of at most `size` tokens over a tokenized `text` (character `offsets` per
    token; `word_starts[i]` / `sentence_starts[i]` true where token i begins a word / a sentence): the
    first from the first token, each next about `stride` tokens on, the last ending with the text.

    Edges move to sentence boundaries where that costs little (a start forward by less than `stride`, an
    end back by at most half the window), else to word starts, so that a window holds whole sentences
    where it can (a stated fact is read whole) and never half a word; each window's text is a substring
    of `text` that tokenizes to its own tokens."""
    n = len(offsets)
    if n <= size:
        return [Window(0, n, text)]
    stride = min(stride, size)
    windows: list[Window] = []
    start = 0
    while True:
        end = min(start + size, n)
        if end < n:
            sentence_end = _snap_back(sentence_starts, start + size // 2, end)
            end = sentence_end if sentence_end is not None else (_snap_back(word_starts, start + 1, end) or end)
        windows.append(Window(start, end, text[offsets[start][0]:offsets[end - 1][1]]))
        if end == n:
            return windows
        # The next start: `stride` on (never beyond this window's end, so no token is skipped), moved
        # forward to a sentence start not past this end, else to a word start (else cut inside a word
        # longer than the window).
        nominal = min(start + stride, end)
        snapped = _snap_forward(sentence_starts, nominal, min(nominal + stride, end + 1))
        word = _snap_forward(word_starts, nominal, end + 1)
        start = snapped if snapped is not None else word if word is not None else nominal


def _snap_forward(starts: np.ndarray, low: int, high: int) -> int | None:
    """The first i in [low, high) with starts[i], or None."""
    hits = np.flatnonzero(starts[low:high])
    return low + int(hits[0]) if hits.size else None


def _snap_back(starts: np.ndarray, low: int, high: int) -> int | None:
    """The last i in [low, high] with starts[i] (an exclusive end at a word or sentence start), or None."""
    hits = np.flatnonzero(starts[low:high + 1])
    return low + int(hits[-1]) if hits.size else None


def boundaries(text: str, offsets: Sequence[tuple[int, int]], word_ids: Sequence[int | None]
               ) -> tuple[np.ndarray, np.ndarray]:
    """(word starts, sentence starts) of a tokenized text: a token starts a word when its word id differs
    from the previous token's, and a sentence when it follows a token that is a full stop, question or
    exclamation mark, or a line break lies before it."""
    n = len(offsets)
    words = np.array([i == 0 or word_ids[i] != word_ids[i - 1] for i in range(n)], dtype=bool)
    sentences = np.zeros(n, dtype=bool)
    if n:
        sentences[0] = True
    for i in range(1, n):
        previous = text[offsets[i - 1][0]:offsets[i - 1][1]]
        sentences[i] = words[i] and (previous in {".", "?", "!"} or "\n" in text[offsets[i - 1][1]:offsets[i][0]])
    return words, sentences


def select_windows(pairs: Sequence[tuple[str, str]], tokenizer, max_length: int, selection: WindowSelection, *,
                   batch_size: int = 64, device: torch.device = CPU, autocast_dtype: torch.dtype | None = None,
                   progress: Callable[[str], None] | None = None, runtime: str = DEFAULT_RUNTIME) -> list[str]:
    """The document text the cross-encoder reads for each (subquestion, document) pair, in input order:
    the document itself when the pair fits `max_length` tokens of `tokenizer` (or the mode is `first`),
    else its best window (module docstring). Every distinct window and subquestion is encoded once, by the
    selection's bi-encoder on `runtime` (models/runtime.py)."""
    texts = [document for _, document in pairs]
    if selection.mode == "first" or not pairs:
        return texts
    documents = list(dict.fromkeys(texts))
    questions = list(dict.fromkeys(question for question, _ in pairs))
    doc_tokens = tokenizer(documents, add_special_tokens=False, return_offsets_mapping=True,
                           return_attention_mask=False, return_token_type_ids=False)
    question_lengths = {q: len(ids) for q, ids in zip(questions, tokenizer(
        questions, add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False)["input_ids"])}
    doc_row = {document: i for i, document in enumerate(documents)}
    special = tokenizer.num_special_tokens_to_add(pair=True)

    # Pairs that do not fit, with the window size their subquestion leaves.
    long_pairs: dict[int, tuple[int, int]] = {}  # pair index -> (document row, window size)
    for i, (question, document) in enumerate(pairs):
        row = doc_row[document]
        if question_lengths[question] + len(doc_tokens["input_ids"][row]) + special > max_length:
            budget = -(-question_lengths[question] // QUESTION_STEP) * QUESTION_STEP
            long_pairs[i] = (row, max(max_length - special - budget, QUESTION_STEP))
    if not long_pairs:
        return texts

    splits: dict[tuple[int, int], list[Window]] = {}
    for row, size in dict.fromkeys(long_pairs.values()):
        offsets = doc_tokens["offset_mapping"][row]
        words, sentences = boundaries(documents[row], offsets, doc_tokens.word_ids(row))
        splits[(row, size)] = token_windows(documents[row], offsets, words, sentences, size, selection.stride)
    window_texts = list(dict.fromkeys(w.text for split in splits.values() for w in split))
    asked = list(dict.fromkeys(pairs[i][0] for i in long_pairs))
    if progress is not None:
        progress(f"windows: {len(long_pairs)} of {len(pairs)} pairs exceed {max_length} tokens; scoring "
                 f"{len(window_texts)} windows of {len(splits)} document splits against {len(asked)} subquestions")
    vectors = _embed_texts(selection.encoder, window_texts + asked, max_length, batch_size=batch_size,
                           device=device, autocast_dtype=autocast_dtype, progress=progress, runtime=runtime)
    window_row = {text: i for i, text in enumerate(window_texts)}
    question_row = {q: len(window_texts) + i for i, q in enumerate(asked)}
    for i, key in long_pairs.items():
        split = splits[key]
        similarity = vectors[[window_row[w.text] for w in split]] @ vectors[question_row[pairs[i][0]]]
        texts[i] = split[int(np.argmax(similarity))].text  # ties: the earliest window
    return texts


def _embed_texts(encoder: str, texts: list[str], max_length: int, *, batch_size: int, device: torch.device,
                 autocast_dtype: torch.dtype | None, progress: Callable[[str], None] | None,
                 runtime: str) -> np.ndarray:
    """Unit vectors of `texts` under the window-scoring bi-encoder."""
    from covlab.models.biencoder import load_first_stage
    from covlab.models.encoders import default_base_model

    return load_first_stage(encoder or default_base_model(), batch_size=batch_size, max_length=max_length,
                            device=device, autocast_dtype=autocast_dtype, progress=progress, runtime=runtime)(texts)
