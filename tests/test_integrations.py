"""covlab's selector inside LangChain, LlamaIndex and Haystack (covlab.serving.integrations), each in a small real
pipeline of that framework: the documents that come out are the framework's own objects, the chosen ones in
ContextSelector.select's order on the same texts, with their metadata intact plus covlab's reasons and provenance;
the budget holds; a near duplicate is left out by the diversifying methods (and kept by relevance order, so the
check can fail); what was left out and why is the adapter's last_selection. The frameworks are in the test extra:
a missing one fails here."""

import subprocess
import sys

import numpy as np
import pytest

from covlab.models.explain import REDUNDANT
from covlab.models.registry import SelectorSettings, method
from covlab.models.selectors import Budget
from covlab.models.tokens import TokenCounter
from covlab.serving import ContextSelector, ServingError
from covlab.serving.integrations._common import METADATA_KEY
from covlab.serving.selector import ModelProvenance
from fixed_encoder import FixedEncoder

QUERY = "When does the harbour market sell fresh fish?"
PASSAGES = ["The harbour market opens at dawn and sells fresh fish from the night boats.",
            "Fresh fish from the night boats is sold at the harbour market from dawn.",  # near duplicate of 0
            "The fish market by the harbour closes at noon on weekdays and at ten on Sundays.",
            "The museum of old maps is closed on Mondays and free on the first Sunday.",
            "Trams to the harbour run every ten minutes until midnight.",
            "Tram tickets can be bought on board or at the kiosks by the stops."]
IDS = [f"guide-{i}" for i in range(len(PASSAGES))]
META = {id_: {"source": f"guide/{id_}.txt", "page": i, "tags": ["harbour" if "harbour" in text else "town"]}
        for i, (id_, text) in enumerate(zip(IDS, PASSAGES))}
DUPLICATE, ORIGINAL = IDS[1], IDS[0]
PROVENANCE = ModelProvenance("covlab.demo.lmvu_ranker", 3, "champion", "models:/m-0123", "run-1", "sha256:ab",
                             "dagster-run-1", {"metric": "rvc1", "value": 0.7})
BUDGETS = [Budget(tokens=48), Budget(k=3)]


def encoder() -> FixedEncoder:
    """FixedEncoder where passage 1 has passage 0's vector (a near duplicate) and the query lies between passages
    0 and 2: both copies are the most relevant, so only a diversifying method leaves one out."""
    fixed = FixedEncoder()
    first, second = fixed([PASSAGES[0]])[0], fixed([PASSAGES[2]])[0]
    fixed.table[PASSAGES[1]] = first
    fixed.table[QUERY] = (first + 0.6 * second) / np.linalg.norm(first + 0.6 * second)
    return fixed


def selector(name: str) -> ContextSelector:
    return ContextSelector(method(name), SelectorSettings(), encoder(), TokenCounter(), provenance=[PROVENANCE])


def expected(name: str, ids: list[str], texts: list[str], budget: Budget):
    """ContextSelector.select on the same texts in the same order, with a fresh selector."""
    return selector(name).select(QUERY, [{"id": i, "text": t} for i, t in zip(ids, texts)], budget)


def check_selection(name, budget, returned_ids, returned_texts, returned_meta, given_ids, given_texts, last):
    """The returned documents are the selector's own choice on what the framework gave it, each with its own
    metadata plus covlab's record; the budget holds; the near duplicate is left out (not by relevance)."""
    want = expected(name, given_ids, given_texts, budget)
    assert returned_ids == want.ids and len(returned_ids) >= 2
    for rank, (id_, meta, item) in enumerate(zip(returned_ids, returned_meta, want.chosen), start=1):
        record = meta[METADATA_KEY]
        assert {k: v for k, v in meta.items() if k != METADATA_KEY} == META[id_]
        assert (record["id"], record["rank"], record["reason"], record["tokens"]) == (id_, rank, item.reason,
                                                                                     item.tokens)
        assert record["method"] == name and record["budget"] == {budget.unit: budget.limit}
        assert record["provenance"] == [{**PROVENANCE.__dict__}]
    tokens = sum(TokenCounter().count(returned_texts))
    assert tokens == want.tokens == returned_meta[0][METADATA_KEY]["context_tokens"]
    assert tokens <= budget.tokens if budget.tokens else len(returned_ids) <= budget.k
    assert last.selection.ids == returned_ids
    left = {item.id: item for _, item in last.left_out}
    assert set(left) == set(given_ids) - set(returned_ids)
    if name == "relevance":
        assert DUPLICATE in returned_ids and ORIGINAL in returned_ids
    else:
        assert ORIGINAL in returned_ids and DUPLICATE not in returned_ids
        assert (left[DUPLICATE].kind, left[DUPLICATE].redundant_with) == (REDUNDANT, ORIGINAL)


