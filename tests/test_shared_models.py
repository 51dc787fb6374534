"""What a serving process shares and remembers (serving/shared.py, models/lru.py): one loaded copy of a model for
every selector that reads it, each (subquestion, passage) pair scored and each text encoded once while it is
remembered, values returned exactly as first computed, and the memory of them bounded in bytes."""

import gc
from pathlib import Path

import numpy as np
import pytest

from covlab.models.lru import BoundedLRU
from covlab.models.registry import Role, SelectorSettings, TrainedSelector, method
from covlab.models.replay import RecordedDecisions
from covlab.models.selectors import Budget
from covlab.models.tokens import TokenCounter
from covlab.serving.selector import ContextSelector
from covlab.serving.shared import CachedPairs, CachedTexts, VersionFiles, served_models, shared_encoder, text_digest

from fixed_encoder import FixedEncoder


def test_the_least_recently_used_entries_are_dropped_once_over_the_bound():
    cache = BoundedLRU(max_bytes=30)
    for key in "abc":
        cache.put(key, key.upper(), 10)
    assert cache.get("a") == "A"  # now the most recently used: b is the oldest
    cache.put("d", "D", 10)
    assert "b" not in cache and {"a", "c", "d"} == {k for k in "abcd" if k in cache}
    assert cache.nbytes == 30 and len(cache) == 3
    cache.put("big", "X", 31)  # alone over the bound: dropped with everything before it
    assert len(cache) == 0 and cache.nbytes == 0
    with pytest.raises(ValueError, match="max_bytes"):
        BoundedLRU(-1)


def test_a_digest_keeps_texts_apart_however_they_are_split():
    assert text_digest("ab", "c") != text_digest("a", "bc")
    assert text_digest("ab", "c") == text_digest("ab", "c") and len(text_digest("x")) == 16


class Counting:
    """A scorer or encoder that records every item it is asked to compute; its values depend on the batch (the
    first item's length), as a padded batch's may, so that a value computed again would show."""

    def __init__(self, width: int | None = None):
        self.asked, self.width = [], width

    def __call__(self, items):
        self.asked += items
        offset = len(str(items[0])) * 1e-9
        if self.width is None:
            return np.array([1 / (1 + len(a) + len(b)) + offset for a, b in items])  # a probability
        return np.array([[len(t) + offset] + [0.0] * (self.width - 1) for t in items])


def test_each_pair_is_scored_once_and_answered_as_first_scored_in_request_order():
    scorer = Counting()
    pairs = CachedPairs(scorer)
    first = pairs([("q1", "alpha"), ("q2", "beta"), ("q1", "alpha")])
    assert scorer.asked == [("q1", "alpha"), ("q2", "beta")]  # a repeat within one call is scored once too
    assert first[0] == first[2]
    again = pairs([("q3", "gamma gamma"), ("q2", "beta"), ("q1", "alpha")])
    assert scorer.asked[2:] == [("q3", "gamma gamma")]
    assert again[1] == first[1] and again[2] == first[0]  # the remembered values, not recomputed ones


def test_text_embeddings_are_remembered_within_their_bound_in_bytes():
    encoder = Counting(width=4)
    texts = CachedTexts(encoder, max_bytes=3 * (120 + 4 * 8))  # three rows of four float64 and their entries
    rows = texts(["a", "bb", "ccc"])
    assert rows.shape == (3, 4) and encoder.asked == ["a", "bb", "ccc"]
    assert np.array_equal(texts(["ccc", "a"]), rows[[2, 0]]) and len(encoder.asked) == 3
    texts(["dddd"])  # over the bound: "bb", the least recently used, is dropped
    texts(["bb"])
    assert encoder.asked[3:] == ["dddd", "bb"]
    assert texts([]).shape == (0, 0)


def test_selectors_share_one_loaded_estimator_per_version_while_one_holds_it(tmp_path):
    loads = []

    def load(path: Path, device: str):
        loads.append(path)
        return Counting()

    estimator = TrainedSelector("scratch_estimator", "a scorer for this test", Role.COVERAGE_ESTIMATOR, load)
    version = VersionFiles(tmp_path / "v1", "hash-of-v1")
    first = served_models({estimator: version})
    # the same version's files verified in another folder (a pyfunc's copy made by MLflow) share its copy
    second = served_models({estimator: VersionFiles(tmp_path / "pyfunc-copy", "hash-of-v1")})
    assert first[Role.COVERAGE_ESTIMATOR] is second[Role.COVERAGE_ESTIMATOR] and loads == [version.path]
    other = VersionFiles(tmp_path / "v2", "hash-of-v2")
    assert served_models({estimator: other})[Role.COVERAGE_ESTIMATOR] is not first[Role.COVERAGE_ESTIMATOR]
    del first, second
    gc.collect()  # no selector holds v1 any more: its copy and what it remembered are freed
    served_models({estimator: version})
    assert loads == [version.path, other.path, version.path]
    assert shared_encoder("some-model") is shared_encoder("some-model")
    assert shared_encoder("some-model") is not shared_encoder("some-model", max_length=128)


def test_a_coverage_request_at_several_budgets_scores_its_pairs_once():
    scorer = Counting()
    estimator = TrainedSelector("scratch_estimator", "a scorer for this test", Role.COVERAGE_ESTIMATOR,
                                lambda path, device: scorer)
    selector = ContextSelector(method("coverage_greedy"), SelectorSettings(), FixedEncoder(),
                               TokenCounter(),
                               models=served_models({estimator: VersionFiles(Path("scratch"), "scratch")}),
                               decisions=RecordedDecisions({}))
    candidates = [{"id": f"d{i}", "text": f"passage {i} about the old town and its {i} bridges"} for i in range(12)]
    subquestions = ["Which bridges?", "How old is the town?"]
    answers = [selector.select("What is there in the old town?", candidates, budget, subquestions=subquestions)
               for budget in (Budget(k=3), Budget(k=5), Budget(tokens=40))]
    assert len(scorer.asked) == len(candidates) * len(subquestions)
    assert all(answer.ids for answer in answers)
