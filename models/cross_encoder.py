"""The coverage estimator of Decompose, Estimate, Select (METHODS.md §1): a cross-encoder over
(subquestion, document) pairs with one output logit, p = sigmoid(logit), covered iff p >= tau.

Training [chosen details]: binary cross-entropy on the logit, AdamW with linear warmup and decay, early
stopping on dev ROC-AUC keeping the best epoch's weights, with each epoch's dev Brier score and expected
calibration error recorded beside it (how far p reads as a probability, which tau relies on); batches are
shuffled but hold pairs of similar length (encoders.shuffled_length_batches), so little compute goes to
padding. Labels are [rating >= 4] of the judged pairs (or gold nugget links, `gold_coverage_pairs`).
On CPU the same seed gives bit-identical weights. A pair longer than max_length reads its document's best
window (models/windows.py) when a WindowSelection is given; the selection is saved with the model, so scoring
reads the same way.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from sklearn.metrics import roc_auc_score

from covlab.models.dataset import Dataset
from covlab.models.encoders import (CPU, OptimizerSteps, Progress, autocast, batch_inference, collate,
                                    length_sorted_batches, quiet_loading, read_info, run_batches,
                                    save_model_directory, seeded, shuffled_length_batches, tokenize)
from covlab.models.metrics import brier_score, expected_calibration_error
from covlab.models.runtime import DEFAULT_RUNTIME, onnx_model, runtime_on
from covlab.models.schemas import document_text
from covlab.models.windows import WindowSelection, select_windows

PAIR_COLUMNS = ("subquestion", "text", "label")


@dataclass
class TrainedCrossEncoder:
    """A trained estimator: the best epoch's weights, its tokenizer, and how training went."""
    model: torch.nn.Module
    tokenizer: object
    # one {epoch, train_loss, dev_auc, dev_brier, dev_ece} per epoch run
    history: list[dict] = field(default_factory=list)
    best_epoch: int = 0
    dev_auc: float = float("nan")
    dev_brier: float = float("nan")  # the best epoch's dev Brier score
    dev_ece: float = float("nan")  # the best epoch's dev expected calibration error (10 bins)
    max_length: int = 256
    settings: dict = field(default_factory=dict)  # base model and hyperparameters, for covlab.json
    windows: WindowSelection = field(default_factory=lambda: WindowSelection(mode="first"))


def gold_coverage_pairs(dataset: Dataset, split: str) -> pd.DataFrame:
    """Every (nugget, candidate document) pair of the `split` queries, label 1 iff nugget_links has it:
    (query_id, doc_id, nugget_id, subquestion, text, label). A document's text is schemas.document_text,
    as the BM25 index reads it."""
    queries = dataset.queries.loc[dataset.queries["split"] == split, ["query_id"]]
    if queries.empty:
        raise ValueError(f"dataset {dataset.name!r} has no {split!r} queries; expected one of "
                         f"{sorted(dataset.queries['split'].unique())}")
    nuggets = dataset.nuggets.merge(queries, on="query_id").rename(columns={"text": "subquestion"})
    docs = dataset.corpus.assign(text=[document_text(t, x) for t, x in
                                       zip(dataset.corpus["title"], dataset.corpus["text"])])
    candidates = dataset.candidates.merge(docs[["doc_id", "text"]], on="doc_id")
    pairs = nuggets.merge(candidates, on="query_id")
    linked = dataset.nugget_links[["query_id", "doc_id", "nugget_id"]].drop_duplicates().assign(label=1)
    pairs = pairs.merge(linked, on=["query_id", "doc_id", "nugget_id"], how="left")
    pairs["label"] = pairs["label"].fillna(0).astype("int64")
    columns = ["query_id", "doc_id", "nugget_id", "subquestion", "text", "label"]
    return pairs[columns].sort_values(["query_id", "nugget_id", "doc_id"]).reset_index(drop=True)


def checked_pairs(pairs: pd.DataFrame, name: str, columns: Sequence[str] = PAIR_COLUMNS,
                  both_labels: bool = False) -> pd.DataFrame:
    """`pairs` with a fresh index, or a ValueError naming the missing column, the first bad label, or (with
    `both_labels`, as dev pairs for ROC-AUC need) the one label they all have."""
    missing = [c for c in columns if c not in pairs.columns]
    if missing:
        raise ValueError(f"{name} pairs lack column(s) {missing}; expected columns {list(columns)}")
    if pairs.empty:
        raise ValueError(f"{name} pairs are empty; expected (subquestion, text, label) rows")
    bad = ~pairs["label"].isin([0, 1])
    if bad.any():
        raise ValueError(f"{name} pairs: row {int(np.flatnonzero(bad.to_numpy())[0])} has label "
                         f"{pairs['label'][bad].tolist()[0]!r}; expected 0 or 1")
    if both_labels and pairs["label"].nunique() < 2:
        raise ValueError(f"{name} pairs have only label {pairs['label'].iloc[0]}; ROC-AUC needs both 0 and 1")
    return pairs.reset_index(drop=True)


