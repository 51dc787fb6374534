"""A covlab selector as a LangChain document compressor: `CovlabCompressor` post-processes a retriever's
documents (alone, or as the `base_compressor` of langchain-classic's ContextualCompressionRetriever) and returns
the chosen `Document` objects themselves in context order, each with `metadata["covlab"]` (integrations/_common.py);
`last_selection` says what was left out and why."""

from __future__ import annotations

from collections.abc import Sequence

from langchain_core.callbacks import Callbacks
from langchain_core.documents import BaseDocumentCompressor, Document

from covlab.serving.integrations._common import Access, PydanticAdapter


def _with_metadata(document: Document, metadata: dict) -> Document:
    document.metadata = metadata
    return document


ACCESS: Access[Document] = Access("langchain Document", "page_content", lambda d: d.page_content,
                                  lambda d: d.id, lambda d: d.metadata, _with_metadata)


class CovlabCompressor(PydanticAdapter, BaseDocumentCompressor):
    """A covlab selector (PydanticAdapter: a method or a built selector, and a budget):
    `compress_documents(documents, query)` returns the chosen documents."""

    access = ACCESS

    def compress_documents(self, documents: Sequence[Document], query: str,
                           callbacks: Callbacks | None = None) -> Sequence[Document]:
        """The chosen documents for `query`, in context order (module docstring)."""
        return self._run(query, documents)
