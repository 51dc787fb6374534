"""A tiny BERT (2 layers, hidden 32) with the packaged MiniLM tokenizer: training steps take seconds.

Weights are drawn with a wide initializer range (0.5 instead of BERT's 0.02) so that even untrained its
outputs, and a fresh head's scores, vary clearly with the input."""

from contextlib import contextmanager
from pathlib import Path

TINY_BERT = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
             "initializer_range": 0.5}


def save_tiny_bert(directory: Path, seed: int = 0) -> str:
    """A randomly initialised tiny BertModel saved with the MiniLM tokenizer; returns its path."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from covlab.models.encoders import default_base_model

    tokenizer = AutoTokenizer.from_pretrained(default_base_model())
    torch.manual_seed(seed)
    BertModel(BertConfig(vocab_size=tokenizer.vocab_size, **TINY_BERT)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@contextmanager
def one_thread():
    """Run tiny-model work on one intra-op thread: its ops are too small to gain from more, and on a busy
    machine every multi-threaded op waits for a core that another process holds (10x slower measured)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def tiny_pipeline_config(model: str) -> dict:
    """Every encoder replaced by the tiny model, one short epoch: the pipeline's wiring, not its accuracy."""
    return {"ops": {
        "subquestions": {"config": {"base_model": model}},
        "coverage_estimator": {"config": {"base_model": model, "epochs": 1, "max_length": 96,
                                          "negatives_per_positive": 1.0}},
        "coverage_biencoder": {"config": {"base_model": model, "max_length": 96}},
        "relevance_scores": {"config": {"relevance_model": model, "max_length": 96}},
        "pool_scores": {"config": {"max_length": 96}},
        "item_embeddings": {"config": {"model": model, "max_length": 96}},
        "lmvu_ranker": {"config": {"states_per_query": 4}},
        "topic_metadata_bank": {"config": {"model": model, "max_length": 96}},
        "mcompass_student": {"config": {"epochs": 2}},
    }}
