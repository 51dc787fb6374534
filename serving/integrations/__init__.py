"""covlab's selectors inside RAG frameworks, one optional extra each: `covlab.serving.integrations.langchain`
(CovlabCompressor, a LangChain document compressor; extra `langchain`), `.llamaindex` (CovlabPostprocessor, a
LlamaIndex node postprocessor; extra `llamaindex`) and `.haystack` (CovlabSelector, a Haystack component; extra
`haystack`). Each runs a ContextSelector (a method name loaded with load_selector, or one already built) at a
token or k budget on the framework's own documents and returns those objects, the chosen ones in context order,
with covlab's reasons and provenance in their metadata (_common.py says what and where).

Nothing here imports a framework: only importing one of the three modules does."""
