"""The evaluation protocol (models/protocol.py): the split protocol's one fold, the topic-grouped folds of
grouped_cv (every query evaluated once, a topic never split, a fold's training never seeing its evaluated or
tune topics, folds balanced as topic_folds promises), which queries are evaluated and reported under each, and
the fold assignment and plans the comparison and the student folds used before the protocol object, pinned."""

import numpy as np
import pandas as pd
import pytest

from covlab.models.protocol import EvaluationProtocol, Fold, fold_of_queries, topic_folds

# Ten queries over six topics of one to three queries, in train, dev and test.
QUERIES = pd.DataFrame({"query_id": [f"q{i}" for i in range(10)],
                        "topic": ["a", "a", "a", "b", "c", "c", "d", "e", "e", "f"],
                        "split": ["train"] * 4 + ["dev"] * 2 + ["test"] * 3 + ["train"]})


def random_queries(rng: np.random.Generator) -> pd.DataFrame:
    sizes = rng.integers(1, 5, int(rng.integers(2, 12)))  # topics of 1..4 queries
    topics = np.repeat([f"t{i}" for i in range(len(sizes))], sizes)
    ids = [f"q{i}" for i in rng.permutation(len(topics))]
    return pd.DataFrame({"query_id": ids, "topic": topics, "split": rng.choice(["train", "dev", "test"], len(ids))})


def test_the_split_protocol_is_one_fold_from_train_over_the_tune_split_to_the_selected_splits():
    protocol = EvaluationProtocol("split", splits=["dev", "test"], report_split="test", tune_split="dev")
    assert not protocol.cross_validated and protocol.splits == ("dev", "test")
    assert protocol.fold_plan(QUERIES) == [Fold(0, ("q0", "q1", "q2", "q3", "q9"), ("q4", "q5"),
                                                ("q4", "q5", "q6", "q7", "q8"))]
    assert EvaluationProtocol("split", splits=["test"]).fold_plan(QUERIES) == [
        Fold(0, ("q0", "q1", "q2", "q3", "q9"), ("q4", "q5"), ("q6", "q7", "q8"))]


def test_evaluated_and_reported_queries_under_both_protocols():
    pooled = ["q9", "q0", "q4", "q6", "q7", "q7"]
    split = EvaluationProtocol("split", splits=["dev", "test"], report_split="test")
    assert split.evaluated(QUERIES, pooled) == ["q4", "q6", "q7"]  # pooled queries of dev and test
    assert split.reported(QUERIES, pooled) == ["q6", "q7"]  # pooled queries of test
    assert EvaluationProtocol("split", splits=["test"], report_split="dev").reported(QUERIES, pooled) == ["q4"]
    grouped = EvaluationProtocol("grouped_cv", splits=["test"], folds=3)
    assert grouped.cross_validated
    assert grouped.evaluated(QUERIES, pooled) == grouped.reported(QUERIES, pooled) == ["q0", "q4", "q6", "q7", "q9"]
    with pytest.raises(ValueError, match="unknown protocol 'loo'; expected one of"):
        EvaluationProtocol("loo")


def test_topic_folds_are_the_comparisons_assignment_for_the_same_seed():
    """Known answers of the topic-grouped folds as models/comparison.py assigned them before the protocol object
    (seed 0 and 7, 3 folds), and the fold plan that the LMVU folds and the student folds built from them."""
    assert topic_folds(QUERIES, 3, 0) == {"q0": 2, "q1": 2, "q2": 2, "q3": 1, "q4": 1, "q5": 1, "q6": 0, "q7": 0,
                                          "q8": 0, "q9": 2}
    assert topic_folds(QUERIES, 3, 7) == {"q0": 2, "q1": 2, "q2": 2, "q3": 1, "q4": 1, "q5": 1, "q6": 0, "q7": 0,
                                          "q8": 0, "q9": 0}
    plan = EvaluationProtocol("grouped_cv", folds=3, seed=0).fold_plan(QUERIES)
    assert plan == [Fold(0, ("q0", "q1", "q2", "q9"), ("q3", "q4", "q5"), ("q6", "q7", "q8")),
                    Fold(1, ("q6", "q7", "q8"), ("q0", "q1", "q2", "q9"), ("q3", "q4", "q5")),
                    Fold(2, ("q3", "q4", "q5"), ("q6", "q7", "q8"), ("q0", "q1", "q2", "q9"))]
    assert fold_of_queries(plan) == topic_folds(QUERIES, 3, 0)


