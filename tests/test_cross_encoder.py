"""The coverage estimator (METHODS.md §1): training determinism, early stopping and the dev figures it
keeps, that it learns the demo facts and ArgKP key-point matching, score_pairs' ordering and batching,
save/load, agreement with sentence-transformers' CrossEncoder, progress messages, window selection saved
with the model, and the pruned estimated matrix."""

import os
import re
import time

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.metrics import roc_auc_score

from conftest import shared_dataset
from covlab.models.cross_encoder import (gold_coverage_pairs, load_cross_encoder, save_cross_encoder, score_pairs,
                                         train_cross_encoder)
from covlab.models.biencoder import cosines, load_biencoder, load_first_stage
from covlab.models.coverage import (document_texts, estimate_coverage, estimate_coverage_pruned,
                                    load_estimator_scorer, pool_pairs)
from covlab.models.encoders import Progress, default_base_model, shuffled_length_batches
from covlab.models.metrics import brier_score, expected_calibration_error
from covlab.models.subquestions import gold_subquestions
from covlab.models.windows import WindowSelection, select_windows
from covlab.resources.datasets import read_dataset
from tiny_bert import one_thread

TINY_TRAINING = {"max_length": 64, "epochs": 2, "batch_size": 16, "learning_rate": 1e-4, "patience": 2}


@pytest.fixture(autouse=True)
def single_threaded(request):
    """Tiny-model tests on one thread; the MiniLM tests (marked slow) keep torch's thread count."""
    if request.node.get_closest_marker("slow"):
        yield
    else:
        with one_thread():
            yield


@pytest.fixture(scope="module")
def demo_pairs(demo_dataset) -> tuple[pd.DataFrame, pd.DataFrame]:
    return gold_coverage_pairs(demo_dataset, "train"), gold_coverage_pairs(demo_dataset, "dev")


@pytest.fixture(scope="module")
def small_pairs(demo_pairs) -> tuple[pd.DataFrame, pd.DataFrame]:
    train, dev = demo_pairs
    return train.sample(n=240, random_state=0), dev.sample(n=120, random_state=0)


@pytest.fixture(scope="module")
def trained_tiny(tiny_model, small_pairs):
    with one_thread():
        return train_cross_encoder(tiny_model, *small_pairs, **TINY_TRAINING)


def _state_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_gold_coverage_pairs_label_exactly_the_links(demo_dataset, demo_pairs):
    train, _ = demo_pairs
    links = set(demo_dataset.nugget_links[["query_id", "doc_id", "nugget_id"]].itertuples(index=False))
    assert (train["label"] == [int(t in links) for t in
                               train[["query_id", "doc_id", "nugget_id"]].itertuples(index=False)]).all()
    train_queries = demo_dataset.queries.loc[demo_dataset.queries["split"] == "train", "query_id"]
    nuggets = demo_dataset.nuggets.groupby("query_id").size()
    docs = demo_dataset.candidates.groupby("query_id").size()
    assert len(train) == sum(nuggets[q] * docs[q] for q in train_queries)  # every nugget x every candidate
    text = dict(zip(demo_dataset.corpus["doc_id"], demo_dataset.corpus["text"]))
    assert (train["text"] == train["doc_id"].map(text)).all()  # demo titles are empty: text alone


def test_same_seed_same_weights_other_seed_other_weights(tiny_model, small_pairs, trained_tiny):
    again = train_cross_encoder(tiny_model, *small_pairs, **TINY_TRAINING)
    assert _state_equal(trained_tiny.model, again.model)
    assert again.history == trained_tiny.history
    other = train_cross_encoder(tiny_model, *small_pairs, **TINY_TRAINING, seed=1)
    assert not _state_equal(trained_tiny.model, other.model)


