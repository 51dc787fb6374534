"""`covlab reproduce`: rebuild a reported figure from its lineage alone, and say whether it came out the same.

From the lineage of the report materialization behind the figure (resources/lineage.py), every node once:
- the source: the git commit every node recorded (metadata `git`, assets/outputs.py). A node built from a
  checkout with uncommitted changes, or with no recorded commit, cannot be rebuilt from a commit: refused
  unless `allow_dirty`, which rebuilds with this checkout as it is and says so. The rebuild runs in this
  checkout when it is that commit and clean, else in a git worktree of the commit.
- the config: each node's op config as its run was given it (the Dagster run's run config);
- the dataset: the ingest node's registered format, path and options (a table's column mapping, CRUX's rating
  threshold; recorded only for a dataset that has some), each source file checked against the SHA-256 recorded at
  ingest (refused, naming the file, when one changed).
The rebuild materializes those assets in a scratch COVLAB_HOME (its own Dagster instance, storage, MLflow
and results store) in a subprocess, like `covlab materialize`. Then, in dependency order, each node's
content version in the scratch instance is compared with the recorded one: the version its consumer read
(load record), which is the writer's data version unless the stored value was altered in between. The
first node that differs is named with both versions and what differs between the rebuilt value and the
stored one; finally the figure itself is compared with the rebuilt results store's. A trained model whose
weights on disk no longer have their registered content hash is named in a note: a consumer that read those
bytes diverges from the rebuild.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml
from dagster import AssetKey, DagsterInstance

from covlab.models.adoption import ModelAdoption
from covlab.models.versions import value_differences
from covlab.resources.datasets import GENERATED_PATH, DatasetRegistry, source_file_changes
from covlab.resources.home import dataset_registry
from covlab.resources.io_manager import read_stored
from covlab.resources.lineage import ADOPTED, LineageNode, audit_materialization, disk_changes
from covlab.resources.materializations import (DATA_VERSION_TAG, latest_materialization, materialization_by_id,
                                               metadata_value)
from covlab.resources.source import (PACKAGE_ROOT, SOURCE_METADATA, SourceError, add_worktree, read_source_state,
                                     remove_worktree)
from covlab.resources.model_store import WEIGHTS_METADATA

INGEST_FORMAT, INGEST_PATH, INGEST_OPTIONS, INGEST_FILES = "format", "path", "options", "source_files"
# The alias under which a rebuild's copy of the MLflow store names each version the lineage adopted.
REPRODUCE_ALIAS = "reproduce"
FIGURE_KEYS = ("dataset", "method", "budget", "k", "split", "metric", "query_id")


class ReproduceRefused(RuntimeError):
    """The figure cannot be rebuilt from what its lineage records (exit status 2)."""


@dataclass
class NodeCheck:
    """One lineage node: the recorded content version, the rebuilt one, and what differs."""
    asset_key: str
    partition: str | None
    recorded: str | None  # content version the figure was computed from
    written: str | None  # data version the writing run recorded (differs from `recorded` if altered since)
    rebuilt: str | None = None
    differences: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return self.recorded is not None and self.recorded == self.rebuilt


@dataclass
class Plan:
    """What a rebuild needs, read from the lineage: nodes in dependency order, source, config, dataset."""
    report: LineageNode
    nodes: list[LineageNode]
    commit: str
    dirty: bool
    op_config: dict
    dataset: dict
    select: list[str]
    original_seconds: float
    notes: list[str] = field(default_factory=list)
    adopted: list[dict] = field(default_factory=list)  # the ADOPTED records of the models taken from other datasets


@dataclass
class FigureCheck:
    figure: dict  # dataset, method, budget, k, split, metric, query_id
    reported: float
    rebuilt: float | None  # None: the rebuilt results store holds no such figure

    @property
    def identical(self) -> bool:
        return self.rebuilt is not None and self.rebuilt == self.reported


@dataclass
class Reproduction:
    commit: str
    built_in: str
    checks: list[NodeCheck]
    figures: list[FigureCheck]
    original_seconds: float
    rebuild_seconds: float
    scratch: str | None
    notes: list[str] = field(default_factory=list)

    @property
    def first_divergence(self) -> NodeCheck | None:
        return next((c for c in self.checks if not c.identical), None)

    @property
    def reproduced(self) -> bool:
        return self.first_divergence is None and all(f.identical for f in self.figures)

    def to_dict(self) -> dict:
        return {**asdict(self), "reproduced": self.reproduced,
                "first_divergence": asdict(self.first_divergence) if self.first_divergence else None}


def dependency_order(root: LineageNode) -> list[LineageNode]:
    """Each materialization of the tree once (its first, fully expanded occurrence), inputs before readers;
    every consumer's `read_version` of a node is gathered on it."""
    order: dict[int | None, LineageNode] = {}
    reads: dict[int | None, set] = {}

    def visit(node: LineageNode) -> None:
        if node.read_version is not None:
            reads.setdefault(node.storage_id, set()).add(node.read_version)
        for child in node.inputs:
            visit(child)
        order.setdefault(node.storage_id, node)  # the walker expands a node's first occurrence

    visit(root)
    for storage_id, node in order.items():
        other = sorted(reads.get(storage_id, set()) - {node.data_version})
        node.read_version = other[0] if other else node.data_version
    return list(order.values())


