"""Command lines that cannot run end in one line on stderr and exit status 2, before anything runs."""

import pytest

from covlab.orchestration.cli import main

DATASET_TABLES = ["corpus", "queries", "nuggets", "nugget_links", "qrels", "candidates"]

# (arguments, what the message must say)
BAD_OPTIONS = [
    (["audit", "--value", "nan"], "covlab: --value nan: not a finite number; expected"),
    (["audit", "--value", "inf"], "covlab: --value inf: not a finite number; expected"),
    # argparse reads "-inf" and "-1e-3" after a space as options; "=" passes them as values
    (["audit", "--value=-inf", "--json"], "covlab: --value -inf: not a finite number; expected"),
    (["audit", "--value", "0.702", "--tolerance", "-1"], "covlab: --tolerance -1.0: negative; expected a finite "
                                                          "number >= 0"),
    (["audit", "--value", "0.702", "--tolerance=-1e-3"], "covlab: --tolerance -0.001: negative; expected"),
    (["audit", "--value", "0.702", "--tolerance", "nan"], "covlab: --tolerance nan: not a finite number; expected"),
    (["materialize", "--dataset", "demo", "--select", "bm25_pools", "no_such_asset"],
     "covlab: --select 'no_such_asset': no such asset; expected asset keys among answer_report, answers, bm25_index"),
    (["materialize", "--dataset", "demo", "--select", "corpus"],
     "covlab: --select: dataset_tables builds candidates, corpus, nugget_links, nuggets, qrels, queries in one "
     "step; expected all of them (add candidates, nugget_links, nuggets, qrels, queries)"),
]


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "Traceback" not in captured.err
    assert captured.err.count("\n") == 1 and captured.err.endswith("\n")
    return captured.err


@pytest.mark.parametrize("argv,message", BAD_OPTIONS, ids=[" ".join(a[1:]) for a, _ in BAD_OPTIONS])
def test_bad_option_values_are_one_line_errors(covlab_home, capsys, argv, message):
    assert main(argv) == 2
    assert message in _one_line_error(capsys)
    assert not (covlab_home / "dagster").exists()  # refused before any instance or run


# (file content or None for no file, what the message must say after "covlab: <file>")
BAD_CONFIGS = [
    (None, ": file not found; expected a YAML mapping"),
    ("ops:\n  bm25_pools:\n    config: {mode: given\n",
     ":4: invalid YAML (expected ',' or '}', but got '<stream end>', while parsing a flow mapping on line 3)"),
    ("ops:\n  bm25_pools:\n   config: x\n  - 1\n",
     ":4: invalid YAML (expected <block end>, but found '-', while parsing a block mapping on line 2)"),
    ("- ops\n- bm25_pools\n", ": top level is a list; expected a YAML mapping"),
    ("just text\n", ": top level is a str; expected a YAML mapping"),
    ("# nothing but a comment\n", ": no YAML content; expected a YAML mapping"),
    (b"ops: \xff\n", ": not valid UTF-8; expected a YAML mapping"),
]


@pytest.mark.parametrize("content,message", BAD_CONFIGS, ids=["missing", "unclosed-flow", "bad-indent", "list", "str",
                                                              "comment-only", "not-utf8"])
def test_missing_or_malformed_config_is_a_one_line_error(covlab_home, tmp_path, capsys, content, message):
    config = tmp_path / "run.yaml"
    if content is not None:
        config.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert main(["materialize", "--dataset", "demo", "--config", str(config)]) == 2
    assert f"covlab: {config}{message}" in _one_line_error(capsys)
    assert not (covlab_home / "dagster").exists()


def test_config_dagster_rejects_is_a_one_line_error_and_runs_nothing(covlab_home, tmp_path, capsys, instance):
    config = tmp_path / "run.yaml"
    config.write_text("ops:\n  no_such_op:\n    config: {}\n")
    assert main(["materialize", "--dataset", "demo", "--select", *DATASET_TABLES, "--config", str(config)]) == 2
    error = _one_line_error(capsys)
    assert f"covlab: {config}: Received unexpected config entry \"no_such_op\" at path root:ops" in error
    assert "expected config for the selected assets only" in error
    assert instance.get_runs() == []
