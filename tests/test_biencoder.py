"""The relevance and coverage bi-encoders (METHODS.md §1): anchor text, coverage groups, the InfoNCE loss,
training, encoding, and agreement with sentence-transformers' mean-pooled normalised embeddings."""

import math

import numpy as np
import pytest
import torch

from covlab.models.biencoder import (_batch_loss, _cached_gradient_backward, _embed, _loss, _prepare,
                                     build_coverage_groups, coverage_anchor, coverage_groups_from_pairs, encode,
                                     groups_loss, info_nce, load_biencoder, save_biencoder,
                                     train_coverage_biencoder)
from covlab.models.encoders import collate
from covlab.models.cross_encoder import gold_coverage_pairs
from tiny_bert import one_thread

TINY_TRAINING = {"epochs": 2, "batch_size": 8, "learning_rate": 1e-3, "max_length": 64}


@pytest.fixture(autouse=True)
def single_threaded():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def demo_groups(demo_dataset):
    query_texts = dict(zip(demo_dataset.queries["query_id"], demo_dataset.queries["text"]))
    return coverage_groups_from_pairs(gold_coverage_pairs(demo_dataset, "train"), query_texts,
                                      np.random.default_rng(0))


@pytest.fixture(scope="module")
def trained(tiny_model, demo_groups):
    with one_thread():
        return train_coverage_biencoder(tiny_model, demo_groups, **TINY_TRAINING)


def _state_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_anchor_text():
    assert coverage_anchor("what to know?", ["where to stay", "how to get there"]) == \
        "what to know? [COVERED] where to stay; how to get there"
    assert coverage_anchor("what to know?", []) == "what to know? [COVERED] none"


def _check_groups(groups, covers, subquestions, max_negatives):
    covers_any = covers.any(axis=1)
    coverable = set(np.flatnonzero(covers.any(axis=0)))
    assert () in [g.covered for g in groups]  # the empty state is always simulated
    assert len({g.covered for g in groups}) == len(groups)
    for group in groups:
        state = set(group.covered)
        assert state <= coverable and coverable - state  # something coverable is left uncovered
        uncovered = sorted(set(range(covers.shape[1])) - state)
        assert covers[group.positive, uncovered].any()  # the positive adds coverage
        assert len(group.negatives) <= max_negatives and len(set(group.negatives)) == len(group.negatives)
        assert group.positive not in group.negatives
        redundant_in_group = 0
        for doc in group.negatives:
            assert not covers[doc, uncovered].any()  # redundant (only covered ones) or irrelevant (nothing)
            redundant_in_group += bool(covers_any[doc])
        redundant_exists = any(covers_any[d] and not covers[d, uncovered].any() for d in range(len(covers)))
        assert redundant_in_group >= 1 or not redundant_exists
        assert group.anchor == coverage_anchor(group.query, [subquestions[j] for j in group.covered])


def test_groups_hold_their_definition_on_random_matrices():
    rng = np.random.default_rng(7)
    for _ in range(300):
        n_docs, n_subq = int(rng.integers(1, 25)), int(rng.integers(1, 8))
        covers = rng.random((n_docs, n_subq)) < rng.uniform(0.05, 0.6)
        subquestions = [f"s{j}" for j in range(n_subq)]
        max_negatives = int(rng.integers(1, 9))
        groups = build_coverage_groups("q", subquestions, covers, [f"d{i}" for i in range(n_docs)], rng,
                                       max_negatives=max_negatives, states_per_query=int(rng.integers(1, 6)))
        if not covers.any():
            assert groups == []
            continue
        _check_groups(groups, covers, subquestions, max_negatives)
        for group in groups:
            assert group.positive_text == f"d{group.positive}"
            assert group.negative_texts == tuple(f"d{d}" for d in group.negatives)


def test_a_redundant_negative_is_included_by_hand():
    # doc 0 covers s0, doc 1 covers s0 and s1, doc 2 covers s1, doc 3 covers nothing.
    covers = np.array([[1, 0], [1, 1], [0, 1], [0, 0]], dtype=bool)
    for seed in range(20):
        groups = build_coverage_groups("q", ["s0", "s1"], covers, ["a", "b", "c", "d"],
                                       np.random.default_rng(seed), max_negatives=1, states_per_query=4)
        by_state = {g.covered: g for g in groups}
        assert by_state[()].negatives == (3,)  # nothing covered: only the irrelevant doc is negative
        if (0,) in by_state:  # s0 covered: docs 1 and 2 add s1; doc 0 is the redundant one, always kept
            assert by_state[(0,)].positive in (1, 2) and by_state[(0,)].negatives == (0,)
        if (1,) in by_state:
            assert by_state[(1,)].positive in (0, 1) and by_state[(1,)].negatives == (2,)