def plan(instance: DagsterInstance, figure: dict, allow_dirty: bool = False) -> Plan:
    """Read everything a rebuild needs from the lineage of the report materialization that produced `figure`
    (a results-store row as a dict: report_asset, partition, run_id); ReproduceRefused when something is missing."""
    from covlab.orchestration.definitions import ASSETS

    report = audit_materialization(instance, AssetKey.from_user_string(figure["report_asset"]), figure["partition"],
                                   figure["run_id"])
    # The lineage of a model adopted from another dataset continues there (resources/lineage.py ADOPTED); that
    # model is verified, not rebuilt, so the rebuild is of this partition's nodes.
    nodes = [node for node in dependency_order(report) if node.partition == figure["partition"]]
    # A gap without a materialization leaves nothing to rebuild from; one with (the bytes read differ from
    # what the writer recorded) is what the comparison below pins down.
    gaps = [f"{n.asset_key} [{n.partition}]: {n.gap}" for n in nodes if n.storage_id is None]
    if gaps:
        raise ReproduceRefused("the lineage has gaps, so it does not say what to rebuild: " + "; ".join(gaps))
    records = {n.storage_id: materialization_by_id(instance, AssetKey.from_user_string(n.asset_key), n.storage_id)
               for n in nodes}
    sources = {}
    for node in nodes:
        metadata = records[node.storage_id].asset_materialization.metadata
        sources[node.asset_key] = metadata_value(metadata.get(SOURCE_METADATA)) or {}
    unknown = sorted(k for k, s in sources.items() if not s.get("commit"))
    if unknown:
        raise ReproduceRefused(f"no recorded git commit for {', '.join(unknown)} (materialized outside a git "
                               "checkout, or before covlab recorded its source); re-materialize them first")
    commits = {s["commit"] for s in sources.values()}
    commit = sources[report.asset_key]["commit"]
    # Weights rewritten on disk since registration: a consumer that read them (before loads were verified)
    # computed from other bytes than the model's record says, so a divergence below it starts there.
    notes = [f"{n.asset_key} [{n.partition}]: {change}; its consumers may have read those bytes"
             for n in nodes if WEIGHTS_METADATA in n.shaped_by for change in disk_changes(n)]
    if len(commits) > 1:
        others = sorted(k for k, s in sources.items() if s["commit"] != commit)
        notes.append(f"the lineage spans {len(commits)} commits; rebuilt with the report's {commit[:10]}, so "
                     f"{', '.join(others)} (built by another commit) may differ by code")
    dirty = sorted(k for k, s in sources.items() if s.get("dirty") is not False)
    if dirty and not allow_dirty:
        raise ReproduceRefused(f"{', '.join(dirty[:5])}{' and others' if len(dirty) > 5 else ''} were built from a "
                               "checkout with uncommitted changes (git.dirty), which no commit holds; commit and "
                               "re-materialize, or pass --allow-dirty to rebuild with this checkout as it is")
    ops, select = {}, set()
    runs = {}
    for node in nodes:
        key = AssetKey.from_user_string(node.asset_key)
        assets_def = next(a for a in ASSETS if key in a.keys)
        select |= {key} if assets_def.can_subset else set(assets_def.keys)
        if node.run_id not in runs:
            runs[node.run_id] = instance.get_run_record_by_id(node.run_id)
        given = (runs[node.run_id].dagster_run.run_config or {}).get("ops", {}).get(assets_def.node_def.name)
        if given is not None:
            ops.setdefault(assets_def.node_def.name, given)
    original = sum((r.end_time or r.start_time) - r.start_time for r in runs.values() if r.start_time)
    adopted = [metadata_value(records[n.storage_id].asset_materialization.metadata[ADOPTED])
               for n in nodes if n.adopted_from]
    notes += [f"{record['source_uri']} (trained on {record['trained_on']}) is adopted, not retrained: the rebuild "
              "adopts the same version from a copy of this home's MLflow store, verified against its content hash"
              for record in adopted]
    return Plan(report=report, nodes=nodes, commit=commit, dirty=bool(dirty), op_config=ops,
                dataset=_dataset(nodes, records, figure["partition"]),
                select=sorted(k.to_user_string() for k in select), original_seconds=original, notes=notes,
                adopted=adopted)