def test_grouped_cv_evaluates_every_query_once_and_never_trains_on_its_topics():
    rng = np.random.default_rng(0)
    for _ in range(200):
        queries = random_queries(rng)
        n_topics = queries["topic"].nunique()
        folds, seed = int(rng.integers(2, min(n_topics, 6) + 1)), int(rng.integers(0, 1000))
        plan = EvaluationProtocol("grouped_cv", folds=folds, seed=seed).fold_plan(queries)
        topic = dict(zip(queries["query_id"], queries["topic"]))
        everyone = sorted(queries["query_id"])
        assert [fold.index for fold in plan] == list(range(folds))
        evaluated = [q for fold in plan for q in fold.evaluated]
        assert sorted(evaluated) == everyone  # every query evaluated exactly once
        for fold in plan:
            assert fold.tune == plan[(fold.index + 1) % folds].evaluated  # the next fold tunes
            assert all(list(part) == sorted(part) for part in (fold.train, fold.tune, fold.evaluated))
            assert sorted(fold.train + fold.tune + fold.evaluated) == everyone  # train: all the others
            seen = {topic[q] for q in fold.train}
            assert seen.isdisjoint({topic[q] for q in fold.evaluated + fold.tune})
        fold_of = fold_of_queries(plan)
        assert fold_of == topic_folds(queries, folds, seed)
        # no topic is split between folds
        assert all(len({fold_of[q] for q in qs}) == 1 for _, qs in queries.groupby("topic")["query_id"])
        # each topic went to the smallest fold so far: the fold sizes differ by at most the largest topic's size
        sizes = np.bincount(list(fold_of.values()), minlength=folds)
        assert sizes.max() - sizes.min() <= queries["topic"].value_counts().max()
        assert plan == EvaluationProtocol("grouped_cv", folds=folds, seed=seed).fold_plan(queries)  # seeded


def test_topic_folds_keep_each_topic_in_one_fold_and_balance_queries():
    queries = pd.DataFrame({"query_id": [f"q{i}" for i in range(62)], "split": "train",
                            "topic": [f"t{i // 2}" for i in range(62)]})
    folds = topic_folds(queries, 5, seed=3)
    assert set(folds) == set(queries["query_id"]) and set(folds.values()) == set(range(5))
    assert all(len({folds[q] for q in qs}) == 1 for qs in queries.groupby("topic")["query_id"].apply(list))
    sizes = np.bincount(list(folds.values()))
    assert sizes.max() - sizes.min() <= 2  # two queries per topic
    assert folds == topic_folds(queries, 5, seed=3) and folds != topic_folds(queries, 5, seed=4)
    for bad in (32, 1):
        with pytest.raises(ValueError, match=f"needs 2 <= folds <= topics; got {bad} folds for 31 topics"):
            topic_folds(queries, bad, seed=0)


def test_how_a_method_met_its_data_is_described_per_protocol():
    split, grouped = EvaluationProtocol("split", splits=["dev", "test"]), EvaluationProtocol("grouped_cv")
    assert split.describe(trained=True, estimated=False) == "fit on train, settings chosen on dev"
    assert grouped.describe(trained=True, estimated=False) == ("refit per topic-grouped fold (settings chosen on "
                                                               "another fold of the training topics)")
    assert split.describe(trained=False, estimated=True) == ("standard split: the estimator trained on train, "
                                                             "selections for dev/test queries only")
    assert split.describe(False, False) == grouped.describe(False, False) == "no training"
