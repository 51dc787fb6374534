"""Exact lineage of a reported number, from a report back to the ingest assets.

Each input of a materialization is resolved from the load record its step left (resources/io_manager.py:
the asset key, partition, run that wrote the stored value and the SHA-256 of the bytes read) to that
writer run's materialization of the same key and partition, whose recorded `content_sha256` must match.
Dagster's own input-event pointer (`dagster/input_event_pointer/<key>`) names the latest materialization of
the upstream key in any partition, so it is used only for materializations without load records, and
never followed into another partition. Never "the latest materialization" of an upstream asset: an
upstream rematerialized since with other content (another data version: a content hash) is marked stale,
and a record that leads nowhere is a gap."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone

import numpy as np
import pandas as pd
from dagster import AssetKey, AssetRecordsFilter, AssetsDefinition, DagsterEventType, DagsterInstance, MetadataValue

from covlab.resources.datasets import source_file_changes
from covlab.resources.device import GPU_POOL
from covlab.resources.io_manager import CONTENT_HASH, LOAD_RECORD, LOADED_VERSION
from covlab.resources.llm import LLMUsage
from covlab.resources.source import RUNTIME_METADATA, SOURCE_METADATA
from covlab.resources.model_store import WEIGHTS_HASH, WEIGHTS_METADATA, weights_change

POINTER = "dagster/input_event_pointer/"
# The pointer Dagster records for an upstream asset that had no materialization at all when the step ran (a
# dependency that passes no data, e.g. `deps=[...]`), with input data version "INITIAL".
NEVER_MATERIALIZED = "NULL"
# Provenance tags Dagster records on every materialization (its data-version bookkeeping): one home for the
# audit and reproduce.
CODE_VERSION_TAG, DATA_VERSION_TAG = "dagster/code_version", "dagster/data_version"
INPUT_VERSION = "dagster/input_data_version/"  # + the upstream asset key, as a user string
# Metadata entries that say what shaped a materialization (recorded by the assets).
SHAPING = ("config", "settings", "format", "path", "source_files", "model_uri", "model_name", "model_version",
           "mlflow_run_id", WEIGHTS_METADATA, "llm", "prompt_version", SOURCE_METADATA, RUNTIME_METADATA)
# Metadata entries of a report materialization (record_report_lineage): which of its inputs produced each
# method's rows, {method: [asset key, ...]}, and the cost of the lineage of its inputs (Cost.to_dict()).
METHOD_INPUTS = "method_inputs"
COST = "cost"
# Metadata entries of a selection on estimated coverage (models/trust.py Decision, models/runs.py MethodRun):
# the estimator gate, whether it fell back to relevance order, and the blend weight chosen on the tune split
# (a k selection: `blend` is its evidence; a budgeted one: {budget: evidence}).
DECISIONS = ("estimator_gate", "fell_back", "blend")
LLM_USAGE = "llm_usage"  # an LLM step's share of LLMResource.take_usage()


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
    read_version: str | None = None  # content version of the value its consumer read (load record), if any
    shaped_by: dict = field(default_factory=dict)
    step_key: str | None = None  # the step of run_id that materialized it (one step may materialize several)
    method_inputs: dict | None = None  # a report's METHOD_INPUTS
    llm_usage: dict | None = None  # what the step's LLM calls took (LLM_USAGE)
    training: dict = field(default_factory=dict)  # a trained asset's TrainingSummary counts (_training)
    decisions: dict = field(default_factory=dict)  # a selection's gate and blend choice (DECISIONS)
    stale: str | None = None  # why the number may be out of date: a newer materialization of this asset
    gap: str | None = None  # a record that should exist and does not
    changed: str | None = None  # the files it recorded differ on disk now (mark_changed: `covlab audit` only)
    repeated: bool = False  # already shown above (the graph is a DAG)
    inputs: list["LineageNode"] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def plain(value):
    """`value` as JSON holds it: numpy scalars as Python numbers; missing values (None, NaN, pandas NA and NaT)
    and infinities as None; dicts and lists element by element."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or value is pd.NA or value is pd.NaT:
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def metadata_value(value):
    """A Dagster metadata entry's value as plain JSON data (other kinds as their text)."""
    raw = getattr(value, "value", value)
    if isinstance(raw, (dict, list, str, int, float, bool)) or raw is None:
        return plain(raw)
    return str(raw)


