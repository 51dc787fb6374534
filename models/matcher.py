"""A bi-encoder coverage estimator [chosen extension of METHODS.md §1's "Estimate"]: the relevance
bi-encoder fine-tuned to match subquestions to the documents that cover them, its cosine mapped to a
probability by Platt scaling fitted on the dev pairs.

Why beside the cross-encoder: the packaged MiniLM was pre-trained as a bi-encoder, so as a matcher it
starts from a useful similarity where a cross-encoder head starts from nothing, and one encoding per text
replaces one forward pass per pair. A cheaper estimator, not a better one (the README and
bench/estimator_matrix.py measure both): the cross-encoder stays the default.

Training: InfoNCE (`biencoder.info_nce`) over groups anchor = subquestion, positive = a document covering
it, negatives = documents of the same query judged not to cover it, plus the other queries' documents in
the batch. The epochs run in full; each epoch's dev ROC-AUC is recorded, and the calibrated dev probabilities
of the final weights give the dev Brier score and expected calibration error.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score

from covlab.models.biencoder import Group, cosines, load_biencoder, save_biencoder, train_coverage_biencoder
from covlab.models.cross_encoder import PAIR_COLUMNS, checked_pairs
from covlab.models.encoders import CPU
from covlab.models.metrics import brier_score, expected_calibration_error

KIND = "biencoder_matcher"


@dataclass(frozen=True)
class PlattScaling:
    """p = sigmoid(slope * cosine + intercept), fitted by (nearly unregularised) logistic regression."""
    slope: float
    intercept: float

    @classmethod
    def fit(cls, scores: np.ndarray, labels: np.ndarray) -> PlattScaling:
        if len(np.unique(labels)) < 2:
            raise ValueError("Platt scaling needs both covered and uncovered dev pairs")
        model = LogisticRegression(C=1e6).fit(np.asarray(scores, dtype=np.float64)[:, None], labels)
        return cls(float(model.coef_[0, 0]), float(model.intercept_[0]))

    def __call__(self, scores: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-(self.slope * np.asarray(scores, dtype=np.float64) + self.intercept)))


@dataclass
class TrainedMatcher:
    model: torch.nn.Module
    tokenizer: object
    calibration: PlattScaling
    dev_auc: float
    max_length: int
    history: list[dict] = field(default_factory=list)  # one {epoch, train_loss, dev_auc} per epoch
    settings: dict = field(default_factory=dict)
    dev_brier: float = float("nan")  # of the Platt-calibrated dev probabilities
    dev_ece: float = float("nan")  # of the Platt-calibrated dev probabilities (10 bins)

    @property
    def best_epoch(self) -> int:
        """The epoch whose weights are kept: the last (epochs run in full)."""
        return len(self.history)


def matching_groups(pairs: pd.DataFrame, rng: np.random.Generator, max_negatives: int = 7) -> list[Group]:
    """One group per covered (subquestion, document) pair of a labelled table (query_id, nugget_id,
    subquestion, text, label): anchor = the subquestion, negatives = up to `max_negatives` documents of
    the same query labelled as not covering it, drawn at random. Document fields are row indices of `pairs`."""
    pairs = pairs.reset_index(drop=True)
    groups = []
    for (query_id, _), rows in pairs.groupby(["query_id", "nugget_id"], sort=True):
        positives, negatives = rows.index[rows["label"] == 1], rows.index[rows["label"] == 0].to_numpy()
        for positive in positives:
            chosen = tuple(int(i) for i in rng.choice(negatives, size=min(max_negatives, len(negatives)),
                                                      replace=False))
            groups.append(Group(query_id, (), pairs.at[positive, "subquestion"], int(positive), chosen,
                                pairs.at[positive, "text"], tuple(pairs.loc[list(chosen), "text"])))
    return groups


def train_matcher(base_model: str, train: pd.DataFrame, dev: pd.DataFrame, *, temperature: float = 0.05,
                  epochs: int = 1, batch_size: int = 16, learning_rate: float = 5e-5, max_length: int = 256,
                  max_negatives: int = 7, seed: int = 0, device: torch.device = CPU,
                  autocast_dtype: torch.dtype | None = None,
                  progress: Callable[[str], None] | None = None,
                  on_epoch: Callable[[int, dict], None] | None = None) -> TrainedMatcher:
    """Fine-tune `base_model` (a bi-encoder) on the covered pairs of `train` (module docstring), then fit
    Platt scaling on all `dev` pairs; dev Brier score and ECE measure the calibrated dev probabilities (on
    the pairs the scaling was fitted on, so they flatter it a little). Same seed, same weights on CPU.
    `on_epoch(epoch, figures)` gets each epoch's train_loss and dev_auc as soon as it ends."""
    train = checked_pairs(train, "train", ("query_id", "nugget_id", *PAIR_COLUMNS))
    dev = checked_pairs(dev, "dev", both_labels=True)
    groups = matching_groups(train, np.random.default_rng(seed), max_negatives)
    if not groups:
        raise ValueError("no covered training pairs; the matcher needs at least one (subquestion, document) match")
    dev_pairs = list(zip(dev["subquestion"], dev["text"]))
    dev_scores: list[np.ndarray] = []  # the latest epoch's dev cosines, for the Platt fit

    def score_dev(model, tokenizer) -> dict:
        dev_scores[:] = [cosines(model, tokenizer, dev_pairs, max_length=max_length, device=device,
                                 autocast_dtype=autocast_dtype, progress=progress)]
        return {"dev_auc": float(roc_auc_score(dev["label"], dev_scores[0]))}

    model, tokenizer, history = train_coverage_biencoder(
        base_model, groups, temperature=temperature, epochs=epochs, batch_size=batch_size,
        learning_rate=learning_rate, max_length=max_length, seed=seed, device=device, autocast_dtype=autocast_dtype,
        progress=progress, after_epoch=score_dev, on_epoch=on_epoch)
    scores, labels = dev_scores[0], dev["label"].to_numpy()
    calibration = PlattScaling.fit(scores, labels)
    probs = calibration(scores)
    settings = {"base_model": base_model, "temperature": temperature, "epochs": epochs, "batch_size": batch_size,
                "learning_rate": learning_rate, "max_negatives": max_negatives, "seed": seed,
                "groups": len(groups), "dev_pairs": len(dev)}
    return TrainedMatcher(model, tokenizer, calibration, float(roc_auc_score(labels, scores)), max_length, history,
                          settings, dev_brier=brier_score(labels, probs),
                          dev_ece=expected_calibration_error(labels, probs))


