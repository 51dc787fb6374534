"""The suite's tiers (tests/conftest.py): what `make test-unit`, `test-pipeline` and `test-services` select."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = ["tests/test_end_to_end.py", "tests/test_llm.py", "tests/test_results_store.py"]


def _selected(tier: str) -> set[str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", tier,
                           *MODULES], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {line for line in done.stdout.splitlines() if "::" in line}


def test_each_test_sits_in_the_tier_of_what_it_needs():
    unit, pipeline, services = _selected("unit"), _selected("pipeline"), _selected("services")
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
    """`--dist loadgroup` sends each xdist group to one worker (tests/conftest.py groups a module's tests, and every
    test of the demo home): with pytest 9.2 and xdist 3.8 the groups were silently ignored, every worker built the
    demo home and each module fixture, so this runs two small modules on two workers and checks each kept to one."""
    import re

    modules = ["tests/test_leaderboard.py", "tests/test_subquestions.py"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadgroup", *modules], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = re.findall(r"\[(gw\d)\] \[[ \d]+%\] PASSED (tests/\w+\.py)::\w+(@\w+)", done.stdout)
    assert {module for _, module, _ in ran} == set(modules)
    for module in modules:
        assert len({worker for worker, m, _ in ran if m == module}) == 1, (module, ran)
        assert {group for _, m, group in ran if m == module} == {"@" + Path(module).stem}