TRAINING = "training"  # metadata entry of a trained asset: what its training took (TrainingSummary)


@dataclass(frozen=True)
class TrainingSummary:
    """What a trained asset's training took, as its materialization records it (TRAINING) and the cost of a
    lineage sums it: the models trained (per fold and variant, each counts), the epochs run over all of them,
    the training pairs and the contrastive training groups."""
    models: int = 1
    epochs: int = 0
    pairs: int = 0
    groups: int = 0

    def to_dict(self) -> dict:
        return {name: count for name, count in asdict(self).items() if count}


def _training(metadata: Mapping) -> dict:
    """The TrainingSummary a trained asset recorded (TRAINING), its non-zero counts; {} for other assets."""
    recorded = metadata_value(metadata[TRAINING]) if TRAINING in metadata else None
    if not isinstance(recorded, dict):
        return {}
    return TrainingSummary(**{k: int(v) for k, v in recorded.items()
                              if k in TrainingSummary.__dataclass_fields__}).to_dict()


def materialization_by_id(instance: DagsterInstance, key: AssetKey, storage_id: int):
    """The index record of `key`'s materialization event `storage_id`, or None (not in the event log)."""
    records = instance.fetch_materializations(AssetRecordsFilter(asset_key=key, storage_ids=[storage_id]),
                                              limit=1).records
    return records[0] if records else None


def latest_materialization(instance: DagsterInstance, key: AssetKey, partition: str | None):
    """The index record of `key`'s latest materialization (of `partition`, when given), or None."""
    records = instance.fetch_materializations(AssetRecordsFilter(
        asset_key=key, asset_partitions=[partition] if partition else None), limit=1).records
    return records[0] if records else None


def recorded_entry(instance: DagsterInstance, key: AssetKey, partition: str | None, name: str):
    """The `name` metadata entry of `key`'s latest materialization of `partition` (the value a step reads) as
    plain JSON data, or None when there is no materialization or no such entry."""
    record = latest_materialization(instance, key, partition)
    entry = record.asset_materialization.metadata.get(name) if record else None
    return None if entry is None else metadata_value(entry)


def settings_mismatches(instance: DagsterInstance, keys: Iterable[AssetKey], partition: str | None,
                        settings: Mapping) -> list[str]:
    """The inputs among `keys` whose latest materialization of `partition` (the value a step reads) recorded
    evaluation settings (its `settings` metadata) that differ from `settings` in a setting both name, each as
    "<key> [<partition>] was made with <setting>=<value> (this run: <value>), ...". Inputs that record no
    settings are not judged."""
    found = []
    for key in sorted(keys, key=lambda k: k.to_user_string()):
        recorded = recorded_entry(instance, key, partition, "settings")
        if not isinstance(recorded, dict):
            continue
        differ = [f"{name}={json.dumps(recorded[name])} (this run: {json.dumps(plain(value))})"
                  for name, value in sorted(settings.items()) if name in recorded and recorded[name] != plain(value)]
        if differ:
            found.append(f"{key.to_user_string()} [{partition}] was made with {', '.join(differ)}")
    return found