def save_matcher(trained: TrainedMatcher, directory: str | os.PathLike):
    return save_biencoder(trained.model, trained.tokenizer, directory, max_length=trained.max_length,
                          history=trained.history, kind=KIND,
                          settings={**trained.settings, "dev_auc": trained.dev_auc,
                                    "dev_brier": trained.dev_brier, "dev_ece": trained.dev_ece,
                                    "calibration": {"slope": trained.calibration.slope,
                                                    "intercept": trained.calibration.intercept}})


def load_matcher_scorer(directory: str | os.PathLike, *, batch_size: int = 64, device: torch.device = CPU,
                        autocast_dtype: torch.dtype | None = None, progress: Callable[[str], None] | None = None
                        ) -> Callable[[Sequence[tuple[str, str]]], np.ndarray]:
    """The saved matcher as a scorer: (subquestion, document) pairs -> coverage probabilities."""
    model, tokenizer, info = load_biencoder(directory, device)
    if info.get("kind") != KIND:
        raise ValueError(f"{directory} holds a {info.get('kind', 'plain Hugging Face')!r} model, not a {KIND!r}")
    calibration = PlattScaling(**info["training"]["calibration"])
    return lambda pairs: calibration(cosines(model, tokenizer, pairs, batch_size=batch_size,
                                             max_length=info["max_length"], device=device,
                                             autocast_dtype=autocast_dtype, progress=progress))