def test_groups_of_the_demo_dataset(demo_dataset, demo_groups):
    assert len(demo_groups) >= 8 * 2  # 8 train queries, several states each
    assert all(1 <= len(g.negatives) <= 7 for g in demo_groups)


def test_group_input_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"covers has shape \(2, 2\); expected \(n_docs, n_subq\) = \(3, 2\)"):
        build_coverage_groups("q", ["a", "b"], np.ones((2, 2), bool), ["x", "y", "z"], np.random.default_rng(0))


def test_info_nce_equals_a_hand_computation():
    anchor = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    candidates = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    # temperature 0.5: row 0 logits (2, 0, 1.2) with positive 0; row 1 logits (0, 2, 1.6) with positive 2
    row0 = -2.0 + math.log(math.exp(2.0) + math.exp(0.0) + math.exp(1.2))
    row1 = -1.6 + math.log(math.exp(0.0) + math.exp(2.0) + math.exp(1.6))
    loss = info_nce(anchor, candidates, torch.tensor([0, 2]), 0.5)
    assert loss.item() == pytest.approx((row0 + row1) / 2, rel=1e-6)
    keep = torch.tensor([[True, False, True], [True, True, True]])  # row 0 no longer sees candidate 1
    masked_row0 = -2.0 + math.log(math.exp(2.0) + math.exp(1.2))
    assert info_nce(anchor, candidates, torch.tensor([0, 2]), 0.5, keep).item() == \
        pytest.approx((masked_row0 + row1) / 2, rel=1e-6)


def test_training_lowers_the_loss_on_the_demo_groups(tiny_model, demo_groups, trained):
    base, tokenizer, info = load_biencoder(tiny_model)
    assert info == {}  # an untrained base: the relevance bi-encoder
    before = groups_loss(base, tokenizer, demo_groups, max_length=64)
    model, tokenizer, history = trained
    after = groups_loss(model, tokenizer, demo_groups, max_length=64)
    assert [h["epoch"] for h in history] == [1, 2]
    assert after < 0.9 * before


def test_same_seed_same_weights_other_seed_other_weights(tiny_model, demo_groups, trained):
    epochs_seen = []
    again, _, history = train_coverage_biencoder(tiny_model, demo_groups, **TINY_TRAINING,
                                                 on_epoch=lambda epoch, figures: epochs_seen.append({"epoch": epoch,
                                                                                                     **figures}))
    assert _state_equal(again, trained[0]) and history == trained[2] and epochs_seen == history
    other, _, _ = train_coverage_biencoder(tiny_model, demo_groups, **TINY_TRAINING, seed=1)
    assert not _state_equal(other, trained[0])


def test_activation_checkpointing_trains_the_same_weights(tiny_model, demo_groups, trained):
    # Recomputing each layer in the backward pass (dropout replayed) is a memory setting, not a method change:
    # the same seed gives the same weights and losses, and the returned model is left without checkpointing.
    during = []

    def checkpointing_on(model, tokenizer) -> dict:
        during.append(any(getattr(m, "gradient_checkpointing", False) for m in model.modules()))
        return {}

    checkpointed, _, history = train_coverage_biencoder(tiny_model, demo_groups, **TINY_TRAINING,
                                                        activation_checkpointing=True, after_epoch=checkpointing_on)
    assert during == [True, True]
    assert _state_equal(checkpointed, trained[0]) and history == trained[2]
    assert not any(getattr(m, "gradient_checkpointing", False) for m in checkpointed.modules())


def _gradients(model) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return grads


# Gradients agree to float rounding, which the temperature (0.02: logits x50) magnifies: measured up to 4e-6 apart
GRADIENT_TOLERANCE = {"rtol": 1e-3, "atol": 1e-5}


def _assert_close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, **GRADIENT_TOLERANCE)


@pytest.mark.parametrize("chunk", [1, 5, 100])
def test_gradient_caching_gives_the_whole_batchs_gradient(tiny_model, demo_groups, chunk):
    """Without dropout (eval mode) the cached gradient is the gradient of the InfoNCE over the whole batch, in-batch
    negatives included, up to float rounding: a chunk of one text, a few, and one larger than the batch."""
    model, tokenizer, _ = load_biencoder(tiny_model)
    model.eval()
    groups = demo_groups[:8]
    whole = _batch_loss(model, tokenizer, groups, 0.02, 64, torch.device("cpu"))
    whole.backward()
    expected = _gradients(model)
    loss = _cached_gradient_backward(model, _prepare(tokenizer, groups, 64), 0.02, torch.device("cpu"), None, chunk,
                                     lambda value: value.backward())
    assert loss == pytest.approx(whole.item(), rel=1e-5)
    _assert_close(_gradients(model), expected)


