"""Exact lineage of a reported number: walk the input-event pointers Dagster records on every
materialization (`dagster/input_event_pointer/<key>` = the storage id of the upstream event that was
read), from a report back to the ingest assets. Never "the latest materialization" of an upstream asset:
an upstream rematerialized since is marked stale, and a pointer that leads nowhere is a gap."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

from dagster import AssetKey, AssetRecordsFilter, DagsterInstance

POINTER = "dagster/input_event_pointer/"
INPUT_VERSION = "dagster/input_data_version/"
# Metadata entries that say what shaped a materialization (recorded by the assets).
SHAPING = ("config", "settings", "format", "path", "source_files", "model_uri", "model_name", "model_version",
           "mlflow_run_id", "llm", "prompt_version")


@dataclass
class LineageNode:
    asset_key: str
    partition: str | None
    storage_id: int | None
    run_id: str | None = None
    time: str | None = None
    data_version: str | None = None
    code_version: str | None = None
    shaped_by: dict = field(default_factory=dict)
    stale: str | None = None  # why the number may be out of date: a newer materialization of this asset
    gap: str | None = None  # a record that should exist and does not
    repeated: bool = False  # already shown above (the graph is a DAG)
    inputs: list["LineageNode"] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _metadata_value(value):
    raw = getattr(value, "value", value)
    if isinstance(raw, (dict, list, str, int, float, bool)) or raw is None:
        return raw
    return str(raw)


def _fetch(instance: DagsterInstance, key: AssetKey, storage_id: int):
    records = instance.fetch_materializations(AssetRecordsFilter(asset_key=key, storage_ids=[storage_id]),
                                              limit=1).records
    return records[0] if records else None


def _latest(instance: DagsterInstance, key: AssetKey, partition: str | None):
    records = instance.fetch_materializations(AssetRecordsFilter(
        asset_key=key, asset_partitions=[partition] if partition else None), limit=1).records
    return records[0] if records else None


class LineageWalker:
    """Audits materialization events; memoises nodes by storage id so shared ancestors are read once."""

    def __init__(self, instance: DagsterInstance):
        self.instance = instance
        self._seen: set[int] = set()
        self._records: dict[int, object] = {}
        self._latest: dict[tuple[str, str | None], object] = {}

    def node(self, record) -> LineageNode:
        mat = record.asset_materialization
        key, partition, tags = mat.asset_key, mat.partition, mat.tags or {}
        node = LineageNode(
            asset_key=key.to_user_string(), partition=partition, storage_id=record.storage_id, run_id=record.run_id,
            time=datetime.fromtimestamp(record.timestamp, tz=timezone.utc).isoformat(timespec="seconds"),
            data_version=tags.get("dagster/data_version"), code_version=tags.get("dagster/code_version"),
            shaped_by={k: _metadata_value(mat.metadata[k]) for k in SHAPING if k in mat.metadata})
        latest = self._latest_of(key, partition)
        if latest is not None and latest.storage_id != record.storage_id:
            node.stale = (f"rematerialized since: storage id {latest.storage_id}, run {latest.run_id}, data version "
                          f"{(latest.asset_materialization.tags or {}).get('dagster/data_version')}")
        if record.storage_id in self._seen:
            node.repeated = True
            return node
        self._seen.add(record.storage_id)
        pointers = {t[len(POINTER):]: v for t, v in tags.items() if t.startswith(POINTER)}
        versions = {t[len(INPUT_VERSION):] for t in tags if t.startswith(INPUT_VERSION)}
        for upstream in sorted(versions | set(pointers)):
            node.inputs.append(self._input(upstream, pointers.get(upstream), partition))
        return node

    def _input(self, upstream: str, pointer: str | None, partition: str | None) -> LineageNode:
        key = AssetKey.from_user_string(upstream)
        if pointer is None:
            return LineageNode(upstream, partition, None, gap="no input event pointer recorded")
        if int(pointer) not in self._records:  # a DAG: the same upstream event is read by many assets
            self._records[int(pointer)] = _fetch(self.instance, key, int(pointer))
        record = self._records[int(pointer)]
        if record is None:
            return LineageNode(upstream, partition, int(pointer),
                               gap=f"materialization event {pointer} is not in the event log (wiped?)")
        return self.node(record)

    def _latest_of(self, key: AssetKey, partition: str | None):
        cache_key = (key.to_user_string(), partition)
        if cache_key not in self._latest:
            self._latest[cache_key] = _latest(self.instance, key, partition)
        return self._latest[cache_key]


def audit_materialization(instance: DagsterInstance, key: AssetKey, partition: str | None,
                          run_id: str | None = None) -> LineageNode:
    """The lineage tree of `key`'s materialization in `run_id` (latest for the partition if None)."""
    window = {}
    run = instance.get_run_record_by_id(run_id) if run_id else None
    if run is not None and run.start_time:  # only the run's time window: no scan through earlier reports
        window = {"after_timestamp": run.start_time - 1,
                  "before_timestamp": (run.end_time or datetime.now(timezone.utc).timestamp()) + 1}
    records = instance.fetch_materializations(AssetRecordsFilter(
        asset_key=key, asset_partitions=[partition] if partition else None, **window),
        limit=1 if run_id is None else 1000).records
    for record in records:
        if run_id is None or record.run_id == run_id:
            return LineageWalker(instance).node(record)
    return LineageNode(key.to_user_string(), partition, None,
                       gap=f"no materialization of {key.to_user_string()} [{partition}]"
                           + (f" in run {run_id}" if run_id else ""))