def _dataset(nodes: list[LineageNode], records: dict, partition: str) -> dict:
    """The ingest record of the partition (format, path, options, source files), each file checked against its
    SHA-256; options {} when the record has none (a dataset without options, or one ingested before they were
    recorded)."""
    for node in nodes:
        metadata = records[node.storage_id].asset_materialization.metadata
        if INGEST_FILES in metadata and INGEST_FORMAT in metadata:
            fmt, path = metadata_value(metadata[INGEST_FORMAT]), metadata_value(metadata[INGEST_PATH])
            files = metadata_value(metadata[INGEST_FILES]) or {}
            changes = source_file_changes(path, files)
            if changes:
                raise ReproduceRefused(changes[0])
            options = metadata_value(metadata[INGEST_OPTIONS]) if INGEST_OPTIONS in metadata else None
            return {"name": partition, "format": fmt, "path": None if path == GENERATED_PATH else path,
                    "options": options or {}, "files": files}
    raise ReproduceRefused(f"no ingest materialization in the lineage of partition {partition!r}")


def register_dataset(registry: DatasetRegistry, dataset: dict, models_from: str | None = None) -> None:
    """Register the planned dataset (`_dataset`) in the scratch home's `registry` as its ingest recorded it: format,
    path and options, and the models it adopts (`models_from`); the demo is always registered."""
    if dataset["format"] != "demo" or models_from is not None:
        registry.register(dataset["name"], dataset["format"], dataset["path"], options=dataset.get("options"),
                          models_from=models_from)


def adopt_as_recorded(plan: Plan, scratch: Path, original_home: Path) -> str | None:
    """For a lineage that adopted models from another dataset: the scratch home gets a copy of this home's
    embedded MLflow store (its locations follow the copy: resources/store_location.py), each adopted version
    there takes the alias REPRODUCE_ALIAS, and the `models_from` the scratch dataset registers is returned, so
    that the rebuild adopts exactly those versions (verified against their content hash as they are copied into
    its artifacts). None when nothing was adopted; ReproduceRefused when the store is not an embedded one."""
    if not plan.adopted:
        return None
    from covlab.orchestration.definitions import default_resources

    store = original_home / "mlflow"
    sources = {record["trained_on"] for record in plan.adopted}
    if not (store / "mlflow.db").is_file() or os.environ.get("COVLAB_MLFLOW_TRACKING_URI") or len(sources) > 1:
        raise ReproduceRefused(f"the lineage adopts models of {', '.join(sorted(sources))}; a rebuild adopts them from "
                               f"a copy of the embedded MLflow store of one source dataset ({store}), which "
                               "this home does not have")
    shutil.copytree(store, scratch / "mlflow")
    tracking = default_resources(scratch)["tracking"]
    for adoption in map(ModelAdoption.from_record, plan.adopted):
        tracking.set_alias(adoption.source_model, REPRODUCE_ALIAS, adoption.source_version)
    return f"{sources.pop()}@{REPRODUCE_ALIAS}"


