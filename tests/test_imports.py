"""Import direction (README "Layout"): models/ <- resources/ <- assets/ <- orchestration/, with serving/ beside
assets/ (it imports models/ and resources/ only, never assets/ or orchestration/), tests/ above all of them and
bench/ on top: imports point down only, nothing imports bench/, models/ is free of Dagster, and no folder has an
import cycle inside it. Read from the source with `ast`, every import counted, those inside functions too (a climb
or a cycle hidden in a function is one all the same)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Each top-level folder and the folders whose modules it may import besides its own; a folder not named by any
# entry (bench/) is imported by none.
MAY_IMPORT = {
    "models": set(),
    "resources": {"models"},
    "assets": {"models", "resources"},
    "serving": {"models", "resources"},
    "orchestration": {"models", "resources", "assets", "serving"},
    "tests": {"models", "resources", "assets", "serving", "orchestration"},
    "bench": {"models", "resources", "assets", "serving", "orchestration", "tests"},
}
FOLDERS = tuple(MAY_IMPORT)
# Test modules and benchmarks run with their folder on sys.path (bench/ scripts add tests/): they import modules
# of these folders by plain name, e.g. `from tiny_bert import save_tiny_bert`.
ON_SYS_PATH = ("tests", "bench")


def modules(root: Path) -> dict[str, Path]:
    """covlab.<folder>.<dotted path> -> its file, for every Python file of every folder of FOLDERS under `root` (a
    package as its __init__.py)."""
    found = {}
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(("covlab", *(parts[:-1] if parts[-1] == "__init__" else parts)))] = path
    return found


def resolve(name: str, importer: str, root: Path) -> str | None:
    """The covlab module an import of `name` by module `importer` names (covlab.<folder>...), or None when it
    names something outside covlab. A plain name is a module of tests/ or bench/ when one of them holds that file,
    the importer's own folder first."""
    if name == "covlab" or name.startswith("covlab."):
        return name
    own = importer.split(".")[1]
    for folder in sorted(ON_SYS_PATH, key=lambda f: f != own):
        if (root / folder / f"{name.split('.')[0]}.py").is_file():
            return f"covlab.{folder}.{name}"
    return None


def named_imports(path: Path, module: str) -> set[str]:
    """Every module name `path` (module `module`) imports, absolute, at any depth of its syntax tree: `from a
    import b` counts a and a.b; a relative import is resolved against the module's package."""
    package = module.split(".")[:-1] if path.name != "__init__.py" else module.split(".")
    named = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            named |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            named.add(base)
            named |= {f"{base}.{alias.name}" for alias in node.names}  # `from covlab.models import x`
    return named


def imports_of(path: Path, module: str, root: Path) -> set[str]:
    """The covlab modules among named_imports(path, module) (resolve)."""
    return {found for name in named_imports(path, module) if (found := resolve(name, module, root))}


def climbs(root: Path) -> list[str]:
    """Every import of a module of one folder that its folder may not import (MAY_IMPORT), and every import of
    Dagster by models/, as "<file> imports <module>"."""
    offences = []
    for module, path in modules(root).items():
        folder = module.split(".")[1]
        allowed = MAY_IMPORT[folder] | {folder}
        for name in sorted(imports_of(path, module, root)):
            target = name.split(".")[1] if "." in name else None
            if target in MAY_IMPORT and target not in allowed:
                offences.append(f"{path.relative_to(root)} imports {name}")
        if folder == "models":
            offences += [f"{path.relative_to(root)} imports {name} (models/ is framework-free)"
                         for name in sorted(named_imports(path, module)) if name.split(".")[0] == "dagster"]
    return offences


def folder_graph(root: Path, folder: str) -> dict[str, set[str]]:
    """The modules of `folder` -> the modules of the same folder they import. A module naming itself is no cycle
    (tests/test_lineage_partitions.py hands its own function to a subprocess by module name)."""
    found = {name: path for name, path in modules(root).items() if name.split(".")[1] == folder}
    return {name: {m for m in imports_of(path, name, root) if m in found and m != name} for name, path in found.items()}


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


def test_every_folder_with_python_has_its_place():
    """The top-level folders holding Python files are exactly those of MAY_IMPORT: a new one is given its place
    (and its imports are checked) before it is used."""
    folders = {path.relative_to(ROOT).parts[0] for path in ROOT.glob("*/**/*.py")}
    assert {folder for folder in folders if not folder.startswith(".")} == set(FOLDERS)


def test_imports_point_down_the_layers():
    offences = climbs(ROOT)
    assert not offences, "\n".join(offences)


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_import_cycle_inside_a_folder(folder):
    graph = folder_graph(ROOT, folder)
    assert graph and find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_checker_finds_a_climb_from_serving_hidden_in_a_function(tmp_path):
    """The checks above can fail: a serving module reaching into orchestration/ inside a function, a relative
    import into assets/, and a test importing a benchmark are each found; serving's own imports pass."""
    for folder in FOLDERS:
        (tmp_path / folder).mkdir()
    (tmp_path / "serving" / "leak.py").write_text(
        "from covlab.models.selectors import Budget\nfrom covlab.resources.home import covlab_home\n\n\n"
        "def home():\n    from covlab.orchestration.instance import dagster_home\n    return dagster_home()\n")
    (tmp_path / "serving" / "relative.py").write_text("from ..assets import selections\n")
    (tmp_path / "bench" / "timing.py").write_text("from tiny_bert import save_tiny_bert\n")
    (tmp_path / "tests" / "tiny_bert.py").write_text("")
    (tmp_path / "tests" / "test_timing.py").write_text("import timing\n")
    assert climbs(tmp_path) == ["serving/leak.py imports covlab.orchestration.instance",
                                "serving/leak.py imports covlab.orchestration.instance.dagster_home",
                                "serving/relative.py imports covlab.assets",
                                "serving/relative.py imports covlab.assets.selections",
                                "tests/test_timing.py imports covlab.bench.timing"]


def test_the_cycle_finder_finds_a_cycle_through_an_in_function_import(tmp_path):
    """A cycle closed by an import inside a function is found, in serving/ as in any folder."""
    (tmp_path / "serving").mkdir()
    (tmp_path / "serving" / "a.py").write_text("from covlab.serving import b\n")
    (tmp_path / "serving" / "b.py").write_text("def f():\n    from covlab.serving.a import g\n")
    graph = folder_graph(tmp_path, "serving")
    assert find_cycle(graph) == ["covlab.serving.a", "covlab.serving.b", "covlab.serving.a"]