METHODS = ["mmr", "facloc", "relevance"]


# LangChain ----------------------------------------------------------------------------------------------------------

def langchain_retriever():
    """A small in-memory LangChain retriever: documents by how many query words they share, ties in corpus order."""
    from langchain_core.documents import Document
    from langchain_core.retrievers import BaseRetriever

    class WordOverlapRetriever(BaseRetriever):
        documents: list[Document]

        def _get_relevant_documents(self, query, *, run_manager):
            words = set(query.lower().rstrip("?").split())
            return sorted(self.documents, key=lambda d: -len(words & set(d.page_content.lower().split())))

    docs = [Document(page_content=t, id=i, metadata=dict(META[i])) for i, t in zip(IDS, PASSAGES)]
    return WordOverlapRetriever(documents=docs), docs


@pytest.mark.parametrize("budget", BUDGETS, ids=str)
@pytest.mark.parametrize("name", METHODS)
def test_langchain_contextual_compression_keeps_the_selection_s_documents(name, budget):
    from langchain_classic.retrievers import ContextualCompressionRetriever

    from covlab.serving.integrations.langchain import CovlabCompressor

    retriever, docs = langchain_retriever()
    given = retriever.invoke(QUERY)
    compressor = CovlabCompressor(selector=selector(name), tokens=budget.tokens, k=budget.k)
    returned = ContextualCompressionRetriever(base_compressor=compressor, base_retriever=retriever).invoke(QUERY)
    assert all(any(d is original for original in docs) for d in returned)  # LangChain's own objects
    check_selection(name, budget, [d.id for d in returned], [d.page_content for d in returned],
                    [d.metadata for d in returned], [d.id for d in given], [d.page_content for d in given],
                    compressor.last_selection)
    assert [d for d, _ in compressor.last_selection.left_out] == [d for d in given if d not in returned]


def test_langchain_composes_as_a_runnable_and_numbers_documents_without_ids():
    from langchain_core.documents import Document
    from langchain_core.runnables import RunnableLambda, RunnablePassthrough

    from covlab.serving.integrations.langchain import CovlabCompressor

    retriever, _ = langchain_retriever()
    for doc in retriever.documents:
        doc.id = None  # ids are optional in LangChain: positions stand in for them
    compressor = CovlabCompressor(selector=selector("mmr"), k=2)
    chain = ({"documents": retriever, "query": RunnablePassthrough()}
             | RunnableLambda(lambda x: compressor.compress_documents(x["documents"], x["query"])))
    returned = chain.invoke(QUERY)
    given = retriever.invoke(QUERY)
    want = expected("mmr", [str(i) for i in range(len(given))], [d.page_content for d in given], Budget(k=2))
    assert [d.metadata[METADATA_KEY]["id"] for d in returned] == want.ids
    assert [given.index(d) for d in returned] == [int(i) for i in want.ids]
    with pytest.raises(ServingError, match=r"documents\[1\]\.page_content: expected a non-empty text"):
        compressor.compress_documents([Document(page_content="fine"), Document(page_content=" ")], QUERY)
    assert compressor.compress_documents([], QUERY) == [] and compressor.last_selection is None


# LlamaIndex ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("budget", BUDGETS, ids=str)
@pytest.mark.parametrize("name", METHODS)
def test_llamaindex_query_engine_answers_from_the_selection(name, budget):
    from llama_index.core import VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding
    from llama_index.core.llms import MockLLM
    from llama_index.core.query_engine import RetrieverQueryEngine
    from llama_index.core.schema import TextNode

    from covlab.serving.integrations.llamaindex import CovlabPostprocessor

    nodes = [TextNode(id_=i, text=t, metadata=dict(META[i])) for i, t in zip(IDS, PASSAGES)]
    index = VectorStoreIndex(nodes, embed_model=MockEmbedding(embed_dim=8))
    retriever = index.as_retriever(similarity_top_k=len(nodes))
    given = retriever.retrieve(QUERY)
    postprocessor = CovlabPostprocessor(selector=selector(name), tokens=budget.tokens, k=budget.k)

    returned = postprocessor.postprocess_nodes(given, query_str=QUERY)
    assert all(any(n is g for g in given) for n in returned)  # the NodeWithScore objects given
    check_selection(name, budget, [n.node.node_id for n in returned], [n.node.text for n in returned],
                    [n.node.metadata for n in returned], [n.node.node_id for n in given],
                    [n.node.text for n in given], postprocessor.last_selection)

    engine = RetrieverQueryEngine.from_args(retriever, llm=MockLLM(), node_postprocessors=[postprocessor])
    response = engine.query(QUERY)
    sources = response.source_nodes
    assert [n.node.node_id for n in sources] == [n.node.node_id for n in returned]
    assert [n.node.metadata for n in sources] == [n.node.metadata for n in returned]
    prompt = str(response)  # MockLLM answers with its prompt: the context the LLM would have read
    assert all(n.node.text in prompt for n in sources)
    assert not any(n.node.text in prompt for n, _ in postprocessor.last_selection.left_out)
    assert METADATA_KEY not in prompt and "chosen at step" not in prompt  # covlab's record stays out of the prompt
    assert f"source: {META[sources[0].node.node_id]['source']}" in prompt  # the node's own metadata does not