def _source_tree(plan: Plan, scratch: Path, allow_dirty: bool) -> tuple[Path | None, str]:
    """(folder to put on PYTHONPATH, or None for this checkout; how the source was chosen)."""
    if plan.dirty and allow_dirty:
        return None, "this checkout as it is (--allow-dirty: the lineage was built with uncommitted changes)"
    here = read_source_state()
    if here.commit == plan.commit and here.dirty is False:
        return None, f"this checkout (commit {plan.commit[:10]}, clean)"
    try:
        tree = add_worktree(plan.commit, scratch / "source")
    except SourceError as exc:
        raise ReproduceRefused(str(exc)) from None
    why = "has uncommitted changes" if here.commit == plan.commit else f"is at {str(here.commit)[:10]}"
    return tree.parent, f"a git worktree of {plan.commit[:10]} (this checkout {why})"


def rebuild(plan: Plan, scratch: Path, original_home: Path, allow_dirty: bool = False) -> tuple[str, float]:
    """Materialize the plan's assets in a scratch COVLAB_HOME in a subprocess, the models it adopted from another
    dataset adopted again (`adopt_as_recorded`); (where the source came from, wall seconds). RuntimeError with the
    log's tail when the run fails."""
    scratch.mkdir(parents=True, exist_ok=True)
    dataset = plan.dataset
    register_dataset(dataset_registry(scratch), dataset, adopt_as_recorded(plan, scratch, original_home))
    config = scratch / "run_config.yaml"
    config.write_text(yaml.safe_dump({"ops": plan.op_config}, sort_keys=True))
    pythonpath, built_in = _source_tree(plan, scratch, allow_dirty)
    env = {k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"}
    env.update(COVLAB_HOME=str(scratch), DAGSTER_HOME=str(scratch / "dagster"))
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), *filter(None, [env.get("PYTHONPATH")])])
    log = scratch / "rebuild.log"
    started = time.perf_counter()
    try:
        with open(log, "w") as out:
            done = subprocess.run([sys.executable, "-m", "covlab.orchestration.cli", "materialize", "--dataset",
                                   dataset["name"], "--select", *plan.select, "--config", str(config)],
                                  cwd=pythonpath or PACKAGE_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    finally:
        if pythonpath is not None:
            remove_worktree(pythonpath / "covlab")
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"the rebuild failed (exit {done.returncode}); log {log}:\n{tail}")
    return built_in, seconds


def compare(plan: Plan, scratch: Path, original_home: Path) -> list[NodeCheck]:
    """Each node's recorded content version against the scratch instance's, in dependency order, with what
    differs for the first that does."""
    instance = DagsterInstance.from_config(str(scratch / "dagster"))
    checks = []
    try:
        for node in plan.nodes:
            record = latest_materialization(instance, AssetKey.from_user_string(node.asset_key), node.partition)
            rebuilt = record.asset_materialization.tags.get(DATA_VERSION_TAG) if record else None
            checks.append(NodeCheck(node.asset_key, node.partition, node.read_version, node.data_version, rebuilt))
    finally:
        instance.dispose()
    first = next((c for c in checks if not c.identical), None)
    if first is not None:
        first.differences = _differences(first, scratch, original_home)
    return checks


def rebuilt_figure(results, figure: dict) -> FigureCheck:
    """`figure` (a results-store row as a dict) against the same figure of the same report in `results`."""
    found = results.figures(dataset=figure["dataset"], method=figure["method"], metric=figure["metric"],
                            split=figure.get("split"), budget=figure.get("budget"), k=figure.get("k"))
    found = found[found["report_asset"] == figure["report_asset"]]
    wanted = figure.get("query_id")
    found = found[found["query_id"].isna()] if wanted is None else found[found["query_id"] == wanted]
    return FigureCheck({k: figure.get(k) for k in FIGURE_KEYS}, float(figure["value"]),
                       float(found["value"].iloc[-1]) if len(found) else None)


