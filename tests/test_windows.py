"""Window selection for long documents (models/windows.py): windows cover the document and fit beside the
subquestion, the answer-bearing window is the one kept, and pairs that fit (demo, ArgKP) are unchanged."""

import numpy as np
import pytest
from transformers import AutoTokenizer

from conftest import shared_dataset
from covlab.models import windows
from covlab.models.cross_encoder import gold_coverage_pairs
from covlab.models.encoders import default_base_model
from covlab.models.windows import WindowSelection, boundaries, select_windows, token_windows
from covlab.orchestration.definitions import DEMO_CONFIG
from covlab.resources.datasets import read_dataset

FILLER = ["The harbour of Lumen was rebuilt after the great storm of the northern coast.",
          "Fishermen there still mend their nets on the long stone pier every morning.",
          "The town hall keeps a painted map of the old streets near the market square.",
          "Children learn the songs of the sea long before they are able to read them.",
          "Merchants from the south trade wool and olive oil for dried fish and salt.",
          "In winter the wind from the mountains makes the narrow lanes very cold.",
          "A small chapel stands at the edge of the cliff facing the western islands.",
          "Travellers describe the town as quiet except on the evenings of the feast."]
ANSWER = "The lighthouse keeper of Lumen is paid in copper coins minted at the river fortress of Vell."
QUESTION = "How is the lighthouse keeper of Lumen paid?"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_base_model())


def _tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_windows_cover_the_document_overlap_by_the_stride_and_cut_at_word_starts(tokenizer):
    text = " ".join(FILLER * 2)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    words, sentences = boundaries(text, encoded["offset_mapping"], encoded.word_ids())
    assert sentences.sum() == len(FILLER) * 2  # every sentence start, and nothing else
    split = token_windows(text, encoded["offset_mapping"], words, sentences, size=40, stride=16)
    assert split[0].start == 0 and split[-1].end == len(words)
    assert all(w.end - w.start <= 40 and words[w.start] for w in split)
    assert all(a.start < b.start <= a.end for a, b in zip(split, split[1:]))  # no gaps
    assert np.mean([sentences[w.start] for w in split]) > 0.5  # mostly whole sentences
    for w in split:  # each window's text is a substring that tokenizes to exactly its own tokens
        assert w.text in text
        assert tokenizer(w.text, add_special_tokens=False)["input_ids"] == encoded["input_ids"][w.start:w.end]
    one = np.array([True, True])
    assert token_windows("short text", [(0, 5), (6, 10)], one, one, 40, 16)[0].text == "short text"


@pytest.mark.parametrize("position", [1, 9, 15])
def test_the_answer_bearing_window_is_kept_and_the_pair_fits(tokenizer, position):
    sentences = FILLER * 2
    document = " ".join(sentences[:position] + [ANSWER] + sentences[position:])
    assert _tokens(tokenizer, QUESTION) + _tokens(tokenizer, document) + 3 > 128
    other = "When does the market of Lumen open?"
    texts = select_windows([(QUESTION, document), (other, document)], tokenizer, 128, WindowSelection(stride=32))
    assert ANSWER in texts[0] and texts[0] in document
    assert _tokens(tokenizer, QUESTION) + _tokens(tokenizer, texts[0]) + 3 <= 128
    if position > 8:  # plain truncation keeps the first ~100 tokens, which miss an answer placed later
        first = tokenizer.decode(tokenizer(QUESTION, document, truncation=True, max_length=128)["input_ids"])
        assert "copper" not in first
    assert select_windows([(QUESTION, document)], tokenizer, 128, WindowSelection(mode="first")) == [document]


def test_every_selected_window_fits_beside_its_subquestion(tokenizer):
    document = " ".join(FILLER * 3)
    questions = ["Why?", QUESTION, " ".join(["What about the long question"] * 6) + "?"]
    texts = select_windows([(q, document) for q in questions], tokenizer, 96, WindowSelection(stride=24))
    for question, text in zip(questions, texts):
        assert text != document and text in document
        assert _tokens(tokenizer, question) + _tokens(tokenizer, text) + 3 <= 96


def _unchanged(pairs, tokenizer, max_length, monkeypatch) -> None:
    def no_encoder(*args, **kwargs):
        raise AssertionError("a pair that fits must not need window scoring")

    monkeypatch.setattr(windows, "_embed_texts", no_encoder)
    pairs = list(zip(pairs["subquestion"], pairs["text"]))
    assert select_windows(pairs, tokenizer, max_length, WindowSelection()) == [t for _, t in pairs]


def test_demo_pairs_fit_at_the_demo_length_and_stay_unchanged(demo_dataset, tokenizer, monkeypatch):
    max_length = DEMO_CONFIG["ops"]["coverage_estimator"]["config"]["max_length"]
    for split in ("train", "dev", "test"):
        _unchanged(gold_coverage_pairs(demo_dataset, split), tokenizer, max_length, monkeypatch)


def test_argkp_pairs_fit_at_the_default_length_and_stay_unchanged(tokenizer, monkeypatch):
    dataset = read_dataset("argkp", "argkp2021", str(shared_dataset("argkp2021")))
    _unchanged(gold_coverage_pairs(dataset, "dev"), tokenizer, 256, monkeypatch)


def test_window_settings_are_checked_and_round_trip():
    assert WindowSelection.from_info(WindowSelection(stride=32).to_info()) == WindowSelection(stride=32)
    assert WindowSelection.from_info(None).mode == "first"  # models saved before windows truncated
    with pytest.raises(ValueError, match="unknown window selection 'middle'"):
        WindowSelection(mode="middle")
    with pytest.raises(ValueError, match="stride must be >= 1"):
        WindowSelection(stride=0)