def test_llamaindex_needs_the_query():
    from llama_index.core.schema import NodeWithScore, TextNode

    from covlab.serving.integrations.llamaindex import CovlabPostprocessor

    postprocessor = CovlabPostprocessor(selector=selector("mmr"), k=1)
    with pytest.raises(ServingError, match="query_bundle: CovlabPostprocessor selects for a query"):
        postprocessor.postprocess_nodes([NodeWithScore(node=TextNode(text="x"))])


# Haystack -----------------------------------------------------------------------------------------------------------

def haystack_pipeline(component):
    from haystack import Document, Pipeline
    from haystack.components.retrievers.in_memory import InMemoryBM25Retriever
    from haystack.document_stores.in_memory import InMemoryDocumentStore

    store = InMemoryDocumentStore()
    store.write_documents([Document(id=i, content=t, meta=dict(META[i])) for i, t in zip(IDS, PASSAGES)])
    pipeline = Pipeline()
    pipeline.add_component("retriever", InMemoryBM25Retriever(store, top_k=len(PASSAGES)))
    pipeline.add_component("selector", component)
    pipeline.connect("retriever.documents", "selector.documents")
    return pipeline, store


@pytest.mark.parametrize("budget", BUDGETS, ids=str)
@pytest.mark.parametrize("name", METHODS)
def test_haystack_pipeline_bm25_then_covlab_selector(name, budget):
    from covlab.serving.integrations.haystack import CovlabSelector

    component = CovlabSelector(selector=selector(name), tokens=budget.tokens, k=budget.k)
    pipeline, store = haystack_pipeline(component)
    given = pipeline.get_component("retriever").run(query=QUERY)["documents"]
    returned = pipeline.run({"retriever": {"query": QUERY}, "selector": {"query": QUERY}})["selector"]["documents"]
    assert [d is k for d, k in zip(returned, component.last_selection.kept)] == [True] * len(returned)
    check_selection(name, budget, [d.id for d in returned], [d.content for d in returned], [d.meta for d in returned],
                    [d.id for d in given], [d.content for d in given], component.last_selection)
    assert all(METADATA_KEY not in d.meta for d in store.filter_documents())  # the store's documents unchanged
    direct = component.run(query=QUERY, documents=given)["documents"]
    assert [d.id for d in direct] == [d.id for d in returned]
    by_id = {d.id: d for d in given}  # Haystack's rule: copies of the inputs (dataclasses.replace), inputs unchanged
    assert all(type(d) is type(by_id[d.id]) and (d.content, d.score) == (by_id[d.id].content, by_id[d.id].score)
               and METADATA_KEY not in by_id[d.id].meta for d in direct)


def test_haystack_a_named_method_serializes_with_its_pipeline(tmp_path):
    from haystack import Pipeline
    from haystack.core.errors import SerializationError

    from covlab.serving.integrations.haystack import CovlabSelector

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    pipeline, _ = haystack_pipeline(CovlabSelector("mmr", tokens=64, tracking_uri=uri))
    loaded = Pipeline.loads(pipeline.dumps(), allowed_modules=["covlab.serving.integrations.haystack"])
    loaded = loaded.get_component("selector")
    assert loaded.selector.method.name == "mmr" and loaded.budget == Budget(tokens=64)
    with pytest.raises(SerializationError, match="built from a ContextSelector object"):
        haystack_pipeline(CovlabSelector(selector=selector("mmr"), k=2))[0].dumps()


# Shared ---------------------------------------------------------------------------------------------------------------

