"""The lineage of a reported number as text (resources/lineage.py builds it): `covlab audit`'s tree with every
detail (render_text), one line per materialization, each once (render_branch), and what a running report shows
of the lineage of its inputs in its metadata (report_lineage_markdown)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from dagster import AssetKey

from covlab.resources.lineage import LineageIndex, LineageNode, branch_nodes, report_branch
from covlab.resources.materializations import plain


def _adopted(node: LineageNode) -> str:
    """The cross-dataset edge of a trained asset that adopted another dataset's model (ADOPTED)."""
    return (f"ADOPTED ({node.adopted_from.removeprefix('models:/')}: the model's own lineage follows, in the dataset "
            "it was trained on)") if node.adopted_from else ""


def _flags(node: LineageNode) -> str:
    return "".join([f"  STALE ({node.stale})" if node.stale else "", f"  GAP ({node.gap})" if node.gap else "",
                    f"  CHANGED ({node.changed})" if node.changed else "", f"  {_adopted(node)}" if node.adopted_from
                    else "", "  (shown above)" if node.repeated else ""])


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


def _changed_config(node: LineageNode) -> dict:
    """The entries of the node's recorded config whose values differ from the defaults of its asset's Config
    class (as the op's config schema held them in the run: LineageNode.config_defaults); entries the schema has
    no default for are left out."""
    config, defaults = node.shaped_by.get("config"), node.config_defaults
    if not isinstance(config, dict) or not isinstance(defaults, dict):
        return {}
    return {name: value for name, value in config.items() if name in defaults and plain(defaults[name]) != value}


def _line(node: LineageNode, gap: str | None) -> str:
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
              for name, value in _changed_config(node).items()]
    model = node.shaped_by.get("model_uri")
    if isinstance(model, str):
        parts.append(f"model {model.removeprefix('models:/')}")
    if node.adopted_from:
        parts.append(_adopted(node))
    if node.stale:
        parts.append("STALE")
    if gap:
        parts.append(f"GAP ({gap})")
    if node.changed:
        parts.append(f"CHANGED ({node.changed})")
    return " ".join(parts)


def render_branch(root: LineageNode, lineage: Sequence[LineageNode]) -> str:
    """`root`'s tree one line per node (_line), each node printed once: where the DAG reaches a node again it
    is left out. Inputs come from `lineage`, the trees `root` belongs to or was cut from (report_branch)."""
    index = LineageIndex(lineage)
    lines: list[str] = []

    def draw(subtree: tuple[LineageNode, list], prefix: str, last: bool, top: bool) -> None:
        node, children = subtree
        lines.append(prefix + ("" if top else ("└─ " if last else "├─ "))
                     + _line(node, index.gap(node)))
        for position, child in enumerate(children):
            draw(child, prefix + ("" if top else ("   " if last else "│  ")), position == len(children) - 1, False)

    draw(index.spanning_tree(root), "", True, True)
    return "\n".join(lines)


def report_lineage_markdown(report: AssetKey, partition: str | None, nodes: Sequence[LineageNode],
                            method_inputs: Mapping[str, Sequence[AssetKey]]) -> str:
    """What a running report shows of its lineage (Markdown, short enough for the UI): the lineage of its
    inputs (`nodes`, resources/report_lineage.py record_report_lineage) as one tree, each node once
    (render_branch), then each method's branch (report_branch): the inputs that produced its rows, how many
    nodes the branch holds and how many of them are STALE or GAP. `covlab audit` prints one branch in full."""
    recorded = {method: sorted(key.to_user_string() for key in keys) for method, keys in sorted(method_inputs.items())}
    root = LineageNode(report.to_user_string(), partition, None, method_inputs=recorded, inputs=list(nodes))
    lines = ["```", render_branch(root, [root]), "```", "", "Branch per method (`covlab audit` prints one):",
             ""]
    for method, inputs in recorded.items():
        on_branch = branch_nodes(report_branch(root, [method]), [root])[1:]  # [0] is the report itself
        flagged = sum(bool(node.stale or node.gap) for node in on_branch)
        lines.append(f"- {method}: {', '.join(inputs)} ({len(on_branch)} nodes"
                     + (f", {flagged} STALE or GAP)" if flagged else ")"))
    return "\n".join(lines)
