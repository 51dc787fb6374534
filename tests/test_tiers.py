"""The suite's tiers (tests/conftest.py): what `make test-unit`, `test-pipeline` and `test-services` select."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = ["tests/test_end_to_end.py", "tests/test_llm.py", "tests/test_results_store.py"]
TIERS = ("unit", "pipeline", "services")

# `pytest --collect-only -q -p no:cacheprovider -m TIER MODULES` for each tier in argv, one after the other in one
# interpreter (the modules' imports, seconds each time, are paid once): prints {tier: [exit code, selected ids]}.
COLLECT_TIERS = """
import io, json, sys
from contextlib import redirect_stdout
import pytest

class Selected:
    def pytest_collection_finish(self, session):  # after -m has deselected
        self.ids = [item.nodeid for item in session.items]

tiers, modules = sys.argv[1].split(","), sys.argv[2:]
outcome = {}
for tier in tiers:
    selected, out = Selected(), io.StringIO()
    with redirect_stdout(out):
        code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-m", tier, *modules],
                           plugins=[selected])
    outcome[tier] = [int(code), getattr(selected, "ids", []), out.getvalue()[-3000:]]
print(json.dumps(outcome))
"""


def _selected_by_tier() -> dict[str, set[str]]:
    done = subprocess.run([sys.executable, "-c", COLLECT_TIERS, ",".join(TIERS), *MODULES], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    for tier, (code, _, out) in outcome.items():
        assert code == 0, (tier, out)
    return {tier: set(ids) for tier, (_, ids, _) in outcome.items()}


def test_each_test_sits_in_the_tier_of_what_it_needs():
    selected = _selected_by_tier()
    unit, pipeline, services = selected["unit"], selected["pipeline"], selected["services"]
    demo = "tests/test_end_to_end.py::test_make_demo_reports_exactly_the_pinned_figures"
    browser = next(t for t in services if "test_the_ui_in_chromium" in t)
    assert demo in pipeline and demo not in unit | services  # reads demo_home
    assert browser in pipeline  # a test may sit in two tiers
    assert "tests/test_llm.py::test_cache_in_postgresql" in services - unit - pipeline
    assert "tests/test_llm.py::test_backoff_waits_doubling_intervals" in unit
    assert "tests/test_results_store.py" in {t.split("::")[0] for t in unit}  # its SQLite half
    assert any("[postgresql]" in t for t in services) and not any("[postgresql]" in t for t in unit)
    assert not unit & pipeline and not unit & services
    assert not any(t.startswith("tests/test_end_to_end.py") for t in unit)


def test_the_tests_of_one_module_share_a_worker():
    """`--dist loadgroup` sends each xdist group to one worker (tests/conftest.py groups a module's tests; each test
    of the demo home is a group of its own): with pytest 9.2 and xdist 3.8 the groups were silently ignored, every worker built the
    demo home and each module fixture, so this runs two small modules on two workers and checks each kept to one.
    The two are among the suite's cheapest to import and run (seconds for the three processes); under `--dist load`
    (no groups) their tests are spread over both workers."""
    import re

    modules = ["tests/test_prompts.py", "tests/test_report_csv.py"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadgroup", *modules], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = re.findall(r"\[(gw\d)\] \[[ \d]+%\] PASSED (tests/\w+\.py)::\w+(@\w+)", done.stdout)
    assert {module for _, module, _ in ran} == set(modules)
    for module in modules:
        assert len({worker for worker, m, _ in ran if m == module}) == 1, (module, ran)
        assert {group for _, m, group in ran if m == module} == {"@" + Path(module).stem}
