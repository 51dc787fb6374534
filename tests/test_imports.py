"""Import direction (README "Layout"): models/ <- resources/ <- assets/ <- orchestration/, imports pointing
down that list only, models/ free of Dagster, and no import cycle inside a folder. Read from the source with
`ast`, every import counted, those inside functions too (a cycle hidden by an in-function import is a cycle)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("models", "resources", "assets", "orchestration")  # each may import the ones before it


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, absolute (covlab.x.y), at any depth of its syntax tree."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}  # `from covlab.models import x`
    return found


def package_graph() -> dict[str, set[str]]:
    """covlab.<layer>.<module> -> the covlab modules it imports (submodules only, packages dropped)."""
    modules = {f"covlab.{layer}.{p.stem}": p for layer in LAYERS for p in sorted((ROOT / layer).glob("*.py"))
               if p.stem != "__init__"}
    return {name: {m for m in imports_of(path) if m in modules} for name, path in modules.items()}


def test_imports_point_down_the_layers():
    offences = []
    for layer in LAYERS:
        allowed = set(LAYERS[:LAYERS.index(layer) + 1])
        for path in sorted((ROOT / layer).glob("*.py")):
            for module in sorted(imports_of(path)):
                parts = module.split(".")
                if parts[0] == "covlab" and len(parts) > 1 and parts[1] in LAYERS and parts[1] not in allowed:
                    offences.append(f"{layer}/{path.name} imports {module}")
                if layer == "models" and parts[0] == "dagster":
                    offences.append(f"models/{path.name} imports {module} (models/ is framework-free)")
    assert not offences, "\n".join(offences)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (a list of modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for child in sorted(graph[node]):
            if state.get(child) == 1:
                return path[path.index(child):] + [child]
            if child not in state and (cycle := visit(child)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


@pytest.mark.parametrize("layer", LAYERS)
def test_no_import_cycle_inside_a_folder(layer):
    graph = {name: {m for m in deps if m.split(".")[1] == layer}
             for name, deps in package_graph().items() if name.split(".")[1] == layer}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle_through_an_in_function_import(tmp_path):
    """The checks above can fail: a cycle closed by an import inside a function is found."""
    (tmp_path / "a.py").write_text("from covlab.models import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from covlab.models.a import g\n")
    graph = {"covlab.models.a": {m for m in imports_of(tmp_path / "a.py") if m.startswith("covlab.models.")},
             "covlab.models.b": {m for m in imports_of(tmp_path / "b.py") if m.startswith("covlab.models.")}}
    graph = {k: {m for m in v if m in graph} for k, v in graph.items()}
    assert find_cycle(graph) == ["covlab.models.a", "covlab.models.b", "covlab.models.a"]