def test_keeps_the_best_epoch_and_stops_after_patience(tiny_model, small_pairs):
    train, dev = small_pairs
    trained = train_cross_encoder(tiny_model, train, dev, **{**TINY_TRAINING, "epochs": 4, "patience": 1})
    aucs = [h["dev_auc"] for h in trained.history]
    assert trained.dev_auc == max(aucs) and aucs[trained.best_epoch - 1] == trained.dev_auc
    # stops at the first epoch that does not improve on the best so far (patience 1), or runs them all
    first_drop = next((i for i in range(1, len(aucs)) if aucs[i] <= max(aucs[:i])), None)
    assert len(aucs) == (first_drop + 1 if first_drop is not None else 4)
    # every epoch records its dev calibration; the kept figures are the best epoch's
    assert all(0 <= h["dev_brier"] <= 1 and 0 <= h["dev_ece"] <= 1 for h in trained.history)
    best = trained.history[trained.best_epoch - 1]
    assert (trained.dev_brier, trained.dev_ece) == (best["dev_brier"], best["dev_ece"])
    # the returned weights are the best epoch's: they reproduce its dev AUC, Brier score and ECE (10 bins)
    probs = score_pairs(trained.model, trained.tokenizer, list(zip(dev["subquestion"], dev["text"])), max_length=64)
    assert roc_auc_score(dev["label"], probs) == pytest.approx(trained.dev_auc, abs=1e-6)
    assert brier_score(dev["label"], probs) == pytest.approx(trained.dev_brier, abs=1e-6)
    assert expected_calibration_error(dev["label"], probs, bins=10) == pytest.approx(trained.dev_ece, abs=1e-6)


def test_rejects_malformed_pairs(tiny_model, small_pairs):
    train, dev = small_pairs
    with pytest.raises(ValueError, match=r"lack column\(s\) \['label'\]"):
        train_cross_encoder(tiny_model, train.drop(columns="label"), dev)
    with pytest.raises(ValueError, match="has label 2; expected 0 or 1"):
        train_cross_encoder(tiny_model, train.assign(label=2), dev)
    with pytest.raises(ValueError, match="ROC-AUC needs both 0 and 1"):
        train_cross_encoder(tiny_model, train, dev[dev["label"] == 0])


@pytest.mark.slow
def test_the_demos_minilm_estimator_learned_the_demo_facts(demo_home, demo_pairs):
    """A real cross-encoder learns which demo document states which nugget (the facts are lexical): the MiniLM
    estimator `make demo` trained (one epoch over the train split's pairs at lr 1e-4) separates 150 dev pairs it
    never saw, scored here from its registered files, as well as its training recorded."""
    from covlab.resources.io_manager import read_stored

    home, _ = demo_home
    trained = read_stored(home / "storage", "coverage_estimator", "demo")
    score = load_estimator_scorer(trained.model.path, batch_size=64, device=torch.device("cpu"))
    dev = demo_pairs[1].sample(n=150, random_state=0)
    scores = score(list(zip(dev["subquestion"], dev["text"])))
    auc = roc_auc_score(dev["label"], scores)
    print(f"the demo's MiniLM estimator: ROC-AUC {auc:.3f} on 150 dev pairs (recorded: {trained.figures})")
    assert auc >= 0.75 and trained.figures["dev_auc"] >= 0.75


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("COVLAB_LONG_TESTS"), reason="one useful MiniLM epoch on ArgKP takes 10-30 min "
                    "on 2 CPU cores; set COVLAB_LONG_TESTS=1 (the issue notes give the measured dev AUC)")
