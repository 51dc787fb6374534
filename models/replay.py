"""The decisions a selection on estimated coverage took at each budget (models/trust.py `trusting`: whether the
estimator gate sent it back to its fallback order, and the blend weight chosen on the tune split), as a record
that travels with the estimator's registered version, and the rule by which a served selection replays them at
any budget: the evaluated budget's own decision; at a budget the evaluation never tuned, the decision of the
nearest tuned budget of the same unit; with no tuned budget of that unit, the fallback order. Each served
selection says which of these it applied.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

from covlab.models.registry import SelectorSettings
from covlab.models.selectors import Budget
from covlab.models.trust import Decision


def budget_key(budget: Budget) -> str:
    """A budget as the records name it: `k=10`, `tokens=256`."""
    return f"{budget.unit}={budget.limit}"


def _parsed(key: str) -> tuple[str, int]:
    """(unit, limit) of a `budget_key`."""
    unit, _, limit = key.partition("=")
    return unit, int(limit)


@dataclass(frozen=True)
class BudgetDecision:
    """What one selection decided at one budget: `fell_back` (the estimator gate sent it to its fallback order,
    `estimator_gate` says why) or the `blend_weight` of the estimate against that order (None: the selector
    unblended)."""
    fell_back: bool
    estimator_gate: str
    blend_weight: float | None = None

    @classmethod
    def of(cls, decision: Decision) -> BudgetDecision:
        return cls(decision.fell_back, decision.estimator_gate,
                   None if decision.blend is None else float(decision.blend.weight))


@dataclass(frozen=True)
class Replayed:
    """The decision a served selection applies at a budget and why: `rule` is `evaluated` (the budget's own),
    `nearest` (the nearest tuned budget of the unit, `chosen_for`) or `fallback` (nothing tuned: the fallback
    order, `reason` says so)."""
    decision: BudgetDecision
    rule: str
    chosen_for: str | None
    reason: str


@dataclass(frozen=True)
class RecordedDecisions:
    """A method's decisions by budget key (`budget_key`), k and token budgets alike, and the settings its
    selector was built with (tau, lambda, the gate's threshold; None: none recorded)."""
    budgets: Mapping[str, BudgetDecision]
    settings: SelectorSettings | None = None

    @classmethod
    def of_run(cls, decisions: Mapping[int, Decision], unit: str, settings: SelectorSettings) -> RecordedDecisions:
        """The record of a run's decisions at budgets of `unit` (models/runs.py MethodRun.decisions, by limit)."""
        return cls({budget_key(Budget(**{unit: limit})): BudgetDecision.of(d) for limit, d in decisions.items()},
                   settings)

    @classmethod
    def from_json(cls, text: str | None) -> RecordedDecisions:
        """A record as `to_json` wrote it; None or empty: no decision recorded."""
        if not text:
            return cls({})
        found = json.loads(text)
        return cls({key: BudgetDecision(bool(v["fell_back"]), str(v["estimator_gate"]),
                                        None if v.get("blend_weight") is None else float(v["blend_weight"]))
                    for key, v in found["budgets"].items()},
                   SelectorSettings(**found["settings"]) if found.get("settings") else None)

    def to_json(self) -> str:
        return json.dumps({"budgets": {key: asdict(d) for key, d in sorted(self.budgets.items())},
                           "settings": None if self.settings is None else asdict(self.settings)}, sort_keys=True)

    def merged(self, other: RecordedDecisions) -> RecordedDecisions:
        """Both records; `other`'s decision (and settings, when it has them) where both hold one."""
        return RecordedDecisions({**self.budgets, **other.budgets}, other.settings or self.settings)

    def of_unit(self, unit: str) -> RecordedDecisions:
        """The decisions at the budgets of `unit` ("k" or "tokens")."""
        return RecordedDecisions({k: d for k, d in self.budgets.items() if _parsed(k)[0] == unit}, self.settings)

    def at(self, budget: Budget) -> Replayed:
        """The decision a selection at `budget` replays (module docstring)."""
        key = budget_key(budget)
        if key in self.budgets:
            return Replayed(self.budgets[key], "evaluated", key, f"the decision the evaluation took at {key}")
        same = sorted((abs(_parsed(k)[1] - budget.limit), _parsed(k)[1], k) for k in self.of_unit(budget.unit).budgets)
        if same:
            nearest = same[0][2]
            return Replayed(self.budgets[nearest], "nearest", nearest,
                            f"{key} was never evaluated: the decision of the nearest evaluated budget, {nearest}")
        reason = (f"no {budget.unit} budget was evaluated with this estimator version (evaluated: "
                  f"{', '.join(sorted(self.budgets)) or 'none'}): the fallback order, relevance")
        return Replayed(BudgetDecision(True, reason), "fallback", None, reason)

    def replay(self, source: str) -> Callable[[Budget], tuple[float | None, str]]:
        """The blend weight a selection at a budget replays from this record of dataset `source`'s selections
        (EstimateTrust.replay; `at` picks the budget's decision), with the rule that gave it. A decision that fell
        back replays as weight 0: the fallback order itself."""
        def at(budget: Budget) -> tuple[float | None, str]:
            replayed = self.at(budget)
            weight = 0.0 if replayed.decision.fell_back else replayed.decision.blend_weight
            return weight, f"replayed from {source}'s selections: {replayed.reason}"
        return at
