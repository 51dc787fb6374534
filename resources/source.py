"""The source code that runs: its git commit, whether the checkout has uncommitted changes, and a
checkout of another commit.

Every materialization records the state (assets/outputs.py, metadata entry `git`) so that `covlab
reproduce` rebuilds a figure with the code that produced it: in this checkout when it is that commit and
clean, else in a git worktree of the recorded commit. A dirty tree cannot be rebuilt from a commit."""

from __future__ import annotations

import functools
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

# The checkout holding this package: the repository root is the package folder `covlab`.
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
# Metadata entry of every materialization (assets/outputs.py): {"commit": ..., "dirty": ...} of the code that ran.
SOURCE_METADATA = "git"
# Metadata entry: Python, machine and, when the step used torch, its version and intra-op thread count (a
# different thread count may change float reductions, so a rebuild elsewhere may differ in the last bits).
RUNTIME_METADATA = "runtime"


class SourceError(RuntimeError):
    """A git operation that the caller cannot do without (an unknown commit, no git checkout)."""


@dataclass(frozen=True)
class SourceState:
    commit: str | None  # None: not a git checkout, or git is missing
    dirty: bool | None  # uncommitted changes to tracked files, or untracked files git does not ignore

    def to_dict(self) -> dict:
        return asdict(self)


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(["git", *args], 1, "", str(exc))


def read_source_state(root: Path = PACKAGE_ROOT) -> SourceState:
    """The git state of the checkout at `root`, read now."""
    head = _git(root, "rev-parse", "HEAD")
    if head.returncode != 0:
        return SourceState(None, None)
    status = _git(root, "status", "--porcelain", "--untracked-files=normal")
    return SourceState(head.stdout.strip(), bool(status.stdout.strip()) if status.returncode == 0 else None)


@functools.lru_cache(maxsize=None)
def source_state(root: Path = PACKAGE_ROOT) -> SourceState:
    """`read_source_state`, read once per process: every step of a run records the same state."""
    return read_source_state(root)


def add_worktree(commit: str, folder: Path, root: Path = PACKAGE_ROOT) -> Path:
    """A detached git worktree of `commit` at `folder / "covlab"` (importable as the package `covlab` with
    `folder` on PYTHONPATH); SourceError when the commit is not in the repository at `root`."""
    known = _git(root, "cat-file", "-e", f"{commit}^{{commit}}")
    if known.returncode != 0:
        raise SourceError(f"commit {commit} is not in the repository at {root}; fetch it first")
    tree = folder / "covlab"
    done = _git(root, "worktree", "add", "--detach", str(tree), commit)
    if done.returncode != 0:
        raise SourceError(f"git worktree add {tree} {commit} failed: {done.stderr.strip()}")
    return tree


def remove_worktree(tree: Path, root: Path = PACKAGE_ROOT) -> None:
    _git(root, "worktree", "remove", "--force", str(tree))