def test_minilm_learns_argkp_key_point_matching():
    """ArgKP (key point, argument) pairs: 3000 train pairs, one epoch, max_length 96, scored on 1000 pairs of
    the dev split. This budget only starts the learning: on all 24,454 pairs (max_length 64, batch 32, lr
    1e-4, configs/argkp_given.yaml) epochs 1-3 reach dev ROC-AUC 0.819, 0.856, 0.854; here the bar is clearly
    above chance (0.5; its standard error at this dev size is about 0.025). Of the rates tried at this budget,
    lr 2e-4 at batch 16 learned fastest (0.62 on 600 dev pairs; 5e-5: 0.555, 1e-4 at batch 8: 0.46-0.54)."""
    dataset = read_dataset("argkp", "argkp2021", str(shared_dataset("argkp2021")))
    train, dev = gold_coverage_pairs(dataset, "train"), gold_coverage_pairs(dataset, "dev")
    dev = dev.sample(n=1000, random_state=0)
    started = time.perf_counter()
    trained = train_cross_encoder(default_base_model(), train.sample(n=3000, random_state=0), dev, max_length=96,
                                  epochs=1, batch_size=16, learning_rate=2e-4)
    elapsed = time.perf_counter() - started
    print(f"MiniLM on ArgKP: dev ROC-AUC {trained.dev_auc:.3f} over {len(dev)} dev pairs in {elapsed:.0f} s")
    assert trained.dev_auc >= 0.58


def test_training_batches_cover_every_pair_once_with_little_padding():
    lengths = np.random.default_rng(0).integers(8, 64, size=1003)
    batches = shuffled_length_batches(lengths, 32, torch.Generator().manual_seed(1), bucket_batches=4)
    assert sorted(torch.cat(batches).tolist()) == list(range(1003))
    assert sorted(len(b) for b in batches)[:2] == [1003 % 32, 32]  # buckets of 4 x 32: only the last is short
    padded = sum(len(b) * lengths[b.numpy()].max() for b in batches) / lengths.sum()
    random = sum(len(b) * lengths[b.numpy()].max() for b in torch.randperm(1003).split(32)) / lengths.sum()
    assert padded < 1.25 and random > 1.5
    again = shuffled_length_batches(lengths, 32, torch.Generator().manual_seed(1), bucket_batches=4)
    assert all(torch.equal(a, b) for a, b in zip(batches, again))
    other = shuffled_length_batches(lengths, 32, torch.Generator().manual_seed(2), bucket_batches=4)
    assert not all(torch.equal(a, b) for a, b in zip(batches, other))
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        shuffled_length_batches(lengths, 0, torch.Generator())


def test_score_pairs_restores_input_order(trained_tiny, small_pairs):
    _, dev = small_pairs
    pairs = list(zip(dev["subquestion"], dev["text"]))
    probs = score_pairs(trained_tiny.model, trained_tiny.tokenizer, pairs, max_length=64, batch_size=16)
    assert probs.dtype == np.float32 and probs.shape == (len(pairs),) and ((probs > 0) & (probs < 1)).all()
    assert np.unique(probs.round(6)).size > len(pairs) // 2  # scores differ, so order is observable
    permutation = np.random.default_rng(0).permutation(len(pairs))
    shuffled = score_pairs(trained_tiny.model, trained_tiny.tokenizer, [pairs[i] for i in permutation],
                           max_length=64, batch_size=16)
    np.testing.assert_allclose(shuffled, probs[permutation], atol=1e-6)


def test_scores_do_not_depend_on_batch_size_or_streams(trained_tiny, small_pairs):
    _, dev = small_pairs
    pairs = list(zip(dev["subquestion"], dev["text"]))
    one = score_pairs(trained_tiny.model, trained_tiny.tokenizer, pairs, max_length=64, batch_size=1)
    for batch_size in (7, 64):
        np.testing.assert_allclose(score_pairs(trained_tiny.model, trained_tiny.tokenizer, pairs, max_length=64,
                                               batch_size=batch_size), one, atol=1e-5)
    # two threads scoring whole batches side by side give the same scores, in the same order
    np.testing.assert_allclose(score_pairs(trained_tiny.model, trained_tiny.tokenizer, pairs, max_length=64,
                                           batch_size=7, streams=2), one, atol=1e-5)
    assert score_pairs(trained_tiny.model, trained_tiny.tokenizer, []).shape == (0,)