def test_gradient_caching_replays_each_chunks_dropout(tiny_model, demo_groups):
    """In training mode each chunk's second pass draws the dropout masks of its first: the gradient equals that of
    the same chunks embedded once, with gradients, from the same random state (and the state after the step is the
    one the first passes left). Without the replay the masks, and the gradient, would differ."""
    model, tokenizer, _ = load_biencoder(tiny_model)
    model.train()
    cpu = torch.device("cpu")
    batch = _prepare(tokenizer, demo_groups[:8], 64)
    torch.manual_seed(7)
    cached = _cached_gradient_backward(model, batch, 0.02, cpu, None, 6, lambda value: value.backward())
    after_cached, gradient = torch.get_rng_state(), _gradients(model)
    torch.manual_seed(7)
    anchors = [_embed(model, collate(batch.anchors, range(s, min(s + 6, 8)), cpu)) for s in range(0, 8, 6)]
    documents = len(batch.documents.lengths)
    docs = [_embed(model, collate(batch.documents, range(s, min(s + 6, documents)), cpu))
            for s in range(0, documents, 6)]
    reference = _loss(batch, torch.cat(anchors), torch.cat(docs), 0.02, cpu)
    reference.backward()
    assert torch.equal(torch.get_rng_state(), after_cached)
    assert cached == pytest.approx(reference.item(), rel=1e-5)
    _assert_close(gradient, _gradients(model))
    torch.manual_seed(8)  # other masks: another gradient, so the comparison above can fail
    _cached_gradient_backward(model, batch, 0.02, cpu, None, 6, lambda value: value.backward())
    assert not all(torch.allclose(x, y, **GRADIENT_TOLERANCE) for x, y in zip(_gradients(model), gradient))


def test_training_with_gradient_caching_is_seeded_and_lowers_the_loss(tiny_model, demo_groups):
    first, tokenizer, history = train_coverage_biencoder(tiny_model, demo_groups, **TINY_TRAINING,
                                                         gradient_cache_chunk=16)
    again, _, history_again = train_coverage_biencoder(tiny_model, demo_groups, **TINY_TRAINING,
                                                       gradient_cache_chunk=16)
    assert _state_equal(first, again) and history == history_again
    base, _, _ = load_biencoder(tiny_model)
    assert groups_loss(first, tokenizer, demo_groups, max_length=64) < 0.9 * groups_loss(base, tokenizer, demo_groups,
                                                                                         max_length=64)


def test_encode_gives_unit_vectors_in_input_order(trained, demo_dataset):
    model, tokenizer, _ = trained
    texts = list(demo_dataset.corpus["text"][:40])
    vectors = encode(model, tokenizer, texts, batch_size=16, max_length=64)
    assert vectors.shape == (40, model.config.hidden_size)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    permutation = np.random.default_rng(0).permutation(40)
    np.testing.assert_allclose(encode(model, tokenizer, [texts[i] for i in permutation], batch_size=7,
                                      max_length=64, streams=2), vectors[permutation], atol=1e-5)
    assert encode(model, tokenizer, []).shape == (0, model.config.hidden_size)


def test_save_load_round_trip_and_sentence_transformers_agree(trained, demo_dataset, tmp_path):
    from sentence_transformers import SentenceTransformer

    model, tokenizer, history = trained
    texts = list(demo_dataset.corpus["text"][:30])
    saved = save_biencoder(model, tokenizer, tmp_path / "coverage-biencoder", max_length=64, history=history)
    loaded, loaded_tokenizer, info = load_biencoder(saved)
    assert info["kind"] == "biencoder" and info["max_length"] == 64 and info["training"]["history"] == history
    vectors = encode(model, tokenizer, texts, max_length=64)
    np.testing.assert_array_equal(encode(loaded, loaded_tokenizer, texts, max_length=64), vectors)
    reference = SentenceTransformer(str(saved), device="cpu")  # a plain HF directory: mean pooling
    reference.max_seq_length = 64
    np.testing.assert_allclose(reference.encode(texts, normalize_embeddings=True), vectors, atol=1e-5)
