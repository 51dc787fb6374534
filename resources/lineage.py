"""Exact lineage of a reported number, from a report back to the ingest assets.

Each input of a materialization is resolved from the load record its step left (resources/io_manager.py:
the asset key, partition, run that wrote the stored value and the SHA-256 of the bytes read) to that
writer run's materialization of the same key and partition, whose recorded `content_sha256` must match.
Dagster's own input-event pointer (`dagster/input_event_pointer/<key>`) names the latest materialization of
the upstream key in any partition, so it is used only for materializations without load records, and
never followed into another partition. Never "the latest materialization" of an upstream asset: an
upstream rematerialized since with other content (another data version: a content hash) is marked stale,
and a record that leads nowhere is a gap. How a lineage is printed is resources/lineage_text.py, what it cost
resources/lineage_cost.py, what a report records of it resources/report_lineage.py."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone

from dagster import AssetKey, DagsterInstance

from covlab.resources.datasets import source_file_changes
from covlab.resources.io_manager import CONTENT_HASH, LOAD_RECORD, LOADED_VERSION
from covlab.resources.materializations import (CODE_VERSION_TAG, DATA_VERSION_TAG, INPUT_VERSION, NEVER_MATERIALIZED,
                                               POINTER, RunOps, latest_materialization, materialization_by_id,
                                               materialization_in_run, metadata_value, training_counts)
from covlab.resources.model_store import WEIGHTS_HASH, WEIGHTS_METADATA, weights_change
from covlab.resources.source import RUNTIME_METADATA, SOURCE_METADATA

# Metadata entries that say what shaped a materialization (recorded by the assets).
SHAPING = ("config", "settings", "format", "path", "options", "source_files", "model_uri", "model_name",
           "model_version", "mlflow_run_id", WEIGHTS_METADATA, "llm", "prompt_version", SOURCE_METADATA,
           RUNTIME_METADATA)
# Metadata entry of a report materialization (resources/report_lineage.py record_report_lineage): which of its
# inputs produced each method's rows, {method: [asset key, ...]}.
METHOD_INPUTS = "method_inputs"
# What decided a selection on estimated coverage (models/trust.py Decision, models/runs.py MethodRun): the
# estimator gate, whether it fell back to relevance order, and the blend weight chosen on the tune split. A k
# selection records them as entries of its own (`blend`: the evidence); a budgeted selection within its DETAILS
# entry (`blend`: {budget: evidence}).
DECISIONS = ("estimator_gate", "fell_back", "blend")
DETAILS = "details"
# A trained asset's entry when it adopted another dataset's model (models/adoption.py ModelAdoption.to_record): the
# audit follows it across datasets, to the materialization that trained the model in the source dataset.
ADOPTED = "adopted"
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
    training: dict = field(default_factory=dict)  # a trained asset's TrainingSummary counts (training_counts)
    decisions: dict = field(default_factory=dict)  # a selection's gate and blend choice (selection_metadata_decisions)
    pool: str | None = None  # the concurrency pool of its step's op, as its run recorded the op (RunOps)
    config_defaults: dict | None = None  # the defaults of that op's config, likewise (None: unknown)
    stale: str | None = None  # why the number may be out of date: a newer materialization of this asset
    gap: str | None = None  # a record that should exist and does not
    changed: str | None = None  # the files it recorded differ on disk now (mark_changed: `covlab audit` only)
    repeated: bool = False  # already shown above (the graph is a DAG)
    adopted_from: str | None = None  # the model version it adopted from another dataset, and that dataset (ADOPTED)
    inputs: list["LineageNode"] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def selection_metadata_decisions(metadata: Mapping) -> dict:
    """What decided a selection (DECISIONS), from its materialization's `metadata`: its own entries (a k
    selection) or those of its DETAILS entry (a budgeted selection); {} for an asset that recorded none."""
    found = {name: metadata_value(metadata[name]) for name in DECISIONS if name in metadata}
    details = metadata_value(metadata[DETAILS]) if not found and DETAILS in metadata else None
    if isinstance(details, dict):
        found = {name: details[name] for name in DECISIONS if name in details}
    return found


class LineageWalker:
    """Audits materialization events; memoises nodes by storage id so shared ancestors are read once."""

    def __init__(self, instance: DagsterInstance):
        self.instance = instance
        self._seen: set[int] = set()
        self._records: dict[int, object] = {}
        self._latest: dict[tuple[str, str | None], object] = {}
        self._written: dict[tuple[str, str | None, str], object] = {}
        self._ops = RunOps(instance)

    def node(self, record) -> LineageNode:
        mat = record.asset_materialization
        key, partition, tags = mat.asset_key, mat.partition, mat.tags or {}
        op = self._ops.of(record.run_id, record.event_log_entry.step_key)
        node = LineageNode(
            asset_key=key.to_user_string(), partition=partition, storage_id=record.storage_id, run_id=record.run_id,
            time=datetime.fromtimestamp(record.timestamp, tz=timezone.utc).isoformat(timespec="seconds"),
            data_version=tags.get(DATA_VERSION_TAG), code_version=tags.get(CODE_VERSION_TAG),
            content_sha256=metadata_value(mat.metadata.get(CONTENT_HASH)),
            shaped_by={k: metadata_value(mat.metadata[k]) for k in SHAPING if k in mat.metadata},
            step_key=record.event_log_entry.step_key,
            method_inputs=metadata_value(mat.metadata[METHOD_INPUTS]) if METHOD_INPUTS in mat.metadata else None,
            llm_usage=metadata_value(mat.metadata[LLM_USAGE]) if LLM_USAGE in mat.metadata else None,
            training=training_counts(mat.metadata), decisions=selection_metadata_decisions(mat.metadata),
            pool=op.pool, config_defaults=op.config_defaults)
        latest = self._latest_of(key, partition)
        latest_version = (latest.asset_materialization.tags or {}).get(DATA_VERSION_TAG) if latest else None
        if latest is not None and latest.storage_id != record.storage_id and latest_version != node.data_version:
            node.stale = (f"rematerialized since with other content: storage id {latest.storage_id}, run "
                          f"{latest.run_id}, data version {latest_version}")
        adopted = metadata_value(mat.metadata[ADOPTED]) if ADOPTED in mat.metadata else None
        if isinstance(adopted, dict):
            node.adopted_from = f"{adopted['source_uri']}, trained on {adopted['trained_on']}"
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
        if isinstance(adopted, dict):
            node.inputs.append(self._trained_elsewhere(key, adopted))
        return node

    def _trained_elsewhere(self, key: AssetKey, adopted: dict) -> LineageNode:
        """The cross-dataset edge of an adopting trained asset: the materialization that trained the adopted model,
        in the dataset it was trained on (the run its version names), with that dataset's lineage below it."""
        source, run = adopted["trained_on"], adopted.get("training_run_id") or None
        record = materialization_in_run(self.instance, key, source, run)
        if record is None:
            return LineageNode(key.to_user_string(), source, None, run_id=run,
                               gap=f"no materialization of {key.to_user_string()} [{source}] in run {run}, which "
                                   f"trained {adopted['source_uri']}")
        return self.node(record)

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
            self._written[(upstream, partition, writer)] = materialization_in_run(
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


def audit_materialization(instance: DagsterInstance, key: AssetKey, partition: str | None,
                          run_id: str | None = None) -> LineageNode:
    """The lineage tree of `key`'s materialization in `run_id` (latest for the partition if None)."""
    record = materialization_in_run(instance, key, partition, run_id)
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


class LineageIndex:
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

    def gap(self, node: LineageNode) -> str | None:
        """The gap found at any occurrence of `node`, or None."""
        return self.gaps.get(_identity(node))

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
    return list(LineageIndex(roots).nodes.values())


def branch_nodes(root: LineageNode, lineage: Sequence[LineageNode]) -> list[LineageNode]:
    """The nodes reachable from `root` (a tree of `lineage`, or cut from one: report_branch), each once, in
    the order render_branch prints them; the inputs of each are looked up in `lineage`."""
    found: list[LineageNode] = []

    def flatten(subtree: tuple[LineageNode, list]) -> None:
        found.append(subtree[0])
        for child in subtree[1]:
            flatten(child)

    flatten(LineageIndex(lineage).spanning_tree(root))
    return found


def off_branch(root: LineageNode, lineage: Sequence[LineageNode]) -> list[LineageNode]:
    """The nodes of `lineage` that branch_nodes(root, lineage) does not reach."""
    reached = {_identity(node) for node in branch_nodes(root, lineage)}
    return [node for node in unique_nodes(lineage) if _identity(node) not in reached]
