"""The evaluation resource refuses every setting its selectors or reports would refuse, when it is built from
config, before anything runs or is stored, with one message naming the setting and what was expected; the
selectors apply the same rule (one validation for one setting)."""

import pytest
from pydantic import ValidationError

from covlab.models.selectors import CoverageGreedy, MMR
from covlab.resources.evaluation import EvaluationResource


@pytest.mark.parametrize("setting, value, expected", [
    ("k", 0, "k must be between 1 and 20"),
    ("k", 25, "k must be between 1 and 20"),
    ("tau", 1.5, "tau (covered iff p >= tau) must lie in (0, 1]"),
    ("tau", 0, "tau (covered iff p >= tau) must lie in (0, 1]"),
    ("report_split", "nosuch", "report_split 'nosuch' must be one of the evaluated splits"),
    ("splits", ["dev", "holdout"], "splits must name some of"),
    ("tune_split", "nosuch", "tune_split must be one of"),
    ("token_budgets", [0], "token budgets must be positive integers below 2**63"),
    ("token_budgets", [-5], "token budgets must be positive integers below 2**63"),
    ("token_budgets", [2 ** 63], "token budgets must be positive integers below 2**63"),
    ("mmr_lambda", 1.5, "MMR lambda must lie in [0, 1]"),
    ("blend_weights", [0.5, 1.0], "blend weights must include 0"),
    ("blend_weights", [0.0, 1.5], "a blend weight must lie in [0, 1]"),
    ("alpha", 2.0, "alpha (of alpha-nDCG) must lie in [0, 1]"),
    ("cv_folds", 1, "cv_folds must be at least 2"),
])
def test_a_setting_out_of_range_is_refused_by_name(setting, value, expected):
    with pytest.raises(ValidationError) as raised:
        EvaluationResource(**{setting: value})
    assert expected in str(raised.value)
    if setting != "report_split" and setting != "cv_folds":
        assert setting in str(raised.value).splitlines()[1]  # pydantic names the field on the line after the count


def test_the_selectors_apply_the_same_rule():
    for tau in (0, 1.5):
        with pytest.raises(ValueError, match=r"tau \(covered iff p >= tau\) must lie in \(0, 1\]"):
            CoverageGreedy(soft=False, tau=tau)
    with pytest.raises(ValueError, match=r"MMR lambda must lie in \[0, 1\]"):
        MMR(1.5)


def test_the_defaults_are_valid_and_build_the_typed_objects():
    evaluation = EvaluationResource()
    protocol = evaluation.evaluation_protocol()
    assert (protocol.kind, protocol.splits, protocol.report_split, protocol.tune_split) == (
        "split", ("dev", "test"), "test", "dev")
    assert evaluation.selector_settings().tau == 0.3
    trust = evaluation.estimate_trust(0.9, None)
    assert trust.weights is None and trust.min_dev_auc == 0.65