class LineageWalker:
    """Audits materialization events; memoises nodes by storage id so shared ancestors are read once."""

    def __init__(self, instance: DagsterInstance):
        self.instance = instance
        self._seen: set[int] = set()
        self._records: dict[int, object] = {}
        self._latest: dict[tuple[str, str | None], object] = {}
        self._written: dict[tuple[str, str | None, str], object] = {}

    def node(self, record) -> LineageNode:
        mat = record.asset_materialization
        key, partition, tags = mat.asset_key, mat.partition, mat.tags or {}
        node = LineageNode(
            asset_key=key.to_user_string(), partition=partition, storage_id=record.storage_id, run_id=record.run_id,
            time=datetime.fromtimestamp(record.timestamp, tz=timezone.utc).isoformat(timespec="seconds"),
            data_version=tags.get(DATA_VERSION_TAG), code_version=tags.get(CODE_VERSION_TAG),
            content_sha256=metadata_value(mat.metadata.get(CONTENT_HASH)),
            shaped_by={k: metadata_value(mat.metadata[k]) for k in SHAPING if k in mat.metadata},
            step_key=record.event_log_entry.step_key,
            method_inputs=metadata_value(mat.metadata[METHOD_INPUTS]) if METHOD_INPUTS in mat.metadata else None,
            llm_usage=metadata_value(mat.metadata[LLM_USAGE]) if LLM_USAGE in mat.metadata else None,
            training=_training(mat.metadata),
            decisions={k: metadata_value(mat.metadata[k]) for k in DECISIONS if k in mat.metadata})
        latest = self._latest_of(key, partition)
        latest_version = (latest.asset_materialization.tags or {}).get(DATA_VERSION_TAG) if latest else None
        if latest is not None and latest.storage_id != record.storage_id and latest_version != node.data_version:
            node.stale = (f"rematerialized since with other content: storage id {latest.storage_id}, run "
                          f"{latest.run_id}, data version {latest_version}")
        if record.storage_id in self._seen:
            node.repeated = True
            return node
        self._seen.add(record.storage_id)
        pointers = {t[len(POINTER):]: v for t, v in tags.items() if t.startswith(POINTER)}
        versions = {t[len(INPUT_VERSION):] for t in tags if t.startswith(INPUT_VERSION)}
        loads = self._loads(record)
        for upstream in sorted(versions | set(pointers) | set(loads)):
            if upstream not in loads and pointers.get(upstream) == NEVER_MATERIALIZED:
                continue  # a dependency without data, never materialized before this step ran: nothing was read
            if upstream in loads:
                node.inputs.append(self._loaded_input(upstream, loads[upstream], partition))
            else:
                node.inputs.append(self._pointed_input(upstream, pointers.get(upstream), partition))
        return node

    @staticmethod
    def _loads(record) -> dict[str, dict]:
        """The load records the step behind `record` left on it: {upstream asset key: record}."""
        metadata = record.asset_materialization.metadata
        return {load["asset_key"]: load for load in metadata_value(metadata[LOAD_RECORD])} \
            if LOAD_RECORD in metadata else {}

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
        node.read_version = load.get(LOADED_VERSION)
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
            self._records[int(pointer)] = materialization_by_id(self.instance, key, int(pointer))
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
            self._latest[cache_key] = latest_materialization(self.instance, key, partition)
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
        record = latest_materialization(instance, key, partition)
        nodes.append(walker.node(record) if record else LineageNode(key.to_user_string(), partition, None,
                                                                     gap="never materialized"))
    return nodes


def disk_changes(node: LineageNode) -> list[str]:
    """What differs between the files a materialization recorded and those on disk now, one line each: its
    dataset source files (ingest: `path` and `source_files`, each against its SHA-256) and its model weights
    (`weights`: the local folder against the content hash registered). Reads and hashes those files."""
    shaped = node.shaped_by
    files, weights = shaped.get("source_files"), shaped.get(WEIGHTS_METADATA)
    changes = []
    if isinstance(files, dict) and isinstance(shaped.get("path"), str):
        changes += source_file_changes(shaped["path"], files)
    if isinstance(weights, dict) and weights.get("path") and weights.get(WEIGHTS_HASH):
        change = weights_change(weights["path"], weights[WEIGHTS_HASH])
        changes += [change] if change else []
    return changes