def test_a_method_name_loads_its_selector_and_bad_arguments_are_refused(tmp_path):
    from covlab.serving.integrations.haystack import CovlabSelector
    from covlab.serving.integrations.langchain import CovlabCompressor
    from covlab.serving.integrations.llamaindex import CovlabPostprocessor

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for adapter in (CovlabCompressor, CovlabPostprocessor, CovlabSelector):
        built = adapter("facloc", k=4, tracking_uri=uri)
        assert built.selector.method.name == "facloc" and built.budget == Budget(k=4)
        with pytest.raises(ServingError, match="selector: give either a method name .* exactly one"):
            adapter(k=4)
        with pytest.raises(ServingError, match="selector: give either"):
            adapter("mmr", selector=selector("mmr"), k=4)
        with pytest.raises(ServingError, match="dataset: lmvu needs its trained lmvu_ranker"):
            adapter("lmvu", k=4, tracking_uri=uri)
        with pytest.raises(ValueError, match="a Budget is either k items or B tokens, exactly one"):
            adapter(selector=selector("mmr"), k=4, tokens=100)


def test_importing_covlab_serving_imports_no_framework():
    probe = ("import sys, covlab.serving, covlab.serving.integrations, covlab.serving.integrations._common; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('langchain_core', 'langchain_classic', "
             "'llama_index', 'haystack')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


@pytest.mark.slow
def test_after_make_demo_the_readme_s_adapters_select_with_the_champion(demo_home, monkeypatch, tmp_path):
    """The README's "In RAG pipelines" lines on the demo's registry: each adapter built from ("lmvu", "demo") selects
    what load_selector's champion selects and names that model version in its record."""
    from haystack import Document as HaystackDocument
    from langchain_core.documents import Document
    from llama_index.core.schema import NodeWithScore, TextNode

    from covlab.serving import load_selector
    from covlab.serving.integrations.haystack import CovlabSelector
    from covlab.serving.integrations.langchain import CovlabCompressor
    from covlab.serving.integrations.llamaindex import CovlabPostprocessor

    home, _ = demo_home
    monkeypatch.setenv("COVLAB_HOME", str(tmp_path))  # downloaded models go here; the registry is the demo's
    monkeypatch.setenv("COVLAB_MLFLOW_TRACKING_URI", f"sqlite:///{home}/mlflow/mlflow.db")
    want = load_selector("lmvu", "demo").select(QUERY, [{"id": i, "text": t} for i, t in zip(IDS, PASSAGES)],
                                                Budget(tokens=48))
    chosen = {
        "langchain": [d.metadata for d in CovlabCompressor("lmvu", "demo", tokens=48).compress_documents(
            [Document(page_content=t, id=i) for i, t in zip(IDS, PASSAGES)], QUERY)],
        "llamaindex": [n.node.metadata for n in CovlabPostprocessor("lmvu", "demo", tokens=48).postprocess_nodes(
            [NodeWithScore(node=TextNode(id_=i, text=t)) for i, t in zip(IDS, PASSAGES)], query_str=QUERY)],
        "haystack": [d.meta for d in CovlabSelector("lmvu", "demo", tokens=48).run(
            query=QUERY, documents=[HaystackDocument(id=i, content=t) for i, t in zip(IDS, PASSAGES)])["documents"]]}
    for framework, records in chosen.items():
        assert [m[METADATA_KEY]["id"] for m in records] == want.ids and want.ids, framework
        (model,) = records[0][METADATA_KEY]["provenance"]
        assert (model["name"], model["alias"], model["version"]) == ("covlab.demo.lmvu_ranker", "champion",
                                                                      want.provenance[0].version), framework


@pytest.mark.parametrize("budget, words", [
    ({"k": 0}, "k: expected a whole number of items from 1 to 2**63 - 1, got 0"),
    ({"tokens": 0}, "tokens: expected a whole number of tokens from 1 to 2**63 - 1, got 0"),
    ({"k": -2}, "k: expected a whole number of items from 1 to 2**63 - 1, got -2"),
    ({"tokens": True}, "tokens: expected a whole number of tokens from 1 to 2**63 - 1, got True"),
    ({"k": 2.0}, "k: expected a whole number of items from 1 to 2**63 - 1, got 2.0"),
    ({"tokens": 2**63}, f"tokens: expected a whole number of tokens from 1 to 2**63 - 1, got {2**63}"),
])
def test_every_adapter_refuses_a_budget_that_is_not_a_positive_whole_number(budget, words):
    from covlab.serving.integrations.haystack import CovlabSelector
    from covlab.serving.integrations.langchain import CovlabCompressor
    from covlab.serving.integrations.llamaindex import CovlabPostprocessor

    for adapter in (CovlabCompressor, CovlabPostprocessor, CovlabSelector):
        with pytest.raises(ServingError) as refused:
            adapter(selector=selector("mmr"), **budget)
        assert str(refused.value) == words, adapter
