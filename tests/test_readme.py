"""The README's method map leads from each method name to its registry entry and selector class in one hop: the
table lists exactly the registry's methods, each with its label, the class its selector is, the coverage it
reads and its reports, so the map cannot drift from the code."""

import re
from pathlib import Path

import numpy as np

from covlab.models.lmvu import FEATURE_NAMES, LMVURanker
from covlab.models.registry import METHODS, SelectorSettings

README = Path(__file__).resolve().parents[1] / "README.md"
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