def train_cross_encoder(base_model: str, train: pd.DataFrame, dev: pd.DataFrame, *, max_length: int = 256,
                        epochs: int = 3, batch_size: int = 16, learning_rate: float = 2e-5,
                        weight_decay: float = 0.01, warmup_ratio: float = 0.1, patience: int = 1,
                        seed: int = 0, device: torch.device = CPU,
                        pos_weight: float | None = None, max_grad_norm: float = 1.0,
                        eval_batch_size: int = 64, autocast_dtype: torch.dtype | None = None,
                        windows: WindowSelection | None = None,
                        progress: Callable[[str], None] | None = None,
                        on_epoch: Callable[[int, dict], None] | None = None) -> TrainedCrossEncoder:
    """Fine-tune `base_model` (any Hugging Face encoder path or name) with a fresh one-logit head.

    Loss: BCE-with-logits; `pos_weight` multiplies the positive term (e.g. negatives/positives against
    class imbalance; default none, the probabilities then stay calibrated for tau). Schedule: linear
    warmup over `warmup_ratio` of the planned steps, then linear decay. After each epoch the dev pairs
    are scored: ROC-AUC, Brier score and expected calibration error (10 bins). Training stops once dev
    ROC-AUC has not improved for `patience` epochs; the best epoch's weights and dev figures are kept. With
    `windows`, pairs longer than `max_length` read the selected window of their document (train and dev
    alike); without, they are truncated. `progress` gets each epoch's done/total, rate and ETA
    (encoders.Progress) and its dev figures; `on_epoch(epoch, figures)` gets that epoch's history entry
    (train_loss, dev_auc, dev_brier, dev_ece) as soon as it is measured."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    train, dev = checked_pairs(train, "train"), checked_pairs(dev, "dev", both_labels=True)
    log = progress or (lambda message: None)
    windows = windows or WindowSelection(mode="first")
    settings = {"base_model": base_model, "max_length": max_length, "epochs": epochs, "batch_size": batch_size,
                "learning_rate": learning_rate, "weight_decay": weight_decay, "warmup_ratio": warmup_ratio,
                "patience": patience, "seed": seed, "pos_weight": pos_weight, "max_grad_norm": max_grad_norm,
                "train_pairs": len(train), "dev_pairs": len(dev)}
    with seeded(seed, device) as shuffle:
        tokenizer = AutoTokenizer.from_pretrained(base_model)
        train, dev = (frame.assign(text=select_windows(list(zip(frame["subquestion"], frame["text"])), tokenizer,
                                                       max_length, windows, batch_size=eval_batch_size, device=device,
                                                       autocast_dtype=autocast_dtype, progress=progress))
                      for frame in (train, dev))
        with quiet_loading(new_head=True):
            model = AutoModelForSequenceClassification.from_pretrained(base_model, num_labels=1).to(device)
        tokenized = tokenize(tokenizer, train["subquestion"], train["text"], max_length)
        labels = torch.tensor(train["label"].to_numpy(), dtype=torch.float32)
        dev_pairs = list(zip(dev["subquestion"], dev["text"]))
        steps = OptimizerSteps(model, learning_rate=learning_rate, weight_decay=weight_decay,
                               warmup_ratio=warmup_ratio, total_steps=epochs * math.ceil(len(train) / batch_size),
                               max_grad_norm=max_grad_norm, device=device, autocast_dtype=autocast_dtype)
        loss_fn = torch.nn.BCEWithLogitsLoss(
            pos_weight=None if pos_weight is None else torch.tensor([pos_weight], device=device))
        trained = TrainedCrossEncoder(model, tokenizer, max_length=max_length, settings=settings,
                                      dev_auc=-math.inf, windows=windows)
        best_state, stale = None, 0
        for epoch in range(1, epochs + 1):
            model.train()
            total = 0.0
            tracker = Progress(f"cross-encoder epoch {epoch}/{epochs}", len(train), progress, unit="pairs")
            for batch in shuffled_length_batches(tokenized.lengths, batch_size, shuffle):
                with autocast(device, autocast_dtype):
                    logits = _logit(model, collate(tokenized, batch.numpy(), device))
                total += steps.step(loss_fn(logits.float(), labels[batch].to(device))) * len(batch)
                tracker.update(len(batch))
            model.eval()
            probs = score_pairs(model, tokenizer, dev_pairs, batch_size=eval_batch_size, max_length=max_length,
                                device=device, autocast_dtype=autocast_dtype, progress=progress)
            auc = float(roc_auc_score(dev["label"], probs))
            brier, ece = brier_score(dev["label"], probs), expected_calibration_error(dev["label"], probs)
            trained.history.append({"epoch": epoch, "train_loss": total / len(train), "dev_auc": auc,
                                    "dev_brier": brier, "dev_ece": ece})
            log(f"cross-encoder epoch {epoch}/{epochs}: train loss {total / len(train):.4f}, dev ROC-AUC {auc:.4f}, "
                f"Brier {brier:.4f}, ECE {ece:.4f}")
            if on_epoch is not None:
                on_epoch(epoch, {k: v for k, v in trained.history[-1].items() if k != "epoch"})
            if auc > trained.dev_auc:
                trained.dev_auc, trained.dev_brier, trained.dev_ece = auc, brier, ece
                trained.best_epoch, stale = epoch, 0
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            else:
                stale += 1
                if stale >= patience:
                    log(f"cross-encoder: no dev improvement for {stale} epoch(s); keeping epoch {trained.best_epoch}")
                    break
    model.load_state_dict(best_state)
    model.eval()
    return trained


def _logit(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The estimator's one logit per pair of a batch: what the ONNX runtime's export computes (models/runtime.py)."""
    return model(**batch).logits[:, 0]


