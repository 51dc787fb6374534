"""Champion promotion of a trained selector's MLflow model versions: a new candidate version takes the
`champion` alias iff it passes its gate and its dev score is at least the current champion's."""

from __future__ import annotations

import math
from typing import NamedTuple

from covlab.models.trust import Trust

PROMOTE, ALREADY_CHAMPION, STAYS_CANDIDATE, GATED = "promote", "already champion", "stays candidate", "gated"


class Promotion(NamedTuple):
    """The decision for one candidate: `action` (one of the four above), whether the candidate is champion
    once the decision is carried out, and why, in words (for metadata and logs)."""
    action: str
    champion: bool
    reason: str


def promotion_decision(candidate_version: int, dev_score: float, champion_version: int | None,
                       champion_score: float | None, gate: Trust | None = None,
                       score_name: str = "dev score") -> Promotion:
    """The promotion rule [chosen]: a candidate that fails its `gate` (the coverage estimator's:
    `estimator_trusted`; the LMVU ranker's: `ranker_trusted`; None: no gate) is not promoted; one that
    already holds the alias stays champion; one scoring below the champion's `champion_score` stays candidate;
    otherwise (no champion yet, a champion without a recorded score, or a score >= the champion's) it is
    promoted."""
    if gate is not None and not gate.trusted:
        return Promotion(GATED, False, f"is not promoted to champion: {gate.reason}")
    if champion_version is not None and champion_version == candidate_version:
        return Promotion(ALREADY_CHAMPION, True, f"is already champion ({score_name} {dev_score:.4f})")
    if champion_score is not None and dev_score < champion_score:
        return Promotion(STAYS_CANDIDATE, False, f"stays candidate: {score_name} {dev_score:.4f} < champion "
                                                 f"v{champion_version} {champion_score:.4f}")
    was = "none" if champion_version is None else (
        f"v{champion_version} " + ("without a score" if champion_score is None else f"{champion_score:.4f}"))
    return Promotion(PROMOTE, True, f"promoted to champion ({score_name} {dev_score:.4f}; previous champion: {was})")


def ranker_trusted(top1_accuracy: float, chance: float) -> Trust:
    """The LMVU ranker's gate [chosen]: a ranker is promoted only when its held-out top-1 accuracy on the
    tune split's sampled states (models/lmvu.heldout_top1_accuracy) is above the chance rate of the same
    states; at or below chance (or when either is not a number) its order is no better than a random pick."""
    if not (math.isfinite(top1_accuracy) and math.isfinite(chance)):
        return Trust(False, f"dev top-1 accuracy {top1_accuracy!r} against chance {chance!r} is not a figure; "
                            "the ranker cannot be judged")
    if top1_accuracy <= chance:
        return Trust(False, f"dev top-1 accuracy {top1_accuracy:.4f} <= chance {chance:.4f}: the ranker picks the "
                            "best candidate no more often than a random pick")
    return Trust(True, f"dev top-1 accuracy {top1_accuracy:.4f} > chance {chance:.4f}")
