"""covlab.serving: a registry method as a context selector for any caller. The served selection is the selector's
own on the same pool (the pipeline's objects), says why each candidate is in or out, refuses bad requests by
field, and the serving path imports no Dagster code."""

import base64
import subprocess
import sys

import numpy as np
import pytest

from covlab.models.explain import NO_FACET, OVER_BUDGET, RANKED_BELOW, REDUNDANT
from covlab.models.lmvu import FEATURE_NAMES, LMVURanker
from covlab.models.registry import Role, SelectorSettings, method
from covlab.models.replay import BudgetDecision, RecordedDecisions
from covlab.models.selectors import MMR, AdaGReS, Budget, FacilityLocation, Pool, RelevanceOrder
from covlab.models.tokens import TokenCounter
from covlab.serving import SERVABLE, ServingError, load_selector, vectors_base64
from covlab.serving.selector import ContextSelector, as_candidates
from fixed_encoder import FixedEncoder

PASSAGES = ["The harbour market opens at dawn and sells fresh fish from the night boats.",
            "Fresh fish from the night boats is sold at the harbour market from dawn.",
            "The museum of old maps is closed on Mondays and free on the first Sunday.",
            "Trams to the old town run every ten minutes until midnight.",
            "Tram tickets can be bought on board or at the kiosks by the stops."]


def served(name: str, encoder=None, *, model=None, estimator=None, blend_weights=None, fell_back=False):
    """A ContextSelector of `name` over the fixed encoder, with LMVU's `model` or the coverage `estimator`, and the
    decisions of an evaluation that chose `blend_weights` ({"k=10": w, ...}) or fell back at those budgets."""
    models = {role: m for role, m in ((Role.SELECTOR_MODEL, model), (Role.COVERAGE_ESTIMATOR, estimator)) if m}
    decisions = RecordedDecisions({key: BudgetDecision(fell_back, "dev ROC-AUC 0.5000 < 0.6500" if fell_back else
                                                       "dev ROC-AUC 0.9000 >= 0.6500", None if fell_back else w)
                                   for key, w in (blend_weights or {}).items()})
    return ContextSelector(method(name), SelectorSettings(), encoder or FixedEncoder(), TokenCounter(),
                           models=models, decisions=decisions)


@pytest.mark.parametrize("name, selector", [("mmr", MMR(0.5)), ("adagres", AdaGReS()), ("facloc", FacilityLocation()),
                                            ("relevance", RelevanceOrder())])
@pytest.mark.parametrize("budget", [Budget(tokens=30), Budget(k=2)])
def test_a_served_selection_is_the_selector_s_own_on_the_same_pool(name, selector, budget):
    encoder = FixedEncoder()
    serving = served(name, encoder)
    answer = serving.select("What is there to do in the old town?", PASSAGES, budget)
    pool = serving.pool("What is there to do in the old town?", as_candidates(PASSAGES), None, None, budget)
    expected = selector(pool, budget)
    assert answer.ids == [str(i) for i in expected.items.tolist()]
    assert [item.gain for item in answer.chosen] == pytest.approx(expected.gains.tolist())
    assert answer.tokens == expected.tokens <= (budget.tokens or 10**9)
    assert {item.id for item in answer.left_out} == {str(i) for i in range(len(PASSAGES))} - set(answer.ids)