def score_pairs(model, tokenizer, pairs: Sequence[tuple[str, str]], *, batch_size: int = 64,
                max_length: int = 256, device: torch.device = CPU, autocast_dtype: torch.dtype | None = None,
                streams: int | None = None, progress: Callable[[str], None] | None = None) -> np.ndarray:
    """Coverage probabilities sigmoid(logit) of (subquestion, document) pairs, in input order.

    All pairs are tokenized in one call, sorted by token length and batched with dynamic padding, so a
    batch costs what its own texts cost; under inference_mode, with autocast where `autocast_dtype` is
    given (CUDA). On CPU, `streams` threads score whole batches side by side (encoders.run_batches).
    `model` is a torch model or its ONNX export (load_cross_encoder's `runtime`). `progress` gets done/total,
    rate and ETA messages (encoders.Progress)."""
    if not pairs:
        return np.zeros(0, dtype=np.float32)
    firsts, seconds = zip(*pairs)
    tokenized = tokenize(tokenizer, firsts, seconds, max_length)
    probs = np.empty(len(pairs), dtype=np.float32)
    logits = batch_inference(model, _logit, device, autocast_dtype)

    def score(batch: np.ndarray) -> None:
        probs[batch] = torch.sigmoid(torch.from_numpy(logits(collate(tokenized, batch, device)))).numpy()

    run_batches(length_sorted_batches(tokenized.lengths, batch_size), score, device, streams,
                Progress("cross-encoder: scoring pairs", len(pairs), progress, unit="pairs"))
    return probs


def save_cross_encoder(trained_or_model: TrainedCrossEncoder | torch.nn.Module, tokenizer,
                       directory: str | os.PathLike, *, max_length: int | None = None) -> Path:
    """Save weights (safetensors), tokenizer and covlab.json (max_length, window selection and the training
    summary).
    A TrainedCrossEncoder brings its own tokenizer and max_length (pass tokenizer=None); a bare model
    needs both."""
    if isinstance(trained_or_model, TrainedCrossEncoder):
        trained = trained_or_model
        info = {"kind": "cross_encoder", "max_length": max_length or trained.max_length,
                "windows": trained.windows.to_info(),
                "training": {"history": trained.history, "best_epoch": trained.best_epoch,
                             "dev_auc": trained.dev_auc, "dev_brier": trained.dev_brier,
                             "dev_ece": trained.dev_ece, **trained.settings}}
        return save_model_directory(trained.model, tokenizer or trained.tokenizer, directory, info)
    if tokenizer is None or max_length is None:
        raise ValueError("saving a bare cross-encoder model needs its tokenizer and max_length")
    return save_model_directory(trained_or_model, tokenizer, directory,
                                {"kind": "cross_encoder", "max_length": max_length})


def load_cross_encoder(directory: str | os.PathLike, device: torch.device = CPU, runtime: str = DEFAULT_RUNTIME):
    """(model in eval mode on `device`, tokenizer, info) from a saved estimator; a plain Hugging Face
    encoder path or name loads too, with a fresh one-logit head and info {}. With an ONNX `runtime` on the CPU
    (models/runtime.py) the model is the saved estimator's verified export of `_logit`, exported first when the
    directory has none; `score_pairs` takes either. A plain encoder has no export: its head is drawn afresh
    at every load."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    info = read_info(directory)

    def torch_model():
        with quiet_loading(new_head=not info):  # a plain encoder gets a fresh head
            return AutoModelForSequenceClassification.from_pretrained(str(directory), num_labels=1).to(device).eval()

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    if runtime_on(runtime, device) == "torch":
        return torch_model(), tokenizer, info
    if info.get("kind") != "cross_encoder":
        raise ValueError(f"runtime {runtime!r}: {directory} is not a saved cross-encoder (its covlab.json kind is "
                         f"{info.get('kind')!r}); only a trained estimator's fixed head can be exported")
    return (onnx_model(directory, runtime, task="coverage_logit", input_names=tokenizer.model_input_names,
                       load_torch=torch_model, forward=_logit), tokenizer, info)
