"""The README is a newcomer's guide: short, its maps of the layout and the concepts near the top, the command CI runs
named, and every relative link in it and in docs/ leading to a file and heading that exist. Its method map leads
from each method name to its registry entry and selector class in one hop: the table lists exactly the registry's
methods, each with its label, the class its selector is, the coverage it reads and its reports, so the map cannot
drift from the code."""

import ast
import re
from pathlib import Path

import numpy as np

from covlab.models.lmvu import FEATURE_NAMES, LMVURanker
from covlab.models.registry import METHODS, SelectorSettings

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
HEADER = "| method | label | selector (registry entry -> class) | coverage it reads | reports |"


def method_map() -> dict[str, list[str]]:
    lines = README.read_text().splitlines()
    start = lines.index(HEADER) + 2  # past the header and its rule
    rows = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_the_method_map_sits_near_the_top_of_the_readme():
    text = README.read_text()
    assert text.index(HEADER) < text.index("## What gets built") < text.index("## Datasets")


def test_the_method_map_is_the_registry():
    rows = method_map()
    assert list(rows) == [m.name for m in METHODS]
    ranker = LMVURanker(FEATURE_NAMES, np.zeros(18), np.ones(18), np.zeros(18), 1.0, "viewpoints")
    for m in METHODS:
        label, selector, coverage, reports = rows[m.name]
        assert label == m.label, m.name
        assert coverage == (m.coverage.asset or "-"), m.name
        assert set(reports.split(", ")) == {r.value for r in m.reports}, m.name
        named = re.match(r"(retriever: )?`(\w+)`", selector)
        assert named, (m.name, selector)
        if m.build is None:
            assert named.group(1), f"{m.name} is a retriever: the map must say so"
        else:
            assert named.group(2) == type(m.selector(SelectorSettings(), ranker if m.trained else None)).__name__


# --- the guide's shape ------------------------------------------------------------------------------------------

MAX_README_LINES = 300
MAP_WITHIN_LINES = 100
LAYOUT_HEADING = "## Layout"
CONCEPTS_HEADING = "### Concepts: where each idea lives"
LAYOUT_FOLDERS = ("models", "resources", "assets", "orchestration", "serving", "bench", "tests", "configs", "deploy",
                  "docs")


def table_after(lines: list[str], heading: str) -> tuple[int, list[str]]:
    """The rows (header and rule included) of the first table after `heading`, and the 0-based index of its last
    row."""
    start = lines.index(heading)
    first = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("|"))
    last = first
    while last + 1 < len(lines) and lines[last + 1].startswith("|"):
        last += 1
    return last, lines[first:last + 1]


def test_the_readme_is_a_short_guide():
    lines = README.read_text().splitlines()
    assert len(lines) < MAX_README_LINES, f"README.md has {len(lines)} lines: move details to docs/"


def test_the_layout_and_concept_maps_sit_within_the_first_100_lines():
    lines = README.read_text().splitlines()
    assert lines.index(LAYOUT_HEADING) < MAP_WITHIN_LINES
    for heading in (LAYOUT_HEADING, CONCEPTS_HEADING):
        last, rows = table_after(lines, heading)
        assert last < MAP_WITHIN_LINES, f"the table under {heading!r} ends on line {last + 1}"
    _, rows = table_after(lines, LAYOUT_HEADING)
    mapped = [row.split("|")[1].strip().strip("`").rstrip("/") for row in rows[2:]]
    assert mapped == list(LAYOUT_FOLDERS)
    assert all((ROOT / folder).is_dir() for folder in mapped)


def defined_names(module: Path) -> set[str]:
    """What a module defines or imports at its top level, and its classes' members as `Class.member`."""
    names = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names |= {f"{node.name}.{member.name}" for member in node.body
                          if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef))}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


def test_the_concept_map_names_modules_and_definitions_that_exist():
    lines = README.read_text().splitlines()
    _, rows = table_after(lines, CONCEPTS_HEADING)
    for row in rows[2:]:
        where = row.split("|")[2]
        for module, names in re.findall(r"`((?:models|resources|assets|orchestration|serving)/[\w/]+\.py)`"
                                        r"(?::((?: *`[\w.]+`,?)+))?", where):
            assert (ROOT / module).is_file(), (module, row)
            missing = set(re.findall(r"`([\w.]+)`", names)) - defined_names(ROOT / module)
            assert not missing, f"{module} defines no {sorted(missing)} (README concept map)"


# --- commands ---------------------------------------------------------------------------------------------------

def code_text(text: str) -> str:
    """Every fenced block and inline code span of a markdown text, one per line."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    return "\n".join(blocks + re.findall(r"`([^`]+)`", prose))


def test_the_readme_names_the_command_ci_runs():
    run = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [line.strip() for line in run
                if line.strip() and not line.startswith("#") and not line.startswith(("set ", "cd "))]
    assert commands == ["make test"], commands
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    assert any(line.split("#")[0].strip() == commands[0] for block in fenced for line in block.splitlines())


def test_every_make_target_the_docs_name_is_in_the_makefile():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, flags=re.M))
    for page in [README, *DOCS]:
        for target in re.findall(r"\bmake ([a-z][\w-]*)", code_text(page.read_text())):
            assert target in targets, f"{page.name}: `make {target}` is not a Makefile target"


def test_every_covlab_command_the_docs_name_is_in_the_cli():
    cli = (ROOT / "orchestration" / "cli.py").read_text()
    parsers = set(re.findall(r"add_parser\(\s*\"([\w-]+)\"", cli))
    for page in [README, *DOCS]:
        for line in re.findall(r"(?:^\s*|bin/)covlab ([a-z][\w -]*)", code_text(page.read_text()), flags=re.M):
            words = line.split()
            named = words[:2] if words[0] in ("dataset", "slots") else words[:1]  # the commands with subcommands
            assert set(named) <= parsers, f"{page.name}: `covlab {' '.join(named)}` is not a command of the CLI"


# --- links ------------------------------------------------------------------------------------------------------

def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: its text lower-cased, markup and punctuation dropped, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link's text stays, its target goes
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a markdown page, duplicates numbered as GitHub numbers them (-1, -2, ...)."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, flags=re.M):
        slug = github_anchor(heading)
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def relative_links(page: Path) -> list[str]:
    """The targets of the page's links and images that are not URLs, outside code."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    text = re.sub(r"`[^`]*`", "", text)
    targets = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)
    return [t for t in targets if not re.match(r"[a-z][\w+.-]*:", t)]


def test_github_anchors_are_computed_as_github_computes_them():
    assert github_anchor("Pool modes (config of `bm25_pools`)") == "pool-modes-config-of-bm25_pools"
    assert github_anchor("4. MCompassRAG (topic metadata bank, distilled student retriever)") == \
        "4-mcompassrag-topic-metadata-bank-distilled-student-retriever"
    assert github_anchor("LMVU's training gain") == "lmvus-training-gain"


def test_every_relative_link_leads_to_a_file_and_heading():
    broken = []
    for page in [README, *DOCS]:
        links = relative_links(page)
        assert page != README or links, "the README links its docs pages"
        for link in links:
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in anchors(target):
                broken.append(f"{page.relative_to(ROOT)}: {link} (no heading #{anchor} in {target.name})")
    assert not broken, "\n".join(broken)


def test_the_readme_links_every_docs_page():
    linked = {(README.parent / link.partition("#")[0]).resolve() for link in relative_links(README)}
    assert {page.resolve() for page in DOCS} <= linked