def test_save_load_round_trip_and_sentence_transformers_agree(trained_tiny, small_pairs, tmp_path):
    from sentence_transformers import CrossEncoder

    _, dev = small_pairs
    pairs = list(zip(dev["subquestion"], dev["text"]))
    saved = save_cross_encoder(trained_tiny, None, tmp_path / "estimator")
    assert (saved / "model.safetensors").is_file()
    model, tokenizer, info = load_cross_encoder(saved)
    assert info["max_length"] == 64 and info["training"]["best_epoch"] == trained_tiny.best_epoch
    assert info["training"]["history"] == trained_tiny.history
    assert [info["training"][k] for k in ("dev_auc", "dev_brier", "dev_ece")] == [
        trained_tiny.dev_auc, trained_tiny.dev_brier, trained_tiny.dev_ece]
    before = score_pairs(trained_tiny.model, trained_tiny.tokenizer, pairs, max_length=64)
    np.testing.assert_array_equal(score_pairs(model, tokenizer, pairs, max_length=64), before)
    reference = CrossEncoder(str(saved), max_length=64, device="cpu").predict(pairs, batch_size=16)
    np.testing.assert_allclose(reference, before, atol=1e-5)
    save_cross_encoder(trained_tiny, None, saved)  # overwriting leaves one complete directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["estimator"]


def test_progress_messages_carry_done_total_rate_and_eta_at_a_bounded_frequency():
    now = [0.0]
    messages: list[str] = []
    progress = Progress("scoring", 400, messages.append, unit="pairs", interval_s=10.0, steps=10,
                        clock=lambda: now[0])
    for _ in range(400):  # 400 items, one per 0.25 s: 100 s in all
        now[0] += 0.25
        progress.update(1)
    # a message every 10 s, which here is also every tenth: 10 in all, the last at completion
    assert len(messages) == 10 and str(messages[-1]) == "scoring: 400/400 (100%), 4.0 pairs/s, ETA 0s"
    assert str(messages[0]) == "scoring: 40/400 (10%), 4.0 pairs/s, ETA 1m30s"
    assert (messages[0].label, messages[0].done, messages[0].total, messages[0].eta_s) == ("scoring", 40, 400, 90.0)
    assert messages[-1].finished and not messages[0].finished
    fast, slow = [], []
    quick = Progress("x", 10_000, fast.append, interval_s=10.0, steps=10, clock=lambda: 0.0)
    for _ in range(10_000):
        quick.update(1)
    assert len(fast) == 10  # a fast step: one message per tenth, not per update
    now[0] = 0.0
    long = Progress("y", 10**6, slow.append, interval_s=10.0, steps=10, clock=lambda: now[0])
    for _ in range(600):  # a slow step: one message per 10 s, not per update
        now[0] += 1.0
        long.update(1)
    assert len(slow) == 60 and str(slow[0]) == "y: 10/1000000 (0%), 1.0 items/s, ETA 277h46m"


def test_scoring_and_training_report_progress(tiny_model, small_pairs):
    train, dev = small_pairs
    messages: list[str] = []
    epochs_seen = []
    trained = train_cross_encoder(tiny_model, train, dev, **{**TINY_TRAINING, "epochs": 1},
                                  progress=lambda event: messages.append(str(event)),
                                  on_epoch=lambda epoch, figures: epochs_seen.append((epoch, figures)))
    assert epochs_seen == [(1, {k: v for k, v in trained.history[0].items() if k != "epoch"})]
    assert set(epochs_seen[0][1]) == {"train_loss", "dev_auc", "dev_brier", "dev_ece"}
    pattern = r"^{}: (\d+)/(\d+) \(\d+%\), [\d.]+ pairs/s, ETA \w+$"
    epochs = [m for m in messages if m.startswith("cross-encoder epoch 1/1:") and "ETA" in m]
    assert epochs and all(re.match(pattern.format("cross-encoder epoch 1/1"), m) for m in epochs)
    assert epochs[-1].startswith(f"cross-encoder epoch 1/1: {len(train)}/{len(train)} (100%)")
    scoring = [m for m in messages if m.startswith("cross-encoder: scoring pairs")]
    assert scoring[-1].startswith(f"cross-encoder: scoring pairs: {len(dev)}/{len(dev)} (100%)")
    assert len(scoring) <= 11  # bounded: at most one per tenth
    assert any(f"dev ROC-AUC {trained.dev_auc:.4f}" in m for m in messages)