def mark_changed(roots: Iterable[LineageNode]) -> None:
    """Set `changed` on every node (each occurrence) of the trees `roots` whose recorded files differ on disk now
    (disk_changes): a dataset file edited since ingest, weights rewritten since registration. Each distinct set of
    files is hashed once."""
    found: dict[str, list[str]] = {}
    stack = list(roots)
    while stack:
        node = stack.pop()
        stack.extend(node.inputs)
        files = json.dumps([node.shaped_by.get(k) for k in ("path", "source_files", WEIGHTS_METADATA)],
                           sort_keys=True, default=str)
        if files not in found:
            found[files] = disk_changes(node)
        if found[files]:
            node.changed = "; ".join(found[files][:3]) + (f" (and {len(found[files]) - 3} more)"
                                                          if len(found[files]) > 3 else "")


def _flags(node: LineageNode) -> str:
    return "".join([f"  STALE ({node.stale})" if node.stale else "", f"  GAP ({node.gap})" if node.gap else "",
                    f"  CHANGED ({node.changed})" if node.changed else "", "  (shown above)" if node.repeated else ""])


def _name(node: LineageNode) -> str:
    return node.asset_key if node.partition is None else f"{node.asset_key} [{node.partition}]"


def _summary(node: LineageNode) -> str:
    """Every identifier of the node that is known (a gap has few), none that is missing."""
    known = [f"{label} {value}" for label, value in (("run", node.run_id), ("at", node.time),
                                                     ("storage", node.storage_id), ("data", node.data_version),
                                                     ("code", node.code_version)) if value is not None]
    return " ".join([_name(node), *known])


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


# Metadata entry by which a report materialization names its rows in the results store.
REPORT_ID = "results_store_report_id"


def report_id_entry(materialization_id: int) -> MetadataValue:
    """The REPORT_ID entry of a report's materialization: text, not a number, so that the UI's Plots tab does not
    chart an id as if it were a figure."""
    return MetadataValue.text(str(materialization_id))


def confirm_reports(instance: DagsterInstance, results) -> list[int]:
    """Confirm each pending report in the results store whose run recorded the report's materialization
    naming it (REPORT_ID); returns the ids confirmed. A report whose run died between writing its rows
    and Dagster recording the materialization stays pending, and the audit never cites it."""
    confirmed = []
    for materialization_id, record in results.pending():
        found = _materialization_in_run(instance, AssetKey.from_user_string(record.report_asset),
                                        record.partition, record.run_id)
        stored = found.asset_materialization.metadata.get(REPORT_ID) if found is not None else None
        if stored is not None and str(metadata_value(stored)) == str(materialization_id):
            results.confirm(materialization_id)
            confirmed.append(materialization_id)
    return confirmed


def audit_figures(instance: DagsterInstance, figures) -> list[dict]:
    """For stored report figures (a results-store frame), one audit per report materialization that
    produced them, in the frame's order: {"figures": [...] (plain values, None where missing), "lineage":
    LineageNode (files changed on disk marked: mark_changed), "branch": report_branch(lineage, the figures'
    methods)}."""
    audits: dict[tuple, dict] = {}
    for row in figures.itertuples(index=False):
        source = (row.run_id, row.report_asset, row.partition)
        if source not in audits:
            audits[source] = {"figures": [], "lineage": audit_materialization(
                instance, AssetKey.from_user_string(row.report_asset), row.partition, row.run_id)}
        audits[source]["figures"].append({k: plain(v) for k, v in row._asdict().items()
                                          if k in ("dataset", "method", "budget", "k", "split", "metric",
                                                   "query_id", "value", "materialization_id")})
    for audit in audits.values():
        mark_changed([audit["lineage"]])
        audit["branch"] = report_branch(audit["lineage"], {f["method"] for f in audit["figures"]})
    return list(audits.values())