def test_precomputed_embeddings_replace_the_encoder_and_only_lmvu_reads_atoms():
    vectors = FixedEncoder()(PASSAGES + ["the query"])
    records = [{"id": f"d{i}", "text": text, "embedding": vectors[i].tolist()} for i, text in enumerate(PASSAGES)]

    class Recording(FixedEncoder):
        def __init__(self):
            super().__init__()
            self.encoded = []

        def __call__(self, texts):
            self.encoded += list(texts)
            return super().__call__(texts)

    encoder = Recording()
    answer = served("mmr", encoder).select("q", records, Budget(k=3), query_embedding=vectors[-1])
    pool = Pool(embeddings=vectors[:-1], query=vectors[-1], tokens=np.array(TokenCounter().count(PASSAGES)))
    assert answer.ids == [f"d{i}" for i in MMR(0.5)(pool, Budget(k=3)).items.tolist()]
    assert encoder.encoded == []  # everything MMR reads was given
    long = [PASSAGES[0] + " " + PASSAGES[2], PASSAGES[3]]  # two sentences, then one
    served("mmr", encoder).select("q", long, Budget(k=1))
    assert encoder.encoded == ["q", *long]  # no sentence atoms: MMR does not read them
    encoder.encoded.clear()
    ranker = LMVURanker(FEATURE_NAMES, np.zeros(18), np.ones(18), np.ones(18), 1.0, "viewpoints")
    served("lmvu", encoder, model=ranker).select("q", long, Budget(k=1))
    assert encoder.encoded == ["q", *long, PASSAGES[0], PASSAGES[2]]  # LMVU's atoms: the first one's sentences


def test_base64_float32_vectors_select_as_their_numbers_do_and_bad_ones_are_refused_by_field():
    texts = [PASSAGES[0] + " " + PASSAGES[2], PASSAGES[1], PASSAGES[3] + " " + PASSAGES[4], PASSAGES[2]]
    encoder = FixedEncoder()
    vectors = encoder(texts + ["q"])
    atoms = [encoder([PASSAGES[0], PASSAGES[2]]), vectors[1:2], encoder([PASSAGES[3], PASSAGES[4]]), vectors[3:4]]
    as_numbers = [{"id": f"d{i}", "text": t, "embedding": vectors[i].tolist(), "atoms": atoms[i].tolist()}
                  for i, t in enumerate(texts)]
    as_base64 = [{**c, "embedding": vectors_base64(vectors[i]), "atoms": vectors_base64(atoms[i])}
                 for i, c in enumerate(as_numbers)]
    ranker = LMVURanker(FEATURE_NAMES, np.zeros(18), np.ones(18), np.linspace(-1, 1, 18), 1.0, "viewpoints")
    parsed = as_candidates(as_base64)
    assert all(np.abs(c.atoms - a).max() < 1e-7 and c.atoms.shape == a.shape for c, a in zip(parsed, atoms))
    lmvu = served("lmvu", encoder, model=ranker)
    answers = [lmvu.select("q", c, Budget(k=2), query_embedding=q)
               for c, q in ((as_numbers, vectors[-1]), (as_base64, vectors_base64(vectors[-1])))]
    assert len(answers[0].ids) == 2 and answers[0].ids == answers[1].ids
    assert [c.gain for c in answers[0].chosen] == pytest.approx([c.gain for c in answers[1].chosen], abs=1e-5)

    one = dict(as_base64[0])
    for change, words in [({"atoms": "not base64!"}, "candidates[0].atoms: a string must be base64"),
                          ({"embedding": base64.b64encode(bytes(30)).decode()},
                           "candidates[0].embedding: 30 bytes of base64 are not whole float32 values"),
                          ({"atoms": vectors_base64(atoms[0].ravel()[:-1])},
                           "candidates[0].atoms: 15 float32 values are not whole rows of 8"),
                          ({"atoms": ""}, "candidates[0].atoms: 0 float32 values"),
                          ({"embedding": None}, "candidates[0].atoms: a base64 matrix takes its row length"),
                          ({"embedding": vectors_base64(np.array([1.0, np.nan]))},
                           "candidates[0].embedding: expected a finite vector")]:
        with pytest.raises(ServingError) as refused:
            as_candidates([{k: v for k, v in {**one, **change}.items() if v is not None}])
        assert words in str(refused.value)


