"""The relevance and coverage bi-encoders of Decompose, Estimate, Select (METHODS.md §1).

The relevance bi-encoder is the untrained base (mean pooling, L2-normalised). The coverage bi-encoder
starts from it and is trained with the CoveR objective: InfoNCE at temperature 0.02 where the anchor is
the query plus a simulated covered state, `{query} [COVERED] {subq_a}; {subq_b}` or `[COVERED] none`
[chosen], the positive a document covering at least one uncovered subquestion, and the negatives
redundant documents (covering only covered subquestions), irrelevant ones (covering nothing) and every
other group's documents in the batch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from covlab.models.encoders import (CPU, OptimizerSteps, Progress, Tokenized, autocast, batch_inference, collate,
                                    length_sorted_batches, mean_pool, quiet_loading, read_info, run_batches,
                                    save_model_directory, seeded, tokenize)
from covlab.models.runtime import DEFAULT_RUNTIME, onnx_model, runtime_on

COVERED_MARKER = "[COVERED]"
NOTHING_COVERED = "none"
SUBQUESTION_SEPARATOR = "; "


def coverage_anchor(query: str, covered_subquestions: Sequence[str]) -> str:
    """The anchor text for `query` in a covered state [chosen]: `{query} [COVERED] {a}; {b}` or `... none`."""
    state = SUBQUESTION_SEPARATOR.join(covered_subquestions) if covered_subquestions else NOTHING_COVERED
    return f"{query} {COVERED_MARKER} {state}"


@dataclass(frozen=True)
class Group:
    """One training group: an anchor (query + covered state, or a subquestion for the matcher), one positive
    and its own negatives. Document fields are row indices into the table the group was built from (the
    query's covers matrix, or the matcher's labelled pairs), with their texts alongside."""
    query: str
    covered: tuple[int, ...]  # subquestion indices of the simulated covered state
    anchor: str
    positive: int
    negatives: tuple[int, ...]
    positive_text: str
    negative_texts: tuple[str, ...]


def build_coverage_groups(query_text: str, subquestions: Sequence[str], covers: np.ndarray,
                          doc_texts: Sequence[str], rng: np.random.Generator, max_negatives: int = 7,
                          states_per_query: int = 4) -> list[Group]:
    """Groups for one query from its (n_docs, n_subq) boolean covers matrix (METHODS.md §1).

    States: the empty state, then random non-empty subsets of the coverable subquestions that leave at
    least one coverable subquestion uncovered (so a positive exists); duplicate states are dropped.
    Per state: a random positive covering an uncovered subquestion; negatives drawn at random from the
    redundant and irrelevant documents, with one redundant document always included when any exists."""
    covers = np.asarray(covers, dtype=bool)
    if covers.shape != (len(doc_texts), len(subquestions)):
        raise ValueError(f"covers has shape {covers.shape}; expected (n_docs, n_subq) = "
                         f"({len(doc_texts)}, {len(subquestions)})")
    if max_negatives < 1 or states_per_query < 1:
        raise ValueError(f"max_negatives ({max_negatives}) and states_per_query ({states_per_query}) must be >= 1")
    coverable = np.flatnonzero(covers.any(axis=0))
    if coverable.size == 0:
        return []
    states = [()]
    for _ in range(states_per_query - 1):
        if coverable.size < 2:
            break
        size = int(rng.integers(1, coverable.size))
        state = tuple(sorted(int(j) for j in rng.choice(coverable, size=size, replace=False)))
        if state not in states:
            states.append(state)
    covers_any = covers.any(axis=1)
    groups = []
    for state in states:
        uncovered = np.setdiff1d(coverable, state)
        adds = covers[:, uncovered].any(axis=1)
        positives = np.flatnonzero(adds)
        redundant = np.flatnonzero(covers_any & ~adds)
        irrelevant = np.flatnonzero(~covers_any)
        positive = int(rng.choice(positives))
        negatives: list[int] = []
        if redundant.size:
            first = int(rng.choice(redundant))
            negatives.append(first)
            redundant = redundant[redundant != first]
        rest = rng.permutation(np.concatenate([redundant, irrelevant]))
        negatives += [int(d) for d in rest[:max_negatives - len(negatives)]]
        groups.append(Group(query=query_text, covered=state,
                            anchor=coverage_anchor(query_text, [subquestions[j] for j in state]),
                            positive=positive, negatives=tuple(negatives), positive_text=doc_texts[positive],
                            negative_texts=tuple(doc_texts[d] for d in negatives)))
    return groups


def coverage_groups_from_pairs(pairs: pd.DataFrame, query_texts: dict[str, str], rng: np.random.Generator,
                               max_negatives: int = 7, states_per_query: int = 4) -> list[Group]:
    """Groups for every query of a long coverage table (query_id, doc_id, nugget_id, subquestion, text,
    label), e.g. `gold_coverage_pairs` or judged pairs with label [rating >= 4]; queries in id order."""
    missing = [c for c in ("query_id", "doc_id", "nugget_id", "subquestion", "text", "label") if c not in pairs]
    if missing:
        raise ValueError(f"coverage pairs lack column(s) {missing}; expected query_id, doc_id, nugget_id, "
                         "subquestion, text, label")
    groups = []
    for query_id, rows in pairs.groupby("query_id", sort=True):
        if query_id not in query_texts:
            raise ValueError(f"query {query_id!r} of the coverage pairs has no text in query_texts")
        matrix = rows.pivot_table(index="doc_id", columns="nugget_id", values="label", aggfunc="max",
                                  fill_value=0)
        texts = rows.drop_duplicates("doc_id").set_index("doc_id")["text"]
        subquestions = rows.drop_duplicates("nugget_id").set_index("nugget_id")["subquestion"]
        groups += build_coverage_groups(query_texts[query_id], list(subquestions[matrix.columns]),
                                        matrix.to_numpy() > 0, list(texts[matrix.index]), rng,
                                        max_negatives=max_negatives, states_per_query=states_per_query)
    return groups


def info_nce(anchor: torch.Tensor, candidates: torch.Tensor, positive_index: torch.Tensor, temperature: float,
             candidate_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean InfoNCE: -log softmax(anchor_i . candidates / temperature)[positive_index_i] over the rows.
    `candidate_mask` (n_anchors, n_candidates), True = keep, removes candidates from a row's softmax."""
    logits = anchor @ candidates.T / temperature
    if candidate_mask is not None:
        logits = logits.masked_fill(~candidate_mask, float("-inf"))
    return torch.nn.functional.cross_entropy(logits, positive_index)