def report_branch(report: LineageNode, methods: Iterable[str]) -> LineageNode | None:
    """`report` with only the inputs that produced the rows of `methods`, as its materialization recorded
    them (METHOD_INPUTS); None when it recorded none, or none for one of the methods."""
    recorded = report.method_inputs
    if not isinstance(recorded, dict) or any(method not in recorded for method in methods):
        return None
    keys = {key for method in methods for key in recorded[method]}
    return replace(report, inputs=[node for node in report.inputs if node.asset_key in keys])


def selection_decisions(branch: LineageNode | None, method: str, budget: int | None) -> str | None:
    """In words, what decided the selections behind a figure of `method` (at `budget`, for a budgeted one): the
    estimator gate and either the fall back to relevance order or the blend weight chosen on the tune split, with
    the tune split's score of that weight and of the fallback order (weight 0); None when the figure's selection
    recorded no decision (a method not on estimated coverage) or the report recorded no method_inputs."""
    if branch is None:
        return None
    keys = set((branch.method_inputs or {}).get(method, []))
    decided = next((node.decisions for node in branch.inputs if node.asset_key in keys and node.decisions), None)
    if decided is None:
        return None
    words = [f"estimator gate: {decided.get('estimator_gate')}"]
    blend = decided.get("blend")
    if isinstance(blend, dict) and "weight" not in blend:  # a budgeted selection: one choice per budget
        blend = blend.get(str(budget))
    if decided.get("fell_back"):
        words.append("fell back to relevance order")
    elif isinstance(blend, dict):
        words.append(f"blend weight {blend['weight']:g} with relevance order, chosen on {blend['split']} "
                     f"(n={blend['queries']}) by {blend['metric']}: {blend['chosen_score']:.3f} vs "
                     f"{blend['fallback_score']:.3f} for the fallback order")
    return "; ".join(words)


def _identity(node: LineageNode) -> tuple:
    """A materialization is its storage id; a gap (no event) is what is missing."""
    if node.storage_id is not None:
        return ("materialization", node.storage_id)
    return ("gap", node.asset_key, node.partition, node.gap)


class _Index:
    """Every node of some lineage trees once, by identity: the occurrence the walker expanded (its inputs
    filled in; the others are marked repeated), with a gap found at any occurrence (a content-hash mismatch
    is found where a value is read)."""

    def __init__(self, roots: Iterable[LineageNode]):
        self.nodes: dict[tuple, LineageNode] = {}
        self.gaps: dict[tuple, str] = {}
        stack = list(roots)
        while stack:
            node = stack.pop()
            key = _identity(node)
            if key not in self.nodes or (self.nodes[key].repeated and not node.repeated):
                self.nodes[key] = node
            if node.gap:
                self.gaps.setdefault(key, node.gap)
            stack.extend(node.inputs)

    def spanning_tree(self, root: LineageNode) -> tuple[LineageNode, list]:
        """(node, [subtrees]) from `root`, depth first: each node under the first input edge that reaches it."""
        seen = {_identity(root)}

        def grow(node: LineageNode) -> tuple[LineageNode, list]:
            subtrees = []
            for child in node.inputs:
                key = _identity(child)
                if key not in seen:
                    seen.add(key)
                    subtrees.append(grow(self.nodes[key]))
            return node, subtrees

        return grow(root)


def unique_nodes(roots: Iterable[LineageNode]) -> list[LineageNode]:
    """Every node of the trees `roots` once (repeated occurrences resolved to the expanded one)."""
    return list(_Index(roots).nodes.values())


def branch_nodes(root: LineageNode, lineage: Sequence[LineageNode]) -> list[LineageNode]:
    """The nodes reachable from `root` (a tree of `lineage`, or cut from one: report_branch), each once, in
    the order render_branch prints them; the inputs of each are looked up in `lineage`."""
    found: list[LineageNode] = []

    def flatten(subtree: tuple[LineageNode, list]) -> None:
        found.append(subtree[0])
        for child in subtree[1]:
            flatten(child)

    flatten(_Index(lineage).spanning_tree(root))
    return found