def test_left_out_reasons_name_the_budget_the_duplicate_and_the_covered_facet():
    duplicate = [PASSAGES[0], PASSAGES[0] + " ", PASSAGES[2], " ".join(["harbour"] * 200)]
    encoder = FixedEncoder()
    encoder.table[duplicate[1]] = FixedEncoder()([PASSAGES[0]])[0]  # the same vector: a near duplicate

    def estimator(pairs):  # subquestion s0 covered by the first two items, s1 by the third
        return np.array([1.0 if (s, t) in {("s0", duplicate[0]), ("s0", duplicate[1]), ("s1", duplicate[2])}
                         else 0.0 for s, t in pairs])

    serving = served("coverage_greedy", encoder, estimator=estimator, blend_weights={"k=2": 1.0})
    answer = serving.select("q", duplicate + [PASSAGES[4]], Budget(k=2), subquestions=["s0", "s1"])
    # equal gains: relevance orders the two
    assert sorted(answer.ids) == ["0", "2"] and answer.decision["blend_weight"] == 1.0
    kinds = {item.id: (item.kind, item.redundant_with) for item in answer.left_out}
    assert kinds["1"] == (REDUNDANT, "0")  # the duplicate, whatever the room left
    assert kinds["3"][0] == NO_FACET  # covers nothing new (it is also far over budget: the telling reason first)
    assert [item.reason.startswith("chosen at step") for item in answer.chosen] == [True, True]
    over = served("mmr", FixedEncoder()).select("q", PASSAGES, Budget(tokens=20))
    assert {item.kind for item in over.left_out} <= {OVER_BUDGET, REDUNDANT, RANKED_BELOW}
    assert any(item.kind == OVER_BUDGET and "tokens," in item.reason for item in over.left_out)


def test_the_evaluation_s_gate_and_blend_weight_are_replayed_and_an_untuned_budget_says_its_rule():
    def estimator(pairs):
        return np.linspace(0.1, 0.9, len(pairs))

    low = served("coverage_greedy_soft", estimator=estimator, blend_weights={"k=2": 1.0}, fell_back=True)
    answer = low.select("q", PASSAGES, Budget(k=2), subquestions=["a", "b"])
    assert answer.decision["fell_back"] and "0.5000 < 0.6500" in answer.decision["estimator_gate"]
    assert answer.decision["rule"] == "evaluated"
    assert answer.ids == served("relevance").select("q", PASSAGES, Budget(k=2)).ids  # the fallback order
    tuned = served("coverage_greedy_soft", estimator=estimator, blend_weights={"k=10": 0.25, "tokens=128": 0.75})
    exact = tuned.select("q", PASSAGES, Budget(tokens=128), subquestions=["a"]).decision
    assert (exact["rule"], exact["blend_weight"], exact["blend_chosen_for"]) == ("evaluated", 0.75, "tokens=128")
    nearest = tuned.select("q", PASSAGES, Budget(k=3), subquestions=["a"]).decision
    assert (nearest["rule"], nearest["blend_weight"], nearest["blend_chosen_for"]) == ("nearest", 0.25, "k=10")
    assert "k=3 was never evaluated" in nearest["reason"]
    untuned = served("coverage_greedy_soft", estimator=estimator, blend_weights={"k=10": 0.25})
    fallback = untuned.select("q", PASSAGES, Budget(tokens=40), subquestions=["a"])
    assert fallback.decision["fell_back"] and fallback.decision["rule"] == "fallback"
    assert "no tokens budget was evaluated" in fallback.decision["reason"]
    assert fallback.ids == served("relevance").select("q", PASSAGES, Budget(tokens=40)).ids
    asked = untuned.select("q", PASSAGES, Budget(tokens=40), subquestions=["a"], blend_weight=1.0).decision
    assert (asked["rule"], asked["blend_weight"], asked["fell_back"]) == ("request", 1.0, False)
    gated = low.select("q", PASSAGES, Budget(k=2), subquestions=["a"], blend_weight=1.0).decision
    assert gated["fell_back"] and "not applied below the estimator gate" in gated["reason"]


