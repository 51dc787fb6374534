"""Content versions (models/versions.py): equal contents give equal versions, whatever the storage place
or row order; any change of a value, a dtype or a column gives another; resources/source.py's git state."""

import subprocess

import numpy as np
import pandas as pd
import pytest

from covlab.models.versions import content_version, directory_hash, file_hash, record_version, table_version
from covlab.resources.source import SourceError, add_worktree, read_source_state, remove_worktree

TABLE = pd.DataFrame({"query_id": ["q1", "q1", "q2"], "doc_id": ["d1", "d2", "d1"], "rank": [1, 2, 1],
                      "score": [0.5, 0.25, 1.0]})


def test_table_version_ignores_row_and_column_order_but_not_values_dtypes_or_names():
    version = table_version(TABLE)
    assert table_version(TABLE.iloc[::-1].reset_index(drop=True)) == version
    assert table_version(TABLE[["score", "rank", "doc_id", "query_id"]]) == version
    assert table_version(TABLE.set_index(pd.Index([7, 8, 9]))) == version  # the index is not stored
    assert table_version(TABLE.assign(score=[0.5, 0.25, 1.0 + 1e-15])) != version  # bits, not rounding
    assert table_version(TABLE.assign(rank=TABLE["rank"].astype("int32"))) != version
    assert table_version(TABLE.rename(columns={"score": "value"})) != version
    assert table_version(TABLE.iloc[:2]) != version
    assert table_version(pd.concat([TABLE, TABLE.iloc[:1]])) != version  # rows are a multiset, not a set
    assert table_version(TABLE.iloc[:0]) != table_version(TABLE.iloc[:0].drop(columns="score"))


def test_table_version_hashes_array_and_list_cells_by_content():
    embeddings = pd.DataFrame({"id": ["a", "b"], "vector": [np.array([1.0, 2.0]), np.array([3.0, 4.0])]})
    same = pd.DataFrame({"id": ["b", "a"], "vector": [np.array([3.0, 4.0]), np.array([1.0, 2.0])]})
    assert table_version(embeddings) == table_version(same)
    other = embeddings.assign(vector=[np.array([1.0, 2.0]), np.array([3.0, 4.5])])
    assert table_version(other) != table_version(embeddings)
    lists = pd.DataFrame({"id": ["a"], "docs": [["d1", "d2"]]})
    assert table_version(lists) != table_version(lists.assign(docs=[["d2", "d1"]]))


def test_record_version_leaves_out_where_the_content_lives():
    model = {"name": "covlab.demo.x", "version": 3, "uri": "models:/covlab.demo.x/3", "mlflow_run_id": "abc",
             "source": "file:///a/mlflow", "path": "/a/artifacts/x/v3", "content_hash": "f00d", "dev_auc": 0.75}
    moved = {**model, "version": 1, "uri": "models:/covlab.demo.x/1", "mlflow_run_id": "def",
             "source": "file:///b/mlflow", "path": "/b/artifacts/x/v1"}
    assert record_version(moved) == record_version(model)
    assert record_version({**model, "content_hash": "beef"}) != record_version(model)
    assert record_version({**model, "dev_auc": 0.7500001}) != record_version(model)
    assert content_version(model) == record_version(model) and content_version(TABLE) == table_version(TABLE)
    with pytest.raises(TypeError, match="expected a DataFrame, dict or list"):
        content_version("text")


def test_directory_hash_depends_on_relative_paths_and_bytes_only(tmp_path):
    for root in ("a", "b"):
        (tmp_path / root / "sub").mkdir(parents=True)
        (tmp_path / root / "weights.bin").write_bytes(b"\x00\x01")
        (tmp_path / root / "sub" / "config.json").write_text("{}")
    assert directory_hash(tmp_path / "a") == directory_hash(tmp_path / "b")
    (tmp_path / "b" / "sub" / "config.json").rename(tmp_path / "b" / "config.json")
    assert directory_hash(tmp_path / "a") != directory_hash(tmp_path / "b")
    assert file_hash(tmp_path / "a" / "weights.bin") == \
        "b413f47d13ee2fe6c845b2ee141af81de858df4ec549a58b7970bb96645bc8d2"  # sha256 of b"\x00\x01"


def _git(cwd, *args):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def test_source_state_sees_commits_and_uncommitted_changes_and_worktrees_check_out_a_commit(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@example.org")
    _git(repo, "config", "user.name", "t")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "a.py")
    _git(repo, "commit", "-q", "-m", "one")
    first = _git(repo, "rev-parse", "HEAD")
    assert read_source_state(repo).to_dict() == {"commit": first, "dirty": False}
    (repo / "a.py").write_text("x = 2\n")
    assert read_source_state(repo).dirty is True
    _git(repo, "commit", "-q", "-am", "two")
    (repo / "new.py").write_text("")  # untracked and not ignored: code that ran, not in the commit
    assert read_source_state(repo).dirty is True
    assert read_source_state(tmp_path / "elsewhere").commit is None

    tree = add_worktree(first, tmp_path / "checkout", repo)
    assert tree == tmp_path / "checkout" / "covlab" and (tree / "a.py").read_text() == "x = 1\n"
    assert read_source_state(tree).to_dict() == {"commit": first, "dirty": False}
    remove_worktree(tree, repo)
    assert not tree.exists()
    with pytest.raises(SourceError, match="not in the repository"):
        add_worktree("0" * 40, tmp_path / "nowhere", repo)


def test_value_differences_name_rows_columns_and_the_largest_numeric_gap():
    from covlab.models.versions import value_differences

    assert value_differences(TABLE, TABLE.iloc[::-1]) == []
    tampered = TABLE.assign(score=[0.5, 0.75, 1.0])
    assert value_differences(TABLE, tampered.iloc[::-1]) == ["score: max |difference| 0.5"]
    assert value_differences(TABLE, TABLE.iloc[:2]) == ["rows: 3 recorded vs 2 rebuilt"]
    renamed = TABLE.assign(doc_id=["d1", "d3", "d1"])
    assert value_differences(TABLE, renamed) == ["doc_id: 1 of 3 cells differ"]
    assert value_differences(TABLE.drop(columns="score"), TABLE)[0].startswith("columns only in the recorded value: []")
    assert value_differences({"a": 1, "path": "/x"}, {"a": 2, "path": "/y"}) == ["a: 1 vs 2"]


def test_a_saved_model_directory_has_the_same_bytes_whether_or_not_the_hub_was_offline(tiny_model_dir, tmp_path):
    """transformers keeps `local_files_only` (set by HF_HUB_OFFLINE=1) in the tokenizer's init kwargs; saved,
    it would make the same weights hash differently under `make demo` and a plain shell."""
    from transformers import AutoModel, AutoTokenizer

    from covlab.models.encoders import save_model_directory

    model = AutoModel.from_pretrained(str(tiny_model_dir))
    for name, offline in (("offline", True), ("online", False)):
        tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=offline)
        save_model_directory(model, tokenizer, tmp_path / name, {"seed": 0})
    assert "local_files_only" not in (tmp_path / "offline" / "tokenizer_config.json").read_text()
    assert directory_hash(tmp_path / "offline") == directory_hash(tmp_path / "online")
