"""Exact lineage of a reported number, from a report back to the ingest assets.

Each input of a materialization is resolved from the load record its step left (resources/io_manager.py:
the asset key, partition, run that wrote the stored value and the SHA-256 of the bytes read) to that
writer run's materialization of the same key and partition, whose recorded `content_sha256` must match.
Dagster's own input-event pointer (`dagster/input_event_pointer/<key>`) names the latest materialization of
the upstream key in any partition, so it is used only for materializations without load records, and
never followed into another partition. Never "the latest materialization" of an upstream asset: an
upstream rematerialized since is marked stale, and a record that leads nowhere is a gap."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

from dagster import AssetKey, AssetRecordsFilter, DagsterEventType, DagsterInstance

from covlab.resources.io_manager import CONTENT_HASH, LOAD_RECORD

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
    content_sha256: str | None = None
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
        self._observations: dict[str, list] = {}
        self._written: dict[tuple[str, str | None, str], object] = {}

    def node(self, record) -> LineageNode:
        mat = record.asset_materialization
        key, partition, tags = mat.asset_key, mat.partition, mat.tags or {}
        node = LineageNode(
            asset_key=key.to_user_string(), partition=partition, storage_id=record.storage_id, run_id=record.run_id,
            time=datetime.fromtimestamp(record.timestamp, tz=timezone.utc).isoformat(timespec="seconds"),
            data_version=tags.get("dagster/data_version"), code_version=tags.get("dagster/code_version"),
            content_sha256=_metadata_value(mat.metadata.get(CONTENT_HASH)),
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
        loads = self._loads(record)
        for upstream in sorted(versions | set(pointers) | set(loads)):
            if upstream in loads:
                node.inputs.append(self._loaded_input(upstream, loads[upstream], partition))
            else:
                node.inputs.append(self._pointed_input(upstream, pointers.get(upstream), partition))
        return node

    def _loads(self, record) -> dict[str, dict]:
        """The load records the step behind `record` left in its run: {upstream asset key: record}."""
        step = record.event_log_entry.step_key
        loads = {}
        if record.run_id not in self._observations:
            self._observations[record.run_id] = list(self.instance.get_records_for_run(
                record.run_id, of_type=DagsterEventType.ASSET_OBSERVATION).records)
        for event in self._observations[record.run_id]:
            observation = event.asset_observation
            if event.event_log_entry.step_key == step and observation and LOAD_RECORD in observation.metadata:
                load = _metadata_value(observation.metadata[LOAD_RECORD])
                loads[load["asset_key"]] = load
        return loads

    def _loaded_input(self, upstream: str, load: dict, partition: str | None) -> LineageNode:
        """The materialization a load record names: the writer run's event for that key and partition."""
        writer, read_hash = load.get("written_by_run"), load.get(CONTENT_HASH)
        if load["partition"] != partition:
            return LineageNode(upstream, load["partition"], None, run_id=writer, content_sha256=read_hash,
                               gap=f"read partition {load['partition']!r}, not this node's {partition!r}")
        if writer is None:
            return LineageNode(upstream, partition, None, content_sha256=read_hash,
                               gap="the value read has no record of the run that wrote it")
        if (upstream, partition, writer) not in self._written:
            self._written[(upstream, partition, writer)] = _materialization_in_run(
                self.instance, AssetKey.from_user_string(upstream), partition, writer)
        record = self._written[(upstream, partition, writer)]
        if record is None:
            return LineageNode(upstream, partition, None, run_id=writer, content_sha256=read_hash,
                               gap=f"run {writer} wrote the value read but recorded no materialization of it")
        node = self.node(record)
        if node.content_sha256 is not None and node.content_sha256 != read_hash:
            node.gap = (f"the bytes read (sha256 {str(read_hash)[:12]}) differ from what run {writer} "
                        f"recorded (sha256 {node.content_sha256[:12]})")
        return node

    def _pointed_input(self, upstream: str, pointer: str | None, partition: str | None) -> LineageNode:
        """For materializations without load records: Dagster's pointer, unless it leaves the partition."""
        key = AssetKey.from_user_string(upstream)
        if pointer is None:
            return LineageNode(upstream, partition, None, gap="no load record and no input event pointer recorded")
        if int(pointer) not in self._records:  # a DAG: the same upstream event is read by many assets
            self._records[int(pointer)] = _fetch(self.instance, key, int(pointer))
        record = self._records[int(pointer)]
        if record is None:
            return LineageNode(upstream, partition, int(pointer),
                               gap=f"materialization event {pointer} is not in the event log (wiped?)")
        if record.asset_materialization.partition != partition:
            return LineageNode(upstream, partition, None,
                               gap=f"no load record; Dagster's input pointer leads to partition "
                                   f"{record.asset_materialization.partition!r} (storage id {pointer}), not followed")
        return self.node(record)

    def _latest_of(self, key: AssetKey, partition: str | None):
        cache_key = (key.to_user_string(), partition)
        if cache_key not in self._latest:
            self._latest[cache_key] = _latest(self.instance, key, partition)
        return self._latest[cache_key]


def _materialization_in_run(instance: DagsterInstance, key: AssetKey, partition: str | None, run_id: str | None):
    """`key`'s materialization of `partition` in `run_id` (the latest of the partition when run_id is None),
    as an index record, or None. Only the run's time window is searched: no scan through earlier runs."""
    window = {}
    run = instance.get_run_record_by_id(run_id) if run_id else None
    if run is not None and run.start_time:
        window = {"after_timestamp": run.start_time - 1,
                  "before_timestamp": (run.end_time or datetime.now(timezone.utc).timestamp()) + 1}
    records = instance.fetch_materializations(AssetRecordsFilter(
        asset_key=key, asset_partitions=[partition] if partition else None, **window),
        limit=1 if run_id is None else 1000).records
    return next((r for r in records if run_id is None or r.run_id == run_id), None)


def audit_materialization(instance: DagsterInstance, key: AssetKey, partition: str | None,
                          run_id: str | None = None) -> LineageNode:
    """The lineage tree of `key`'s materialization in `run_id` (latest for the partition if None)."""
    record = _materialization_in_run(instance, key, partition, run_id)
    if record is not None:
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


# Metadata entry by which a report materialization names its rows in the results store.
REPORT_ID = "results_store_report_id"


def confirm_reports(instance: DagsterInstance, results) -> list[int]:
    """Confirm each pending report in the results store whose run recorded the report's materialization
    naming it (REPORT_ID); returns the ids confirmed. A report whose run died between writing its rows
    and Dagster recording the materialization stays pending, and the audit never cites it."""
    confirmed = []
    for materialization_id, record in results.pending():
        found = _materialization_in_run(instance, AssetKey.from_user_string(record.report_asset),
                                        record.partition, record.run_id)
        stored = found.asset_materialization.metadata.get(REPORT_ID) if found is not None else None
        if stored is not None and _metadata_value(stored) == materialization_id:
            results.confirm(materialization_id)
            confirmed.append(materialization_id)
    return confirmed


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