def _pool(dataset) -> pd.DataFrame:
    candidates = dataset.candidates.sort_values(["query_id", "doc_id"])
    return candidates.assign(rank=candidates.groupby("query_id").cumcount() + 1, score=0.0)


def test_pruned_matrix_scores_exactly_m_documents_per_subquestion_as_the_full_matrix_does(
        trained_tiny, tiny_model, demo_dataset, tmp_path):
    saved = save_cross_encoder(trained_tiny, None, tmp_path / "estimator")
    score = load_estimator_scorer(str(saved), batch_size=16, device=torch.device("cpu"))
    nuggets = gold_subquestions(demo_dataset.nuggets)
    queries = demo_dataset.queries[demo_dataset.queries["split"] == "dev"].head(3)
    pairs = pool_pairs(_pool(demo_dataset), nuggets, queries).drop(columns="split")
    texts = document_texts(demo_dataset.corpus)
    full = estimate_coverage(pairs, nuggets, texts, score)
    embed = load_first_stage(tiny_model, batch_size=16, max_length=64, device=torch.device("cpu"))
    m = 3
    pruned, kept = estimate_coverage_pruned(pairs, nuggets, texts, score, embed, m)
    assert pruned[["query_id", "doc_id", "subq_id"]].equals(full[["query_id", "doc_id", "subq_id"]])
    per_subquestion = pd.Series(kept).groupby([pairs["query_id"], pairs["subq_id"]]).sum()
    assert (per_subquestion == m).all() and pairs.groupby(["query_id", "subq_id"]).size().min() > m
    np.testing.assert_allclose(pruned["probability"][kept], full["probability"][kept], atol=1e-5)
    assert (pruned["probability"][~kept] == 0.0).all() and (full["probability"][~kept] > 0).all()
    # the kept documents are each subquestion's m most similar under the first stage
    text_of_nugget = dict(zip(nuggets["subq_id"], nuggets["text"]))
    cosine = cosines(*load_biencoder(tiny_model)[:2], list(zip(pairs["subq_id"].map(text_of_nugget),
                                                          pairs["doc_id"].map(texts))), max_length=64)
    for _, rows in pairs.assign(cosine=cosine, kept=kept).groupby(["query_id", "subq_id"]):
        assert rows.loc[rows["kept"], "cosine"].min() >= rows.loc[~rows["kept"], "cosine"].max() - 1e-6
    with pytest.raises(ValueError, match="prune_top_m must be >= 1"):
        estimate_coverage_pruned(pairs, nuggets, texts, score, embed, 0)


def test_window_selection_is_trained_with_saved_and_applied_when_scoring(tiny_model, small_pairs, tmp_path):
    train, dev = small_pairs
    windows = WindowSelection(stride=8)
    long_dev = dev.assign(text=dev["text"] + " " + dev["text"] + " " + dev["text"])  # none fit 64 tokens
    trained = train_cross_encoder(tiny_model, train, long_dev, **{**TINY_TRAINING, "epochs": 1}, windows=windows)
    saved = save_cross_encoder(trained, None, tmp_path / "estimator")
    _, tokenizer, info = load_cross_encoder(saved)
    assert WindowSelection.from_info(info["windows"]) == windows
    pairs = list(zip(long_dev["subquestion"], long_dev["text"]))
    read = select_windows(pairs, tokenizer, 64, windows)
    assert all(r != t and r in t for r, (_, t) in zip(read, pairs))
    expected = score_pairs(trained.model, trained.tokenizer, [(q, r) for (q, _), r in zip(pairs, read)], max_length=64)
    scored = load_estimator_scorer(str(saved), batch_size=16, device=torch.device("cpu"))(pairs)
    np.testing.assert_allclose(scored, expected, atol=1e-5)
    assert roc_auc_score(long_dev["label"], scored) == pytest.approx(trained.dev_auc, abs=1e-5)