def off_branch(root: LineageNode, lineage: Sequence[LineageNode]) -> list[LineageNode]:
    """The nodes of `lineage` that branch_nodes(root, lineage) does not reach."""
    reached = {_identity(node) for node in branch_nodes(root, lineage)}
    return [node for node in unique_nodes(lineage) if _identity(node) not in reached]


# The asset definitions of the code location this process serves (orchestration/definitions.py registers
# them when it builds its Definitions): where a running report reads each lineage node's config defaults and
# pool. A report cannot import the definitions that import it, so the code location hands them down.
_CODE_LOCATION_ASSETS: list = []


def use_code_location_assets(assets: Iterable) -> None:
    """Name the asset definitions of this process's code location (see _CODE_LOCATION_ASSETS)."""
    _CODE_LOCATION_ASSETS[:] = list(assets)


def code_location_assets() -> list:
    """The asset definitions `use_code_location_assets` named (empty before: no defaults or pools known)."""
    return list(_CODE_LOCATION_ASSETS)


def _asset_definitions(assets: Iterable) -> dict[str, AssetsDefinition]:
    """{asset key: its AssetsDefinition} of `assets` (the definitions of a code location)."""
    return {key.to_user_string(): a for a in assets if isinstance(a, AssetsDefinition) for key in a.keys}


def _changed_config(node: LineageNode, definition: AssetsDefinition | None) -> dict:
    """The entries of the node's recorded config whose values differ from the defaults of its asset's Config
    class (as the op's config schema holds them); entries the schema has no default for are left out."""
    config = node.shaped_by.get("config")
    schema = definition.op.config_schema if definition is not None else None
    defaults = schema.default_value if schema is not None and schema.default_provided else None
    if not isinstance(config, dict) or not isinstance(defaults, dict):
        return {}
    return {name: value for name, value in config.items() if name in defaults and plain(defaults[name]) != value}


def _line(node: LineageNode, gap: str | None, definition: AssetsDefinition | None) -> str:
    """One line: asset [partition], when (UTC, to the minute), short data version, code version, the config
    that differs from the asset's defaults, the MLflow model version read, and the STALE / GAP flags."""
    parts = [_name(node)]
    if node.time:
        parts.append(node.time[:16] + "Z")
    if node.data_version:
        parts.append(f"data {node.data_version[:12]}")
    if node.code_version:
        parts.append(f"code {node.code_version}")
    parts += [f"{name}={value if isinstance(value, str) and value else json.dumps(value)}"
              for name, value in _changed_config(node, definition).items()]
    model = node.shaped_by.get("model_uri")
    if isinstance(model, str):
        parts.append(f"model {model.removeprefix('models:/')}")
    if node.stale:
        parts.append("STALE")
    if gap:
        parts.append(f"GAP ({gap})")
    if node.changed:
        parts.append(f"CHANGED ({node.changed})")
    return " ".join(parts)


def render_branch(root: LineageNode, lineage: Sequence[LineageNode], assets: Iterable) -> str:
    """`root`'s tree one line per node (_line), each node printed once: where the DAG reaches a node again it
    is left out. Inputs come from `lineage`, the trees `root` belongs to or was cut from (report_branch);
    config defaults from the asset definitions `assets`."""
    index, definitions = _Index(lineage), _asset_definitions(assets)
    lines: list[str] = []

    def draw(subtree: tuple[LineageNode, list], prefix: str, last: bool, top: bool) -> None:
        node, children = subtree
        lines.append(prefix + ("" if top else ("└─ " if last else "├─ "))
                     + _line(node, index.gaps.get(_identity(node)), definitions.get(node.asset_key)))
        for position, child in enumerate(children):
            draw(child, prefix + ("" if top else ("   " if last else "│  ")), position == len(children) - 1, False)

    draw(index.spanning_tree(root), "", True, True)
    return "\n".join(lines)


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
    pool: str | None  # the concurrency pool of its asset definition (GPU_POOL: a GPU step)


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


