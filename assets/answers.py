"""Answers from the selected context and the self-feedback re-answer (LLM only; METHODS.md §1)."""

from concurrent.futures import ThreadPoolExecutor

import pandas as pd
from dagster import AssetExecutionContext, Config, MetadataValue, Output, asset
from pydantic import Field

from covlab.assets.outputs import content_output
from covlab.assets.partitions import DATASETS
from covlab.assets.presentation import OWNERS
from covlab.models import prompts
from covlab.models.answers import context_nuggets, transfer_rates
from covlab.models.coverage import document_texts, queries_of
from covlab.resources.evaluation import EvaluationResource
from covlab.resources.llm import LLMResource

NO_LLM = "skipped: the llm resource has backend 'none' (set llm.backend, llm.base_url and llm.model)"


class AnswerConfig(Config):
    sentences: int = Field(12, description="sentences asked of the first answer")
    feedback_sentences: int = Field(18, description="sentences asked of the self-feedback answer")
    words_per_document: int = Field(250, description="each document is truncated to this many words")


@asset(partitions_def=DATASETS, group_name="answers", output_required=False,
       code_version=f"1-{prompts.ANSWER_VERSION}-{prompts.FEEDBACK_VERSION}",
       kinds={"python", "parquet"}, owners=OWNERS)
def answers(context: AssetExecutionContext, config: AnswerConfig, selection_coverage_greedy: pd.DataFrame,
            queries: pd.DataFrame, corpus: pd.DataFrame, evaluation: EvaluationResource, llm: LLMResource):
    """For each evaluated query: the generator's answer from the coverage-greedy context, then its
    self-feedback re-answer over the same documents (query_id, answer, feedback_answer)."""
    if llm.backend == "none":
        context.log.warning(NO_LLM)
        return
    texts = document_texts(corpus)
    evaluated = queries_of(queries, evaluation.splits)
    docs = selection_coverage_greedy.sort_values("rank").groupby("query_id")["doc_id"].apply(list)
    contexts = [[texts[d] for d in docs.get(q, [])] for q in evaluated["query_id"]]
    first = llm.chat_json_many(prompts.ANSWER_VERSION, [
        prompts.answer(q, c, config.sentences, config.words_per_document)
        for q, c in zip(evaluated["text"], contexts)], prompts.parse_answer)
    second = llm.chat_json_many(prompts.FEEDBACK_VERSION, [
        prompts.feedback(q, c, a, config.feedback_sentences, config.words_per_document)
        for q, c, a in zip(evaluated["text"], contexts, first)], prompts.parse_answer)
    table = pd.DataFrame({"query_id": evaluated["query_id"].to_numpy(), "answer": first, "feedback_answer": second})
    yield content_output(table, metadata={"queries": len(table), "llm": MetadataValue.json(llm.describe()),
                                          "llm_usage": MetadataValue.json(llm.take_usage()),
                                          "config": MetadataValue.json(config.model_dump())})


@asset(partitions_def=DATASETS, group_name="answers", code_version=f"1-{prompts.ANSWER_COVERAGE_VERSION}",
       kinds={"python", "parquet"}, owners=OWNERS)
def answer_report(context: AssetExecutionContext, answers: pd.DataFrame, selection_coverage_greedy: pd.DataFrame,
                  nuggets: pd.DataFrame, nugget_links: pd.DataFrame, llm: LLMResource) -> Output[pd.DataFrame]:
    """Nugget recall of the first and the self-feedback answers (LLM-judged) and the transfer rate."""
    texts = nuggets.groupby("query_id").apply(lambda f: list(zip(f["nugget_id"], f["text"])), include_groups=False)
    def judge(query_id: str, answer: str) -> set[str]:
        ids = [i for i, _ in texts.get(query_id, [])]
        return llm.chat_json(prompts.ANSWER_COVERAGE_VERSION, prompts.answer_coverage(texts.get(query_id, []), answer),
                             lambda text: prompts.parse_covered(text, ids))

    judged = {}
    with ThreadPoolExecutor(llm.concurrency) as pool:  # the resource itself bounds requests in flight
        for column in ("answer", "feedback_answer"):
            judged[column] = dict(zip(answers["query_id"], pool.map(judge, answers["query_id"], answers[column])))
    table = transfer_rates(context_nuggets(selection_coverage_greedy, nugget_links), judged["answer"],
                           judged["feedback_answer"])
    return content_output(table, metadata={"mean_transfer_rate": float(table["transfer_rate"].mean()),
                                           "first_recall": float(table["first_recall"].mean()),
                                           "second_recall": float(table["second_recall"].mean())})