@pytest.mark.parametrize("candidates, message", [
    ([], "candidates: expected a non-empty list"),
    ("one text", "candidates: expected a non-empty list"),
    ([{"id": "a"}], r"candidates\[0\]\.text: expected a string"),
    ([{"id": "a", "text": "x", "vector": [1]}], r"candidates\[0\]: unknown field\(s\) \['vector'\]"),
    ([{"id": "a", "text": "x"}, {"id": "a", "text": "y"}], "id 'a' appears more than once"),
    (["fine", "  "], r"candidates\[1\]\.text: empty"),
    ([{"id": "a", "text": "x", "embedding": ["no"]}], r"candidates\[0\]\.embedding: expected numbers"),
    ([3], r"candidates\[0\]: expected a text"),
])
def test_a_bad_request_names_the_field(candidates, message):
    with pytest.raises(ServingError, match=message):
        served("mmr").select("q", candidates, Budget(k=1))


def test_unknown_bound_and_untrained_requests_are_refused_with_the_valid_choices(tmp_path):
    with pytest.raises(ServingError, match=r"method: unknown method 'nosuch'.*servable: \['relevance'"):
        load_selector("nosuch")
    with pytest.raises(ServingError, match="'oracle_rvc1' cannot select for a caller \\(it reads gold labels\\)"):
        load_selector("oracle_rvc1")
    with pytest.raises(ServingError, match="dataset: lmvu needs its trained lmvu_ranker"):
        load_selector("lmvu")
    with pytest.raises(ServingError, match="covlab.demo.lmvu_ranker has no version with alias 'champion'"):
        load_selector("lmvu", "demo", tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", cache=tmp_path)
    with pytest.raises(ServingError, match="query: expected a non-empty string"):
        served("mmr").select(" ", PASSAGES, Budget(k=1))
    assert "gold_nugget_bound" not in SERVABLE and "dense" not in SERVABLE and "lmvu" in SERVABLE


def test_the_serving_path_imports_no_dagster():
    probe = ("import sys, covlab.serving, covlab.serving.pyfunc, covlab.serving.http, covlab.resources.model_store; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'dagster'))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def unit_rows(n: int, width: int, seed: int = 0) -> np.ndarray:
    rows = np.random.default_rng(seed).standard_normal((n, width))
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


@pytest.mark.parametrize("change, loc, message", [
    ({1: {"embedding": unit_rows(1, 3)[0]}}, ("candidates", 1, "embedding"),
     "candidates[1].embedding: expected width 8 (the first embedding's, candidates[0].embedding), got 3"),
    ({2: {"embedding": 2 * unit_rows(1, 8)[0]}}, ("candidates", 2, "embedding"),
     "candidates[2].embedding: not unit length (norm 2.000000); covlab expects unit-normalised embeddings"),
    ({0: {"embedding": np.zeros(8)}}, ("candidates", 0, "embedding"),
     "candidates[0].embedding: not unit length (norm 0.000000); covlab expects unit-normalised embeddings"),
    ({1: {"atoms": unit_rows(2, 3)}}, ("candidates", 1, "atoms"),
     "candidates[1].atoms: expected width 8 (the first embedding's, candidates[0].embedding), got 3"),
    ({1: {"atoms": np.vstack([unit_rows(1, 8), np.zeros((1, 8))])}}, ("candidates", 1, "atoms"),
     "candidates[1].atoms: row 1 is not unit length (norm 0.000000); covlab expects unit-normalised embeddings"),
    ({1: {"atoms": vectors_base64(unit_rows(2, 8) * 3)}}, ("candidates", 1, "atoms"),
     "candidates[1].atoms: row 0 is not unit length (norm 3.000000)"),
])
def test_embeddings_of_another_width_or_not_unit_length_are_refused_naming_the_field(change, loc, message):
    records = [{"id": f"d{i}", "text": t, "embedding": v} for i, (t, v) in enumerate(zip(PASSAGES, unit_rows(5, 8)))]
    for i, fields in change.items():
        records[i] = {**records[i], **fields}
    for given in (records, [{**r, "embedding": vectors_base64(r["embedding"])} for r in records]):
        with pytest.raises(ServingError) as refused:
            served("mmr").select("q", given, Budget(k=2))
        assert message in str(refused.value) and refused.value.loc == loc


@pytest.mark.parametrize("query_embedding, candidate_embeddings, message", [
    (unit_rows(1, 3)[0], True, "query_embedding: expected width 8 (the first embedding's, candidates[0].embedding), "
                               "got 3"),
    (unit_rows(1, 3)[0], False, "query_embedding: expected width 8 (the encoder's, which embedded the candidates), "
                                "got 3"),
    (np.zeros(8), True, "query_embedding: a zero vector; expected a non-zero vector (its direction is read)"),
    (None, "width 3", "candidates[0].embedding: expected width 8 (the encoder's, which embedded the query), got 3"),
])
def test_a_query_embedding_must_match_the_candidates_width(query_embedding, candidate_embeddings, message):
    width = 3 if candidate_embeddings == "width 3" else 8
    records = [{"id": f"d{i}", "text": t, **({"embedding": v} if candidate_embeddings else {})}
               for i, (t, v) in enumerate(zip(PASSAGES, unit_rows(5, width)))]
    with pytest.raises(ServingError) as refused:
        served("mmr").select("q", records, Budget(k=2), query_embedding=query_embedding)
    assert message in str(refused.value)
    assert refused.value.loc == (("candidates", 0, "embedding") if query_embedding is None else ("query_embedding",))


@pytest.mark.parametrize("given, message", [
    ([0, 1, 2], "candidates[3, 4].embedding: missing; give an embedding for every candidate or for none"),
    ([2], "candidates[2].embedding: given for 1 of 5 candidates only; give an embedding for every candidate or for "
          "none"),
])
def test_an_embedding_for_only_some_candidates_is_refused_naming_the_shorter_list(given, message):
    vectors = unit_rows(5, 8)
    records = [{"id": f"d{i}", "text": t, **({"embedding": vectors[i]} if i in given else {})}
               for i, t in enumerate(PASSAGES)]
    with pytest.raises(ServingError) as refused:
        served("mmr").select("q", records, Budget(k=2))
    assert str(refused.value) == message and refused.value.loc == ("candidates",)
    many = [{"id": f"d{i}", "text": f"passage {i}", **({"embedding": vectors[0]} if i % 2 else {})} for i in range(40)]
    with pytest.raises(ServingError, match=r"^candidates\[0, 2, 4, 6, 8, 10, 12, 14, 16, 18, \.\.\. \(20 in all\)\]"
                                           r"\.embedding: missing"):
        as_candidates(many)


def test_a_redundant_item_s_reason_names_the_chosen_item_s_id():
    texts = [PASSAGES[2], PASSAGES[0], PASSAGES[0] + " "]  # the third is a copy of the second
    encoder = FixedEncoder()
    encoder.table[texts[2]] = encoder([texts[1]])[0]
    records = [{"id": name, "text": t} for name, t in zip(["museum", "market", "market-copy"], texts)]
    answer = served("mmr", encoder).select(PASSAGES[0], records, Budget(k=1))
    (left,) = [item for item in answer.left_out if item.id == "market-copy"]
    assert answer.ids == ["market"] and left.kind == REDUNDANT and left.redundant_with == "market"
    assert left.reason == "redundant with chosen item market (cosine 1.000)"


@pytest.mark.parametrize("weight", [float("nan"), 1.5, -0.1, True, "1"])
def test_a_blend_weight_that_is_not_a_number_in_0_1_is_refused_by_the_library_call_naming_it(weight):
    serving = served("coverage_greedy_soft", estimator=lambda pairs: np.full(len(pairs), 0.5),
                     blend_weights={"k=2": 1.0})
    with pytest.raises(ServingError, match=r"blend_weight: expected a number in \[0, 1\]"):
        serving.select("q", PASSAGES, Budget(k=2), subquestions=["a"], blend_weight=weight)
