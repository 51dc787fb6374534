"""What the materializations of a lineage (resources/lineage.py) took: wall seconds per step from the runs' event
logs, seconds on the gpu pool, the LLM calls and tokens and the training each step recorded."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

from dagster import DagsterEventType, DagsterInstance

from covlab.resources.device import GPU_POOL
from covlab.resources.lineage import LineageNode
from covlab.resources.llm import LLMUsage
from covlab.resources.materializations import TrainingSummary


def _wrap_items(head: str, items: list[str], indent: str = "    ", width: int = 110) -> list[str]:
    """`head`, then the items comma-separated, in lines of at most about `width` characters, each continued
    after `indent`; an item is never split."""
    lines, current = [], head
    for position, item in enumerate(items):
        piece = item + ("," if position < len(items) - 1 else "")
        if current not in (head, indent) and len(current) + len(piece) > width:
            lines.append(current.rstrip())
            current = indent
        current += piece + " "
    return lines + [current.rstrip()]


class StepClock:
    """Wall seconds of the steps of runs, from their event logs: a step's first STEP_START to its
    STEP_SUCCESS (retries and their waits included). One event-log query per run, cached."""

    def __init__(self, instance: DagsterInstance):
        self.instance = instance
        self._runs: dict[str, dict[str, float]] = {}

    def seconds(self, run_id: str, step_key: str) -> float | None:
        if run_id not in self._runs:
            first: dict[DagsterEventType, dict[str, float]] = {DagsterEventType.STEP_START: {},
                                                               DagsterEventType.STEP_SUCCESS: {}}
            for record in self.instance.get_records_for_run(run_id, of_type=set(first)).records:
                entry = record.event_log_entry
                if entry.step_key is not None:
                    first[entry.dagster_event_type].setdefault(entry.step_key, entry.timestamp)
            started, succeeded = first[DagsterEventType.STEP_START], first[DagsterEventType.STEP_SUCCESS]
            self._runs[run_id] = {step: succeeded[step] - started[step] for step in succeeded if step in started}
        return self._runs[run_id].get(step_key)


@dataclass
class StepCost:
    """One step of a run that materialized assets of a lineage."""

    run_id: str
    step_key: str
    assets: list[str]
    seconds: float | None  # None: the run's event log holds no STEP_START and STEP_SUCCESS of the step
    pool: str | None  # the concurrency pool of its op (GPU_POOL: a GPU step)


# What a Cost covers: a figure's branch, the whole lineage of a report, or the inputs of a running report.
SCOPES = {"branch": "this branch", "lineage": "the whole lineage", "inputs": "the report's inputs"}


@dataclass
class Cost:
    """What the materializations of a lineage took: the steps (each once), the LLM calls, the training."""

    scope: str  # a key of SCOPES
    steps: list[StepCost]
    llm: dict  # LLMUsage's counters summed, and llm_steps_without_usage (recorded an LLM, not its usage)
    training: dict  # the TrainingSummary counts summed over the trained assets (LineageNode.training)

    @property
    def seconds(self) -> float:
        return round(sum(step.seconds for step in self.steps if step.seconds is not None), 3)

    @property
    def gpu_seconds(self) -> float:
        return round(sum(step.seconds for step in self.steps if step.seconds is not None and step.pool == GPU_POOL), 3)

    def to_dict(self) -> dict:
        return {"scope": self.scope, "seconds": self.seconds, "gpu_seconds": self.gpu_seconds,
                "runs": len({step.run_id for step in self.steps}), "steps": [asdict(step) for step in self.steps],
                "steps_without_timing": sum(step.seconds is None for step in self.steps),
                "llm": dict(self.llm), "training": dict(self.training)}

    def render(self) -> str:
        runs = len({step.run_id for step in self.steps})
        untimed = sum(step.seconds is None for step in self.steps)
        lines = [f"cost of {SCOPES[self.scope]}: {self.seconds:.1f} s wall in {len(self.steps)} steps of {runs} "
                 f"run{'s' if runs != 1 else ''}, {self.gpu_seconds:.1f} s of it on the {GPU_POOL} pool"
                 + (f" ({untimed} steps without timing in the event log)" if untimed else "")]
        training = ", ".join(f"{self.training[name]:,} {name}" for name in TrainingSummary.__dataclass_fields__
                             if name in self.training) or "none"
        lines.append(f"  LLM: {self._llm_text()}; training: {training}")
        per_step = [f"{step.step_key} " + (f"{step.seconds:.1f} s" if step.seconds is not None else "? s")
                    + (f" ({step.pool} pool)" if step.pool else "")  # the pool, not the device it ran on
                    for step in sorted(self.steps, key=lambda s: -(s.seconds or 0.0))]
        return "\n".join(lines + _wrap_items("  per step: ", per_step))

    def _llm_text(self) -> str:
        llm, parts = self.llm, []
        if llm["sent"] or llm["cached"]:
            tokens = f"{llm['prompt_tokens']:,} prompt + {llm['completion_tokens']:,} completion tokens"
            if llm["answers_without_usage"]:
                tokens = (f"{tokens} ({llm['answers_without_usage']:,} answers reported no token usage)"
                          if llm["prompt_tokens"] or llm["completion_tokens"] else "tokens not reported")
            parts.append(f"{llm['sent']:,} requests sent, {llm['cached']:,} answers from the cache, {tokens}")
        if llm["llm_steps_without_usage"]:
            parts.append(f"{llm['llm_steps_without_usage']} LLM steps that recorded no usage")
        return " and ".join(parts) or "no calls"


def lineage_cost(instance: DagsterInstance, nodes: Iterable[LineageNode], scope: str = "lineage",
                 clock: StepClock | None = None) -> Cost:
    """The cost of the materializations among `nodes` (each counted once; gaps cost nothing): wall seconds
    per step, a step that materialized several of them (a multi-asset) counted once per (run, step); the
    pool of each step as its run recorded its op (LineageNode.pool); the LLM usage and training the nodes
    recorded. `clock` caches event-log reads across calls."""
    clock = clock or StepClock(instance)
    steps: dict[tuple[str, str], StepCost] = {}
    llm = {**asdict(LLMUsage()), "llm_steps_without_usage": 0}
    training: dict[str, int] = {}
    counted: set[int] = set()
    for node in nodes:
        if node.storage_id is None or node.storage_id in counted or node.run_id is None or node.step_key is None:
            continue
        counted.add(node.storage_id)
        step = steps.get((node.run_id, node.step_key))
        if step is None:
            seconds = clock.seconds(node.run_id, node.step_key)
            step = steps[(node.run_id, node.step_key)] = StepCost(
                node.run_id, node.step_key, [], round(seconds, 3) if seconds is not None else None, node.pool)
        step.assets.append(node.asset_key)
        if node.llm_usage:
            for name in asdict(LLMUsage()):
                llm[name] += node.llm_usage.get(name) or 0
        elif "llm" in node.shaped_by:
            llm["llm_steps_without_usage"] += 1
        for name, count in node.training.items():
            training[name] = training.get(name, 0) + count
    return Cost(scope, list(steps.values()), llm, training)