def _differences(check: NodeCheck, scratch: Path, original_home: Path) -> list[str]:
    from covlab.models.versions import content_version

    rebuilt = read_stored(scratch / "storage", check.asset_key, check.partition)
    if rebuilt is None:
        return ["nothing was rebuilt for it"]
    lines = []
    if check.recorded != check.written:
        lines.append(f"its consumer read content {check.recorded}, not the {check.written} its run wrote: the "
                     "stored value was altered after it was written")
    stored = read_stored(original_home / "storage", check.asset_key, check.partition)
    if stored is None or content_version(stored) != check.recorded:
        return lines + ["the recorded content is no longer stored (rematerialized since), so no cell comparison"]
    return lines + value_differences(stored, rebuilt)


def reproduce(instance: DagsterInstance, figures: list[dict], original_home: Path, allow_dirty: bool = False,
              keep: bool = False, scratch_root: Path | None = None) -> Reproduction:
    """Rebuild the report materialization behind `figures` (results-store rows as dicts, all of the same
    report materialization) in a scratch home and compare. The scratch home is removed when everything
    reproduced, unless `keep`; kept (and named) when not."""
    from covlab.orchestration.definitions import default_resources

    if len({(f["report_asset"], f["partition"], f["run_id"]) for f in figures}) != 1:
        raise ValueError("reproduce: expected figures of one report materialization")
    planned = plan(instance, figures[0], allow_dirty)
    if scratch_root is not None:  # a --scratch folder that does not exist yet is made, as the home itself is
        scratch_root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="reproduce-", dir=scratch_root))
    built_in, seconds = rebuild(planned, scratch, original_home, allow_dirty)
    checks = compare(planned, scratch, original_home)
    results = default_resources(scratch)["results"]
    try:
        compared = [rebuilt_figure(results, f) for f in figures]
    finally:
        results.dispose()
    result = Reproduction(commit=planned.commit, built_in=built_in, checks=checks, figures=compared,
                          original_seconds=planned.original_seconds, rebuild_seconds=seconds, scratch=str(scratch),
                          notes=planned.notes)
    if result.reproduced and not keep:
        shutil.rmtree(scratch, ignore_errors=True)
        result.scratch = None
    return result


def render(result: Reproduction) -> str:
    lines = []
    for figure in result.figures:
        where = ", ".join(f"{k}={figure.figure[k]}" for k in FIGURE_KEYS if figure.figure.get(k) is not None)
        lines.append(f"figure {figure.reported:.6f}  {where}")
    lines += [f"source: {result.built_in}",
              f"rebuilt {len(result.checks)} assets in {result.rebuild_seconds:.0f} s (the original runs took "
              f"{result.original_seconds:.0f} s)"
              + (f"; scratch home kept at {result.scratch}" if result.scratch else "")]
    lines += [f"note: {n}" for n in result.notes]
    first, identical = result.first_divergence, sum(c.identical for c in result.checks)
    if result.reproduced:
        values = ", ".join(f"{f.rebuilt:.6f}" for f in result.figures)
        lines.append(f"REPRODUCED: all {identical} assets have identical content and the figure is identical "
                     f"({values})")
        return "\n".join(lines)
    if first is not None:
        lines.append(f"DIVERGED at {first.asset_key} [{first.partition}], the first in dependency order of the "
                     f"{len(result.checks) - identical} of {len(result.checks)} assets whose content differs: "
                     f"recorded {first.recorded}, rebuilt {first.rebuilt}")
        lines += [f"  {d}" for d in first.differences]
    elif not all(f.identical for f in result.figures):
        lines.append("DIVERGED at the figure: every asset identical, the figure not")
    for f in result.figures:
        rebuilt = "missing" if f.rebuilt is None else f"{f.rebuilt:.6f}"
        lines.append(f"figure {f.figure['method']}: reported {f.reported:.6f}, rebuilt {rebuilt}")
    return "\n".join(lines)