def _embed(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The bi-encoder's embedding of a batch: mean-pooled over the attention mask, unit length. What the ONNX
    runtime's export computes (models/runtime.py)."""
    hidden = model(**batch).last_hidden_state
    return torch.nn.functional.normalize(mean_pool(hidden, batch["attention_mask"]).float(), dim=-1)


def encode(model, tokenizer, texts: Sequence[str], *, batch_size: int = 64, max_length: int = 256,
           device: torch.device = CPU, autocast_dtype: torch.dtype | None = None,
           streams: int | None = None, progress: Callable[[str], None] | None = None) -> np.ndarray:
    """Unit-length mean-pooled embeddings (n_texts, hidden) in input order; texts tokenized once,
    length-sorted, dynamically padded and run as score_pairs runs them; `model` a torch model or its ONNX
    export (load_biencoder's `runtime`); `progress` gets done/total, rate and ETA messages (encoders.Progress)."""
    out = np.empty((len(texts), model.config.hidden_size), dtype=np.float32)
    if not texts:
        return out
    tokenized = tokenize(tokenizer, texts, None, max_length)
    embedder = batch_inference(model, _embed, device, autocast_dtype)

    def embed(batch: np.ndarray) -> None:
        out[batch] = embedder(collate(tokenized, batch, device))

    run_batches(length_sorted_batches(tokenized.lengths, batch_size), embed, device, streams,
                Progress("bi-encoder: encoding texts", len(texts), progress, unit="texts"))
    return out


def cosines(model, tokenizer, pairs: Sequence[tuple[str, str]], *, batch_size: int = 64, max_length: int = 256,
            device: torch.device = CPU, autocast_dtype: torch.dtype | None = None,
            progress: Callable[[str], None] | None = None) -> np.ndarray:
    """Cosine of each (first, second) text pair, e.g. (query, document) or (subquestion, document);
    every distinct text is encoded once."""
    if not pairs:
        return np.zeros(0, dtype=np.float64)
    texts = list(dict.fromkeys(text for pair in pairs for text in pair))
    vectors = encode(model, tokenizer, texts, batch_size=batch_size, max_length=max_length, device=device,
                     autocast_dtype=autocast_dtype, progress=progress)
    row = {text: i for i, text in enumerate(texts)}
    firsts, seconds = zip(*pairs)
    cosine = np.einsum("ij,ij->i", vectors[[row[t] for t in firsts]], vectors[[row[t] for t in seconds]])
    return cosine.astype(np.float64)


@dataclass
class _Batch:
    """One training batch of groups, tokenized: the anchors, every group's documents (positive first, then its
    negatives), the index of each anchor's positive among the documents, and which documents each anchor's softmax
    keeps (not the documents of other groups of the same query: they may be its positives, no false negatives)."""
    anchors: Tokenized
    documents: Tokenized
    positives: torch.Tensor
    keep: torch.Tensor


def _prepare(tokenizer, groups: Sequence[Group], max_length: int) -> _Batch:
    docs = [text for g in groups for text in (g.positive_text, *g.negative_texts)]
    owner = torch.tensor([i for i, g in enumerate(groups) for _ in range(1 + len(g.negatives))])
    starts = torch.tensor([0] + [1 + len(g.negatives) for g in groups[:-1]]).cumsum(0)
    query_ids = {query: i for i, query in enumerate(dict.fromkeys(g.query for g in groups))}
    query_of = torch.tensor([query_ids[g.query] for g in groups])
    same_query_other_group = (query_of[:, None] == query_of[owner][None, :]) & \
                             (torch.arange(len(groups))[:, None] != owner[None, :])
    return _Batch(tokenize(tokenizer, [g.anchor for g in groups], None, max_length),
                  tokenize(tokenizer, docs, None, max_length), starts, ~same_query_other_group)


def _loss(batch: _Batch, anchor_vectors: torch.Tensor, doc_vectors: torch.Tensor, temperature: float,
          device: torch.device) -> torch.Tensor:
    """InfoNCE of the batch's anchors over all its documents."""
    return info_nce(anchor_vectors, doc_vectors, batch.positives.to(device), temperature, batch.keep.to(device))


def _batch_loss(model, tokenizer, groups: Sequence[Group], temperature: float, max_length: int,
                device: torch.device) -> torch.Tensor:
    """InfoNCE of one batch of groups: candidates are all groups' documents (see _Batch)."""
    batch = _prepare(tokenizer, groups, max_length)
    return _loss(batch, _embed(model, collate(batch.anchors, range(len(groups)), device)),
                 _embed(model, collate(batch.documents, range(len(batch.documents.lengths)), device)),
                 temperature, device)


def _rng_state(device: torch.device) -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(state: tuple, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _cached_gradient_backward(model, batch: _Batch, temperature: float, device: torch.device,
                              autocast_dtype: torch.dtype | None, chunk: int,
                              backward: Callable[[torch.Tensor], None]) -> float:
    """The batch's gradient with the peak of `chunk` texts (gradient caching, Gao et al. 2021): every text is
    embedded without gradients, `chunk` at a time; `backward` takes the InfoNCE over those embeddings (every
    in-batch negative kept) back to them; then each chunk is embedded again with gradients, its dropout replayed
    from the random state its first pass drew from, and backpropagated from its embeddings' gradients. The
    weights' gradients accumulate as the whole batch's would, up to float rounding (each chunk is padded to its
    own longest text). Returns the loss."""
    chunks = [(tokenized, range(start, min(start + chunk, len(tokenized.lengths))))
              for tokenized in (batch.anchors, batch.documents) for start in range(0, len(tokenized.lengths), chunk)]
    states, vectors = [], []
    with torch.no_grad():
        for tokenized, indices in chunks:
            states.append(_rng_state(device))
            with autocast(device, autocast_dtype):
                vectors.append(_embed(model, collate(tokenized, indices, device)).requires_grad_())
    after = _rng_state(device)
    anchor_chunks = math.ceil(len(batch.anchors.lengths) / chunk)
    loss = _loss(batch, torch.cat(vectors[:anchor_chunks]), torch.cat(vectors[anchor_chunks:]), temperature, device)
    backward(loss)
    for (tokenized, indices), state, cached in zip(chunks, states, vectors):
        _set_rng_state(state, device)
        with autocast(device, autocast_dtype):
            _embed(model, collate(tokenized, indices, device)).backward(cached.grad)
    _set_rng_state(after, device)
    return loss.item()


def train_coverage_biencoder(base_model: str, groups: Sequence[Group], *, temperature: float = 0.02,
                             epochs: int = 1, batch_size: int = 8, learning_rate: float = 2e-5,
                             weight_decay: float = 0.01, warmup_ratio: float = 0.1, max_grad_norm: float = 1.0,
                             max_length: int = 256, seed: int = 0, device: torch.device = CPU,
                             autocast_dtype: torch.dtype | None = None, activation_checkpointing: bool = False,
                             gradient_cache_chunk: int | None = None, progress: Callable[[str], None] | None = None,
                             after_epoch: Callable[[torch.nn.Module, object], dict] | None = None,
                             on_epoch: Callable[[int, dict], None] | None = None):
    """(model, tokenizer, history): `base_model` (the relevance bi-encoder) fine-tuned with InfoNCE over
    [positive, group negatives, the other groups' documents in the batch] at `temperature`; AdamW with
    linear warmup and decay; history has one {epoch, train_loss} per epoch, plus what `after_epoch`
    (model in eval mode, tokenizer) returns, e.g. a dev score; `on_epoch(epoch, figures)` gets those figures
    as soon as an epoch ends. `activation_checkpointing` keeps only each layer's input during the forward pass
    and recomputes the rest in the backward (Hugging Face's activation checkpointing, dropout replayed): the
    same weights, a peak that no longer holds every layer's activations of the batch's ~72 texts, for a second
    forward pass of each layer (bench/step_memory.py measures both). `gradient_cache_chunk` embeds the batch's texts
    that many at a time, first without gradients, then again chunk by chunk with them (_cached_gradient_backward):
    the same loss, every in-batch negative kept, a peak that follows the chunk instead of the batch's ~80 texts,
    for a second forward pass of every text. Bit-identical on CPU per seed."""
    from transformers import AutoModel, AutoTokenizer

    if not groups:
        raise ValueError("no training groups; expected at least one (query, positive, negatives) group")
    log = progress or (lambda message: None)
    history = []
    with seeded(seed, device) as shuffle:
        tokenizer = AutoTokenizer.from_pretrained(base_model)
        with quiet_loading():
            model = AutoModel.from_pretrained(base_model).to(device)
        if activation_checkpointing:
            model.activation_checkpointing_enable()
        steps = OptimizerSteps(model, learning_rate=learning_rate, weight_decay=weight_decay,
                               warmup_ratio=warmup_ratio, total_steps=epochs * math.ceil(len(groups) / batch_size),
                               max_grad_norm=max_grad_norm, device=device, autocast_dtype=autocast_dtype)
        for epoch in range(1, epochs + 1):
            model.train()
            losses = []
            tracker = Progress(f"bi-encoder epoch {epoch}/{epochs}", len(groups), progress, unit="groups")
            for batch in torch.randperm(len(groups), generator=shuffle).split(batch_size):
                chosen = [groups[i] for i in batch]
                if gradient_cache_chunk:
                    losses.append(_cached_gradient_backward(model, _prepare(tokenizer, chosen, max_length),
                                                            temperature, device, autocast_dtype,
                                                            gradient_cache_chunk, steps.backward))
                    steps.update()
                else:
                    with autocast(device, autocast_dtype):
                        loss = _batch_loss(model, tokenizer, chosen, temperature, max_length, device)
                    losses.append(steps.step(loss))
                tracker.update(len(batch))
            history.append({"epoch": epoch, "train_loss": float(np.mean(losses))})
            if after_epoch is not None:
                model.eval()
                history[-1].update(after_epoch(model, tokenizer))
            log(f"bi-encoder epoch {epoch}/{epochs}: " + ", ".join(f"{k} {v:.4f}" for k, v in history[-1].items()
                                                                    if k != "epoch"))
            if on_epoch is not None:
                on_epoch(epoch, {k: v for k, v in history[-1].items() if k != "epoch"})
    if activation_checkpointing:
        model.activation_checkpointing_disable()
    model.eval()
    return model, tokenizer, history


@torch.inference_mode()
def groups_loss(model, tokenizer, groups: Sequence[Group], *, temperature: float = 0.02, batch_size: int = 8,
                max_length: int = 256, device: torch.device = CPU) -> float:
    """Mean InfoNCE of `groups` in their given order and batching, without training (a held-out check)."""
    model.eval()
    losses = [_batch_loss(model, tokenizer, groups[start:start + batch_size], temperature, max_length, device)
              for start in range(0, len(groups), batch_size)]
    return float(torch.stack(losses).mean())


def save_biencoder(model, tokenizer, directory: str | os.PathLike, *, max_length: int = 256,
                   history: Sequence[dict] = (), settings: dict | None = None, kind: str = "biencoder") -> Path:
    """Save weights (safetensors), tokenizer and covlab.json (kind, max_length, training history and settings)."""
    info = {"kind": kind, "max_length": max_length,
            "training": {"history": list(history), **(settings or {})}}
    return save_model_directory(model, tokenizer, directory, info)


def load_biencoder(path_or_name: str | os.PathLike, device: torch.device = CPU, runtime: str = DEFAULT_RUNTIME):
    """(model in eval mode on `device`, tokenizer, info) from a saved coverage bi-encoder, or from any
    Hugging Face encoder path or name, untrained: the relevance bi-encoder (info {}). With an ONNX `runtime` on
    the CPU (models/runtime.py) the model is its verified export of `_embed` (a local model directory only),
    exported first when the directory has none; `encode` and `cosines` take either."""
    from transformers import AutoModel, AutoTokenizer

    def torch_model():
        with quiet_loading():
            return AutoModel.from_pretrained(str(path_or_name)).to(device).eval()

    tokenizer = AutoTokenizer.from_pretrained(str(path_or_name))
    model = (torch_model() if runtime_on(runtime, device) == "torch" else
             onnx_model(path_or_name, runtime, task="embedding", input_names=tokenizer.model_input_names,
                        load_torch=torch_model, forward=_embed))
    return model, tokenizer, read_info(path_or_name)


def load_first_stage(path_or_name: str, *, batch_size: int, max_length: int, device, autocast_dtype=None,
                     progress: Callable[[str], None] | None = None,
                     runtime: str = DEFAULT_RUNTIME) -> Callable[[list[str]], np.ndarray]:
    """A bi-encoder (any saved one, e.g. the coverage bi-encoder, or a Hugging Face path or name) as a
    function texts -> unit vectors, run by `runtime` (load_biencoder): the first stage of
    models/coverage.estimate_coverage_pruned, the window scorer of models/windows.py, the encoder of the item
    embeddings and the topic bank, and the service's encoder."""
    model, tokenizer, _ = load_biencoder(path_or_name, device, runtime)
    return lambda texts: encode(model, tokenizer, texts, batch_size=batch_size, max_length=max_length, device=device,
                                autocast_dtype=autocast_dtype, progress=progress)