def audit_inputs(instance: DagsterInstance, keys: list[AssetKey], partition: str) -> list[LineageNode]:
    """Lineage of what a running asset reads: each input's latest materialization of the partition."""
    walker, nodes = LineageWalker(instance), []
    for key in sorted(keys, key=lambda k: k.to_user_string()):
        record = _latest(instance, key, partition)
        nodes.append(walker.node(record) if record else LineageNode(key.to_user_string(), partition, None,
                                                                     gap="never materialized"))
    return nodes


def _flags(node: LineageNode) -> str:
    return "".join([f"  STALE ({node.stale})" if node.stale else "", f"  GAP ({node.gap})" if node.gap else "",
                    "  (shown above)" if node.repeated else ""])


def _summary(node: LineageNode) -> str:
    if node.storage_id is None and node.gap:
        return f"{node.asset_key} [{node.partition}]"
    return (f"{node.asset_key} [{node.partition}] run {node.run_id} at {node.time} storage {node.storage_id} "
            f"data {node.data_version} code {node.code_version}")


def _shaping_lines(node: LineageNode) -> list[str]:
    if node.repeated:
        return []
    return [f"{name}: {json.dumps(value, sort_keys=True, default=str)}" for name, value in node.shaped_by.items()]


def render_text(nodes: list[LineageNode]) -> str:
    lines: list[str] = []

    def walk(node: LineageNode, prefix: str, last: bool, root: bool) -> None:
        branch = "" if root else ("└─ " if last else "├─ ")
        lines.append(prefix + branch + _summary(node) + _flags(node))
        child_prefix = prefix + ("" if root else ("   " if last else "│  "))
        for line in _shaping_lines(node):
            lines.append(child_prefix + ("│  " if node.inputs else "   ") + "· " + line)
        for i, child in enumerate(node.inputs):
            walk(child, child_prefix, i == len(node.inputs) - 1, False)

    for node in nodes:
        walk(node, "", True, True)
    return "\n".join(lines)


def render_markdown(nodes: list[LineageNode]) -> str:
    lines: list[str] = []

    def walk(node: LineageNode, depth: int) -> None:
        lines.append("  " * depth + f"- `{_summary(node)}`{_flags(node)}")
        for line in _shaping_lines(node):
            lines.append("  " * (depth + 1) + f"- {line}")
        for child in node.inputs:
            walk(child, depth + 1)

    for node in nodes:
        walk(node, 0)
    return "\n".join(lines)


def render_json(nodes: list[LineageNode]) -> str:
    return json.dumps([n.to_dict() for n in nodes], indent=2, sort_keys=True, default=str)


def audit_figures(instance: DagsterInstance, figures) -> list[dict]:
    """For stored report figures (a results-store frame), one audit per report materialization that
    produced them: {"figures": [...], "lineage": LineageNode}, in the frame's order."""
    audits: dict[tuple, dict] = {}
    for row in figures.itertuples(index=False):
        source = (row.run_id, row.report_asset, row.partition)
        if source not in audits:
            audits[source] = {"figures": [], "lineage": audit_materialization(
                instance, AssetKey.from_user_string(row.report_asset), row.partition, row.run_id)}
        audits[source]["figures"].append({k: (None if _missing(v) else v) for k, v in row._asdict().items()
                                          if k in ("dataset", "method", "budget", "k", "split", "metric",
                                                   "query_id", "value", "materialization_id")})
    return list(audits.values())


def _missing(value) -> bool:
    try:
        return value is None or value != value or str(value) == "<NA>"
    except (TypeError, ValueError):
        return False
