"""A covlab selector as a LlamaIndex node postprocessor: `CovlabPostprocessor` (in a query engine's
`node_postprocessors`, or `postprocess_nodes(nodes, query_str=...)`) returns the chosen `NodeWithScore` objects
themselves in context order; each chosen node gets `metadata["covlab"]` (integrations/_common.py), a key left out of
what the LLM and the embedding model read of the node. It selects by the node's own text (its content without
metadata); `last_selection` says what was left out and why."""

from __future__ import annotations

from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle

from covlab.serving.integrations._common import METADATA_KEY, Access, PydanticAdapter
from covlab.serving.selector import ServingError


def _with_metadata(scored: NodeWithScore, metadata: dict) -> NodeWithScore:
    node = scored.node
    node.metadata = metadata
    node.excluded_llm_metadata_keys = [*(k for k in node.excluded_llm_metadata_keys if k != METADATA_KEY),
                                       METADATA_KEY]
    node.excluded_embed_metadata_keys = [*(k for k in node.excluded_embed_metadata_keys if k != METADATA_KEY),
                                         METADATA_KEY]
    return scored


ACCESS: Access[NodeWithScore] = Access("llama_index NodeWithScore", "node.text",
                                       lambda n: n.node.get_content(metadata_mode=MetadataMode.NONE),
                                       lambda n: n.node.node_id, lambda n: n.node.metadata, _with_metadata)


class CovlabPostprocessor(PydanticAdapter, BaseNodePostprocessor):
    """A covlab selector (PydanticAdapter: a method or a built selector, and a budget) that keeps the chosen
    nodes of a retrieval."""

    access = ACCESS

    @classmethod
    def class_name(cls) -> str:
        return "CovlabPostprocessor"

    def _postprocess_nodes(self, nodes: list[NodeWithScore],
                           query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        if query_bundle is None:
            raise ServingError("query_bundle: CovlabPostprocessor selects for a query; call postprocess_nodes(nodes, "
                               "query_str=...) or use it in a query engine")
        return self._run(query_bundle.query_str, nodes)