def lineage_cost(instance: DagsterInstance, nodes: Iterable[LineageNode], assets: Iterable, scope: str = "lineage",
                 clock: StepClock | None = None) -> Cost:
    """The cost of the materializations among `nodes` (each counted once; gaps cost nothing): wall seconds
    per step, a step that materialized several of them (a multi-asset) counted once per (run, step); the
    pool of each step from its asset's definition in `assets`; the LLM usage and training the nodes recorded.
    `clock` caches event-log reads across calls."""
    definitions, clock = _asset_definitions(assets), clock or StepClock(instance)
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
            seconds, definition = clock.seconds(node.run_id, node.step_key), definitions.get(node.asset_key)
            step = steps[(node.run_id, node.step_key)] = StepCost(
                node.run_id, node.step_key, [], round(seconds, 3) if seconds is not None else None,
                definition.op.pool if definition is not None else None)
        step.assets.append(node.asset_key)
        if node.llm_usage:
            for name in asdict(LLMUsage()):
                llm[name] += node.llm_usage.get(name) or 0
        elif "llm" in node.shaped_by:
            llm["llm_steps_without_usage"] += 1
        for name, count in node.training.items():
            training[name] = training.get(name, 0) + count
    return Cost(scope, list(steps.values()), llm, training)


def record_report_lineage(context, method_inputs: Mapping[str, Sequence[AssetKey]]) -> list[LineageNode]:
    """The lineage of what a running report reads (audit_inputs), which the report also records in its
    metadata: `method_inputs`, the inputs that produced each method's rows (METHOD_INPUTS: a figure's
    audit follows only its method's), and the cost of that lineage (COST, scope "inputs": the report's own
    step is still running). Call it before the report yields its output."""
    nodes = audit_inputs(context.instance, sorted(context.assets_def.dependency_keys), context.partition_key)
    cost = lineage_cost(context.instance, unique_nodes(nodes), code_location_assets(), scope="inputs")
    context.add_output_metadata({
        METHOD_INPUTS: MetadataValue.json({method: sorted(key.to_user_string() for key in keys)
                                           for method, keys in sorted(method_inputs.items())}),
        COST: MetadataValue.json(cost.to_dict())},
        output_name=context.assets_def.get_output_name_for_asset_key(context.asset_key))
    return nodes


def report_lineage_markdown(report: AssetKey, partition: str | None, nodes: Sequence[LineageNode],
                            method_inputs: Mapping[str, Sequence[AssetKey]], assets: Iterable) -> str:
    """What a running report shows of its lineage (Markdown, short enough for the UI): the lineage of its
    inputs (`nodes`, record_report_lineage) as one tree, each node once (render_branch), then each method's
    branch (report_branch): the inputs that produced its rows, how many nodes the branch holds and how many
    of them are STALE or GAP. `covlab audit` prints one branch in full."""
    recorded = {method: sorted(key.to_user_string() for key in keys) for method, keys in sorted(method_inputs.items())}
    root = LineageNode(report.to_user_string(), partition, None, method_inputs=recorded, inputs=list(nodes))
    lines = ["```", render_branch(root, [root], assets), "```", "", "Branch per method (`covlab audit` prints one):",
             ""]
    for method, inputs in recorded.items():
        on_branch = branch_nodes(report_branch(root, [method]), [root])[1:]  # [0] is the report itself
        flagged = sum(bool(node.stale or node.gap) for node in on_branch)
        lines.append(f"- {method}: {', '.join(inputs)} ({len(on_branch)} nodes"
                     + (f", {flagged} STALE or GAP)" if flagged else ")"))
    return "\n".join(lines)
