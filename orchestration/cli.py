"""`covlab`: register datasets, materialize a dataset's assets, run the demo.

    covlab demo                                    # every asset on the embedded demo dataset
    covlab dataset add NAME --format F --path P    # register a dataset (a new partition)
        [--columns FIELD=COLUMN,...] [--rating-threshold R]   # options of --format table, crux
        [--models-from SOURCE[@ALIAS|@vN]] [--like OTHER]    # adopt SOURCE's models; OTHER's data under NAME
    covlab dataset list                            # name, format, path, and options as dataset add flags
    covlab dataset generate longdoc --out DIR [--profile small|full] [--seed N]   # write a generated dataset
    covlab materialize --dataset NAME [--select SELECTION ...] [--config run_config.yaml]   # +KEY: with its upstreams
    covlab audit --dataset NAME --method M --metric alpha_ndcg@10 [--split test] [--budget k=10|tokens=256]
    covlab audit --value 0.702 [--tolerance 5e-4] [--all] [--full] [--json]   # a number's branch and its cost
    covlab audit --help                            # also lists the methods, metrics, splits in the results store
    covlab reproduce --value 0.664 [--allow-dirty] [--keep] [--json]   # rebuild a figure from its lineage, compare
    covlab leaderboard --dataset NAME [--json]     # which selector, at which budget: the newest reports ranked
    covlab methods                                 # every method of the registry: its reports, label, description
    covlab serve [--dataset NAME] [--method M ...] [--port 8080]   # the selectors over HTTP on 127.0.0.1
    covlab slots list                              # runs holding the gpu pool's slot, and whether they live
    covlab slots free [--run RUN_ID ...]           # free the slots of runs that died
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import textwrap
import time
import uuid
from pathlib import Path

import yaml


IN_PROCESS_JOB = "__ephemeral_asset_job__"  # the name Dagster's `materialize` gives the job of its runs


def _instance():
    """The Dagster instance (opened under its lock: orchestration/instance.py instance_lock), with every
    registered dataset a partition: a registration whose command failed after updating datasets.json gets
    its partition here, so the registry and the partitions agree."""
    from covlab.orchestration.instance import instance_lock, open_instance

    registry = _registry()
    with instance_lock() as home:
        instance = open_instance(home)
        _add_partitions(instance, registry.entries())
    return instance


def _add_partitions(instance, names) -> None:
    """Adds the dataset partitions among `names` that the instance lacks; the caller holds the instance lock
    (two processes adding one partition at once would collide on Dagster's unique index)."""
    from covlab.assets.partitions import DATASETS

    missing = sorted(set(names) - set(instance.get_dynamic_partitions(DATASETS.name)))
    if missing:
        instance.add_dynamic_partitions(DATASETS.name, missing)


def _registry():
    from covlab.resources.home import dataset_registry

    return dataset_registry()  # the one default_resources holds, without importing every asset


def dataset_add(name: str, fmt: str | None, path: str | None, replace: bool = False, columns: str | None = None,
                rating_threshold: int | None = None, models_from: str | None = None, like: str | None = None) -> None:
    """Read the dataset, then register it with its options: --columns (format table) as {covlab field: column},
    --rating-threshold (format crux); an option not given is left out of the entry. --like OTHER: the format, path
    and options of registered dataset OTHER (the same data under another name, e.g. to evaluate it with another
    dataset's models); --models-from SOURCE: its trained assets adopt SOURCE's registered models
    (models/adoption.py)."""
    from covlab.models.schemas import DatasetError
    from covlab.orchestration.instance import instance_lock, open_instance
    from covlab.resources.datasets import read_dataset
    from covlab.resources.table_format import parse_columns

    registry = _registry()
    options = {"columns": parse_columns(columns) if columns is not None else None,
               "rating_threshold": rating_threshold}
    options = {key: value for key, value in options.items() if value is not None}
    if like is not None:
        entries = registry.entries()
        if like not in entries:
            raise DatasetError(f"--like {like!r}: no such dataset; registered: {', '.join(sorted(entries))}")
        if fmt is not None or path is not None or options:
            raise DatasetError(f"--like {like!r} takes the format, path and options of {like!r}; give either --like "
                               "or --format/--path and their options")
        fmt, path, options = entries[like]["format"], entries[like]["path"], dict(entries[like].get("options") or {})
    if fmt is None:
        raise DatasetError("expected --format F (with --path P), or --like OTHER")
    dataset = read_dataset(name, fmt, path, options)  # refuse a bad name or a dataset that does not read cleanly
    with instance_lock() as home:  # the registry and the partitions change together
        instance = open_instance(home)  # first: an instance that cannot be opened leaves the registry alone
        entry = registry.register(name, fmt, path, replace=replace, options=options, models_from=models_from)
        _add_partitions(instance, registry.entries())
    adopts = f"; its trained assets adopt the models of {entry['models_from']}" if "models_from" in entry else ""
    print(f"registered {name!r} ({entry['format']}, {entry['path']}): {len(dataset.queries)} queries, "
          f"{len(dataset.corpus)} documents, {len(dataset.nuggets)} nuggets{adopts}")


def option_flags(options: dict) -> str:
    """A dataset's registered options as the `covlab dataset add` flags that give them: `--columns
    query_id=qid,... --rating-threshold 3`."""
    flags = []
    for name, value in sorted(options.items()):
        text = ",".join(f"{field}={column}" for field, column in value.items()) if isinstance(value, dict) else value
        flags += [f"--{name.replace('_', '-')}", shlex.quote(str(text))]
    return " ".join(flags)


def dataset_generate(generator: str, out: str, profile: str, seed: int) -> None:
    """Write a generated dataset (resources/longdoc_dataset.py) in the covlab layout, then say how to add it."""
    from covlab.resources.longdoc_dataset import write_longdoc

    try:
        folder = write_longdoc(Path(out), profile, seed)
    except FileExistsError as exc:
        raise UsageError(f"--out {exc}") from None
    print(f"wrote {generator} (profile {profile}, seed {seed}) to {folder}")
    print(f"next: covlab dataset add {generator} --format covlab --path {shlex.quote(str(folder))}")


# One token of a `--select` value: a quoted string, an attribute filter (`key:`, `group:`, `tag:"k"="v"`, ...), a
# word (an asset name, an operator, or a function when followed by "("), or any other character.
_SELECT_TOKEN = (r'"[^"]*"|[A-Za-z_]\w*:(?:"[^"]*"|[^\s()"]*)(?:=(?:"[^"]*"|[^\s()"]*))?'
                 r'|(?P<word>[A-Za-z_][\w/]*)(?P<call>\()?|.')
SELECT_SYNTAX = ("an asset key, +KEY (with all its upstreams), KEY+ (with all its downstreams), key:PATTERN, "
                 "group:NAME, kind:NAME, tag:KEY[=VALUE], owner:NAME, combined with and, or, not and parentheses")


def _select_tokens(value: str):
    """(token, bare name or None) for each token of a `--select` value: a bare name is a word that is neither an
    operator (and, or, not) nor a function (sinks(...), roots(...))."""
    import re

    for match in re.finditer(_SELECT_TOKEN, value, re.S):
        word = match.group("word")
        bare = word if word and not match.group("call") and word.lower() not in ("and", "or", "not") else None
        yield match.group(0), bare


def _select_one(value, assets) -> set:
    """The asset keys that one `--select` value names. A bare name is read as `key:"name"`, so that `+x` and `x+`
    are all of x's upstreams and downstreams as in Dagster's selection syntax (Dagster's own parser reads a bare
    `+x` in its older op syntax: one layer per `+`); where that rewrite does not parse, the value as written
    (the older `*x`, `++x`). UsageError for a value Dagster cannot parse, resolve, or that names no asset."""
    import warnings

    from dagster import AssetKey, AssetSelection, BetaWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BetaWarning)  # Dagster's parser passes its beta include_sources along
        if isinstance(value, AssetKey):
            selections = [AssetSelection.assets(value)]
        else:
            rewritten = "".join(f'key:"{bare}"' if bare else token for token, bare in _select_tokens(value))
            selections = []
            for text in dict.fromkeys([rewritten, value]):
                try:
                    selections.append(AssetSelection.from_string(text))
                except Exception as exc:  # Dagster's DagsterInvalidAssetSelectionError, not exported
                    error = exc
            if not selections:
                raise UsageError(f"--select {value!r}: Dagster cannot parse it ({' '.join(str(error).split())}); "
                                 f"expected {SELECT_SYNTAX}")
        try:
            keys = set(selections[0].resolve(assets, allow_missing=True))
        except Exception as exc:  # status:, column:, code_location: need the webserver's view of the instance
            reason = " ".join(str(exc).split()) or "a filter this Dagster resolves only in its UI"
            raise UsageError(f"--select {value!r}: Dagster cannot resolve it against covlab's asset graph "
                             f"({type(exc).__name__}: {reason}); expected {SELECT_SYNTAX}") from None
    if not keys:
        raise UsageError(_names_nothing(value, assets))
    return keys


def _names_nothing(value, assets) -> str:
    """Why the `--select` value `value` names no asset: each of its filters that matches nothing, with the values
    there are and the nearest to what was written."""
    import difflib
    import re
    import warnings

    from dagster import AssetSelection, BetaWarning

    specs = [a.get_asset_spec(key) for a in assets for key in a.keys]
    known = {"key": sorted(s.key.to_user_string() for s in specs),
             "group": sorted({s.group_name for s in specs if s.group_name}),
             "kind": sorted({kind for s in specs for kind in s.kinds}),
             "owner": sorted({owner for s in specs for owner in s.owners}),
             "tag": sorted({f"{k}={v}" if v else k for s in specs for k, v in s.tags.items()
                            if not k.startswith("dagster/")})}
    text = value.to_user_string() if not isinstance(value, str) else value
    filters = [(f'key:"{bare}"', "key", bare) if bare else (token, *token.split(":", 1))
               for token, bare in _select_tokens(text) if bare or (":" in token and not token.startswith('"'))]
    missing = []
    for token, attr, written in filters:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", BetaWarning)
            try:
                if AssetSelection.from_string(token).resolve(assets, allow_missing=True):
                    continue
            except Exception:
                pass
        missing.append((attr, re.sub(r"\+\d*$", "", written.replace('"', ""))))  # key:x+ names x
    if not missing:
        return f"--select {text!r}: names no asset (each of its filters matches some, together they match none)"
    reasons = []
    for attr, written in missing:
        near = difflib.get_close_matches(written, known.get(attr, []), n=3, cutoff=0.6)
        hint = f"; nearest to {written!r}: {', '.join(near)}" if near else ""
        if attr == "key":
            reasons.append(f"no such asset; expected asset keys among {', '.join(known['key'])}{hint}")
        elif attr in known:
            reasons.append(f"no {attr} {written!r}; the {attr}s are {', '.join(known[attr]) or '(none)'}{hint}")
        else:
            reasons.append(f"{attr}:{written} matches no asset")
    return f"--select {text!r}: " + "; ".join(dict.fromkeys(reasons))


def select_assets(select, assets=None) -> tuple[set, list[str]]:
    """The asset keys that the `--select` values name, all of them together, each value in Dagster's asset
    selection syntax (SELECT_SYNTAX; plain keys as before) or an AssetKey; and, for each multi-asset that builds
    its keys in one step (dataset_tables, chunks) of which they name only some, the line saying it was widened
    to all of them. UsageError for a value that does not parse, or names no asset."""
    from dagster import AssetKey

    if assets is None:
        from covlab.orchestration.definitions import ASSETS as assets
    if isinstance(select, (str, AssetKey)):
        select = [select]
    keys = set().union(*(_select_one(value, assets) for value in select))
    notes = []
    for definition in assets:
        missing = definition.keys - keys
        if not definition.can_subset and missing and keys & definition.keys:
            keys |= missing
            together, added = (", ".join(sorted(k.to_user_string() for k in ks)) for ks in (definition.keys, missing))
            notes.append(f"{definition.node_def.name} builds {together} in one step: added {added}")
    return keys, notes


def _upstreams(assets) -> dict:
    """Asset key -> {each upstream key it reads: whether it declares that input optional (resources/io_manager.py
    OPTIONAL_INPUT)}, over `assets` (checks, which build no key, add nothing)."""
    from covlab.resources.io_manager import OPTIONAL_INPUT

    graph = {}
    for definition in assets:
        if not definition.keys:
            continue
        by_input = definition.keys_by_input_name
        optional = {by_input[d.name] for d in definition.node_def.input_defs
                    if d.name in by_input and (d.metadata or {}).get(OPTIONAL_INPUT)}
        for key in definition.keys:
            graph[key] = {upstream: upstream in optional for upstream in definition.asset_deps[key]}
    return graph


def untrained_assets(keys, assets) -> tuple[set, list[str]]:
    """What a run without training (resources/profile.py) builds of the selected `keys`, and the lines saying
    what it left out. Left out: every asset that trains a selector (models/registry.py TRAINED_SELECTORS) and
    every asset that reads one of those through an input it requires, however far down (a report's input of a
    method that trains is optional: the report runs and names the method); then what only fed what was left
    out (the subquestions and judgments the estimator trains on). Kept: the selection's reports (models/registry.py
    Report) and its last assets (those no other selected asset reads) that need no training, with what they
    read. UsageError when nothing of the selection is kept, naming what the last assets need."""
    from dagster import AssetKey

    from covlab.models.registry import TRAINED_SELECTORS, Report

    graph = _upstreams(assets)
    because = {AssetKey(t.asset): None for t in TRAINED_SELECTORS}  # left out -> the required input that left it
    while True:
        reads = {key: up for key, upstreams in graph.items() if key not in because
                 for up, optional in upstreams.items() if up in because and not optional}
        if not reads:
            break
        because |= reads
    trains = set(because)
    last = {key for key in keys if not any(key in graph.get(other, {}) for other in keys)}
    wanted = (last | {AssetKey(report.value) for report in Report}) & keys
    kept, stack = set(), sorted(wanted - trains, key=lambda k: k.to_user_string())
    while stack:
        key = stack.pop()
        if key not in kept:
            kept.add(key)
            stack += [up for up in graph.get(key, {}) if up in keys and up not in trains]
    for definition in assets:  # a multi-asset that builds its keys in one step keeps all of them
        if not definition.can_subset and kept & definition.keys:
            kept |= definition.keys & keys

    def names(found) -> str:
        return ", ".join(sorted(k.to_user_string() for k in found))

    def chain(key) -> str:
        steps = [key]
        while because[steps[-1]] is not None:
            steps.append(because[steps[-1]])
        return " <- ".join(k.to_user_string() for k in steps) + " (trains)"

    if not kept:
        raise UsageError("the untrained profile leaves nothing of the selection to build: "
                         + "; ".join(chain(key) for key in sorted(last, key=lambda k: k.to_user_string()))
                         + "; expected a selection such as +comparison_report")
    notes = []
    if keys & trains:
        notes.append(f"the untrained profile leaves out what trains or reads a trained model: {names(keys & trains)}")
    if keys - trains - kept:
        notes.append(f"the untrained profile leaves out what only fed those: {names(keys - trains - kept)}")
    return kept, notes


def materialize(dataset: str, select: list | None, config: dict | None, instance=None,
                raise_on_error: bool = True, run_id: str | None = None):
    """Run the selected assets (default: all) of one dataset partition in this process (as run `run_id`, when
    given), first marking failed the runs that died and freeing their pool slots (orchestration/concurrency.py:
    pool_slots_guard), and removing the run-versioned artifact folders of runs that did not succeed. Dagster's
    `materialize`, with covlab's console logger (orchestration/console.py: a line per finished step) in place of
    Dagster's; resource settings in `config` are laid over the configured ones (with_resource_settings).
    `select`: Dagster asset selection strings or AssetKeys (select_assets); every selected asset is built, an
    upstream already materialized for `dataset` too. A config that sets the untrained profile (configs/untrained.yaml)
    builds what `untrained_assets` keeps of the selection."""
    from dagster import Definitions, define_asset_job

    from covlab.assets.partitions import DATASETS
    from covlab.models.dataset import check_dataset_name
    from covlab.orchestration.concurrency import log_to_console, pool_slots_guard
    from covlab.orchestration.console import covlab_console
    from covlab.orchestration.definitions import ASSETS, OBSERVED_ASSETS, default_resources, with_resource_settings
    from covlab.resources.device import heap_frozen_for_run
    from covlab.resources.profile import untrained_in

    check_dataset_name(dataset)
    selection = None
    if select:
        keys, notes = select_assets(select, ASSETS)
        for note in notes:
            print(f"covlab: {note}")
        selection = sorted(keys, key=lambda key: key.to_user_string())
    instance = instance or _instance()
    if dataset not in _registry().entries():
        raise SystemExit(f"dataset {dataset!r} is not registered; run `covlab dataset add {dataset} ...` first")
    if not instance.has_dynamic_partition(DATASETS.name, dataset):  # an instance the caller opened
        instance.add_dynamic_partitions(DATASETS.name, [dataset])
    resources = default_resources()
    refuse_config_of_configless_ops(config or {}, ASSETS, resources)
    run_config = with_resource_settings(resources, {"loggers": {"console": {"config": {"log_level": "INFO"}}},
                                                    **(config or {})})
    if untrained_in(run_config):
        keys, notes = untrained_assets(set(selection) if selection else {k for a in ASSETS for k in a.keys}, ASSETS)
        for note in notes:
            print(f"covlab: {note}")
        selection = sorted(keys, key=lambda key: key.to_user_string())
    log_to_console()
    job = Definitions(assets=[*ASSETS, *OBSERVED_ASSETS], resources=resources, loggers={"console": covlab_console},
                      jobs=[define_asset_job(IN_PROCESS_JOB, selection=selection)]).resolve_job_def(IN_PROCESS_JOB)
    with pool_slots_guard(instance) as tags, heap_frozen_for_run():
        resources["artifacts"].discard_failed_runs(instance)
        return job.execute_in_process(run_config=run_config, instance=instance, partition_key=dataset,
                                      raise_on_error=raise_on_error, tags=tags, run_id=run_id)


def run_failed(error: BaseException, instance, run_id: str) -> str:
    """After run `run_id` raised `error`: the one line saying why (orchestration/failures.py), once the run is
    marked failed (Dagster could not, e.g. on a full disk, until space was freed) and the artifact folders it
    began are removed."""
    from covlab.orchestration.definitions import default_resources
    from covlab.orchestration.failures import failure_line

    resources = default_resources()
    line = failure_line(error, instance, run_id, resources)
    try:
        run = instance.get_run_by_id(run_id)
        if run is not None and not run.is_finished:
            instance.report_run_failed(run, f"covlab marked this run failed: {line}")
        resources["artifacts"].discard_failed_runs(instance, [run_id])
    except Exception as exc:  # e.g. the disk is still full: the next covlab command marks it (end_dead_runs)
        line += f"; the run could not be marked failed yet ({type(exc).__name__}), the next covlab command does"
    return line


def summarize(result, seconds: float) -> str:
    from covlab.orchestration.console import key_figures
    from covlab.orchestration.definitions import default_resources
    from covlab.resources.home import covlab_home

    lines = [f"covlab: run {result.run_id} succeeded in {seconds:.0f} s", "built:"]
    for event in result.get_asset_materialization_events():
        mat = event.event_specific_data.materialization
        lines.append(f"  {mat.asset_key.to_user_string():<28} [{mat.partition}] {key_figures(mat.metadata)}")
    for evaluation in result.get_asset_check_evaluations():
        lines.append(f"  check {evaluation.check_name:<30} {'passed' if evaluation.passed else 'FAILED'}")
    built = {e.event_specific_data.materialization.asset_key.to_user_string()
             for e in result.get_asset_materialization_events()}
    skipped = sorted(k for k in ("answers", "answer_report") if k not in built)
    if skipped:
        lines.append(f"skipped (no LLM configured: set COVLAB_LLM_BACKEND=openai, COVLAB_LLM_BASE_URL, "
                     f"COVLAB_LLM_MODEL): {', '.join(skipped)}")
    for event in result.get_asset_materialization_events():
        mat = event.event_specific_data.materialization
        if "answer" in mat.metadata:  # the leaderboard's answer per budget (models/leaderboard.py)
            lines += [f"{mat.asset_key.to_user_string()} [{mat.partition}] (the answer per budget; "
                      "`covlab leaderboard --dataset <name>` ranks every method):", mat.metadata["answer"].value]
        if "table1" in mat.metadata:
            lines += [f"{mat.asset_key.to_user_string()} [{mat.partition}] (Table 1 layout):",
                      mat.metadata["table1"].value]
        if "headroom" in mat.metadata:
            lines += [f"{mat.asset_key.to_user_string()} [{mat.partition}] (method x token budget):",
                      mat.metadata["summary"].value]
        if mat.asset_key.to_user_string() == "retrieval_report":
            lines += [f"retrieval_report [{mat.partition}] (whole-corpus retrieval, evidence within the token "
                      "budget):", mat.metadata["summary"].value]
        if mat.asset_key.to_user_string() == "pool_comparison":
            lines += [f"pool_comparison [{mat.partition}] (the same selections from the BM25 and the MCompass "
                      "pools):", mat.metadata["summary"].value]
    home = covlab_home()
    lines += [f"stored under {home}: tables in storage/, indexes, weights and report CSVs in artifacts/, the "
              "Dagster instance in dagster/, MLflow in mlflow/, report figures in results/results.db",
              "open the UI with `make ui` (http://127.0.0.1:3000) and MLflow with `make mlflow-ui` "
              f"({default_resources()['tracking'].ui_base_url()}); see which selector wins at which budget with "
              "`.venv/bin/covlab leaderboard --dataset <name>`, trace a number with `.venv/bin/covlab audit --value "
              "<number>`"]
    return "\n".join(lines)


def audit_command(args) -> int:
    """Print each figure asked for, the branch of its report's lineage that produced it (--full: the whole
    lineage with its detail lines) and what that branch cost; --json: the same in full detail."""
    from covlab.models.registry import METHOD
    from covlab.orchestration.definitions import default_resources
    from covlab.resources.lineage import branch_nodes, off_branch
    from covlab.resources.lineage_cost import StepClock, lineage_cost
    from covlab.resources.lineage_text import render_branch, render_text
    from covlab.resources.report_lineage import audit_figures

    instance, results = _instance(), default_resources()["results"]
    figures, earlier = _requested_figures(args, instance, results)
    audits, clock = audit_figures(instance, figures), StepClock(instance)
    for audit in audits:
        for figure in audit["figures"]:
            figure.update(_figure_context(figure, results, audit["branch"]))
    for audit in audits:  # what is shown: the figures' branch, or the whole lineage (--full, or no branch recorded)
        audit["shown"] = None if args.full else audit["branch"]
        audit["cost"] = lineage_cost(instance, branch_nodes(audit["shown"] or audit["lineage"], [audit["lineage"]]),
                                     scope="branch" if audit["shown"] else "lineage", clock=clock)
    if args.json:
        print(json.dumps([{"figures": a["figures"], "lineage": a["lineage"].to_dict(), "cost": a["cost"].to_dict()}
                          for a in audits], indent=2, sort_keys=True, default=str))
        return 0
    for audit in audits:
        lineage, shown = audit["lineage"], audit["shown"]
        for figure in audit["figures"]:
            where = ", ".join(f"{k}={figure[k]}" for k in ("dataset", "method", "split", "metric", "budget", "k",
                                                          "query_id") if figure.get(k) is not None)
            print(f"{figure['value']:.6f}  {where}"
                  + (f'  ("{METHOD[figure["method"]].label}" in the report)' if figure["method"] in METHOD else ""))
            if "n" in figure:
                print(f"  the mean over n={figure['n']} queries, 95% CI [{figure['ci_low']:.4f}, "
                      f"{figure['ci_high']:.4f}] (bootstrap over queries)")
            if figure.get("decisions"):
                print(f"  selected by: {figure['decisions']}")
        if args.full:
            print(render_text([lineage]))
        else:
            if shown is None:
                print("(the report recorded no method_inputs for these methods: its whole lineage, each node once)")
            print(render_branch(shown or lineage, [lineage]))
            hidden = off_branch(shown or lineage, [lineage])
            flagged = sum(bool(node.stale or node.gap or node.changed) for node in hidden)
            if hidden:
                print(f"(+ {len(hidden)} more node{'s' if len(hidden) != 1 else ''} of the report's lineage, not "
                      f"on this branch" + (f", {flagged} of them STALE, GAP or CHANGED" if flagged else "")
                      + "; --full shows the whole lineage)")
        print(audit["cost"].render())
        print()
    if earlier:
        print(f"({earlier} earlier materialization{'s' if earlier != 1 else ''} of the same report figures not "
              "shown; --all audits them too)")
    return 0


def _figure_context(figure: dict, results, branch) -> dict:
    """What a stored figure rests on: for a mean over queries, n and the 95% bootstrap CI of its per-query values
    in the same report materialization; for a selection on estimated coverage, its gate and blend decisions
    (resources/lineage.py `selection_decisions`)."""
    from covlab.models.statistics import mean_ci
    from covlab.resources.lineage import selection_decisions

    found = {}
    if figure.get("query_id") is None:
        rows = results.figures(dataset=figure["dataset"], method=figure["method"], metric=figure["metric"],
                               budget=figure.get("budget"), k=figure.get("k"), split=figure.get("split"),
                               materialization_id=figure["materialization_id"])
        per_query = rows.loc[rows["query_id"].notna(), "value"]
        if len(per_query):
            interval = mean_ci(per_query)
            found.update(n=interval["n"], ci_low=interval["ci_low"], ci_high=interval["ci_high"])
    decisions = selection_decisions(branch, figure["method"], figure.get("budget"))
    if decisions:
        found["decisions"] = decisions
    return found


def _requested_figures(args, instance, results):
    """The stored figures `covlab audit`/`reproduce` were asked for (--value, or --dataset, --method and
    --metric: the latest such aggregate figure, at --budget when given), and how many earlier materializations of
    them were left out; UsageError when the options name none or match figures at several budgets (_one_budget),
    FigureNotFound when nothing stored matches."""
    from covlab.resources.report_lineage import confirm_reports

    confirm_reports(instance, results)  # figures count once Dagster has recorded their report
    earlier = 0
    if args.value is not None:
        figures = results.find_value(args.value, args.tolerance, confirmed_only=True)
        if not getattr(args, "all", False):
            figures, earlier = _newest_of_each(figures)
    elif args.dataset and args.method and args.metric:
        budget = _budget(args.budget)
        figures = results.figures(dataset=args.dataset, method=args.method, metric=args.metric,
                                  budget=budget.tokens if budget else None, k=budget.k if budget else None,
                                  split=args.split, aggregate_only=True, confirmed_only=True)
        figures = _one_budget(args, figures).tail(1)  # the latest report's figure
    else:
        raise UsageError(f"{args.command}: give --value, or --dataset, --method and --metric")
    if figures.empty:
        raise FigureNotFound(f"{args.command}: no stored figure matches")
    return figures, earlier


def leaderboard_command(args) -> int:
    """Print the leaderboard of the newest confirmed comparison report (token budgets) and coverage report (k) of
    a dataset, each led by its answer per budget (models/leaderboard.py); --json: the rows as records."""
    from covlab.models.leaderboard import LEADERBOARD_REPORTS, answers, stored_leaderboard
    from covlab.orchestration.definitions import default_resources
    from covlab.resources.report_lineage import confirm_reports

    instance, results = _instance(), default_resources()["results"]
    confirm_reports(instance, results)  # a report counts once Dagster has recorded its materialization
    boards = {}
    for report in LEADERBOARD_REPORTS:
        stored = results.latest_report(args.dataset, report.value, confirmed_only=True)
        if stored is not None:
            boards[report.value] = (stored, stored_leaderboard(stored.figures, report, stored.record.config))
    if not boards:
        raise FigureNotFound(f"leaderboard: no confirmed {' or '.join(r.value for r in LEADERBOARD_REPORTS)} of "
                             f"dataset {args.dataset!r} in the results store; materialize it first")
    if args.json:
        print(json.dumps({name: {"results_store_report_id": stored.materialization_id, "run_id": stored.record.run_id,
                                 "rows": json.loads(table.to_json(orient="records"))}
                          for name, (stored, table) in boards.items()}, indent=2))
        return 0
    for name, (stored, table) in boards.items():
        print(f"{name} [{args.dataset}] (results store id {stored.materialization_id}, run {stored.record.run_id}):")
        print("\n".join(f"  {line}" for line in answers(table, stored.record.config.get("trained_on"),
                                                         stored.record.config.get("left_out"))))
        print(table.to_markdown(index=False, floatfmt=".3f"))
        print()
    return 0


def reproduce_command(args) -> int:
    """Rebuild each report materialization behind the requested figure(s) in a scratch home and compare:
    0 when REPRODUCED, 1 when DIVERGED, 2 when the lineage cannot be rebuilt (refused, with the reason)."""
    from covlab.orchestration.definitions import default_resources
    from covlab.orchestration.reproduce import ReproduceRefused, render, reproduce
    from covlab.resources.home import covlab_home
    from covlab.resources.materializations import plain

    instance, results = _instance(), default_resources()["results"]
    figures, _ = _requested_figures(args, instance, results)
    rows = [plain(row) for row in figures.to_dict("records")]
    by_report: dict[tuple, list[dict]] = {}
    for row in rows:
        by_report.setdefault((row["report_asset"], row["partition"], row["run_id"]), []).append(row)
    outcomes = []
    for group in by_report.values():
        try:
            result = reproduce(instance, group, covlab_home(), allow_dirty=args.allow_dirty, keep=args.keep,
                               scratch_root=Path(args.scratch) if args.scratch else None)
        except ReproduceRefused as exc:
            print(f"covlab reproduce: refused: {exc}", file=sys.stderr)
            return 2
        outcomes.append(result)
        if not args.json:
            print(render(result))
    if args.json:
        print(json.dumps([r.to_dict() for r in outcomes], indent=2, sort_keys=True, default=str))
    return 0 if all(r.reproduced for r in outcomes) else 1


def _figure_options(command: argparse.ArgumentParser, verb: str) -> None:
    """The options by which `covlab audit` and `covlab reproduce` name stored figures."""
    command.add_argument("--value", type=float, help=f"{verb} the stored figures equal to this number (as printed, "
                                                     "e.g. 0.702), the newest materialization of each")
    command.add_argument("--tolerance", type=float, default=5e-4,
                         help="how far a stored figure may be from --value (default 5e-4: a number printed to 3 "
                              "decimals)")
    command.add_argument("--dataset", help=f"with --method and --metric: {verb} the latest such aggregate figure")
    command.add_argument("--method", help="the method of the figure (`covlab audit --help` lists them)")
    command.add_argument("--metric", help="the metric of the figure, e.g. alpha_ndcg@10")
    command.add_argument("--split", help="query split of the figure (default: any)")
    command.add_argument("--budget", metavar="k=K|tokens=B",
                         help="with --dataset: the budget of the figure, k=10 (k documents: coverage_report) or "
                              "tokens=256 (a token budget: comparison_report); needed when the method's metric is "
                              "reported at several budgets")


def _budget(text: str | None):
    """`--budget` as a Budget (models/selectors.py): `k=<items>` or `tokens=<token budget>`; None when not given,
    UsageError when it is neither."""
    from covlab.models.selectors import BUDGET_UNITS, Budget

    if text is None:
        return None
    unit, _, limit = text.partition("=")
    try:
        if unit not in BUDGET_UNITS or not limit.isdigit():
            raise ValueError("expected k=<items> or tokens=<token budget>, e.g. k=10 or tokens=256")
        return Budget(**{unit: int(limit)})
    except ValueError as error:
        raise UsageError(f"--budget {text}: {error}") from None


def _one_budget(args, figures):
    """`figures` (a method's metric, aggregate) when they are all at one budget; UsageError listing each budget
    and the report holding it when they are at several: the newest of them is no answer to the question."""
    from covlab.resources.materializations import plain

    if len(figures[["budget", "k"]].drop_duplicates()) <= 1:
        return figures
    found = [plain(row) for row in figures[["k", "budget", "report_asset"]].drop_duplicates().to_dict("records")]
    listed = [(f"k={row['k']}" if row["k"] is not None else f"tokens={row['budget']}") + f" ({row['report_asset']})"
              for row in sorted(found, key=lambda row: (row["k"] is None, row["k"] or row["budget"]))]
    raise UsageError(f"{args.command}: {args.method} {args.metric} of {args.dataset}"
                     + (f" on {args.split}" if args.split else "")
                     + f" is reported at several budgets: {', '.join(listed)}; name one with --budget, e.g. "
                       f"--budget {listed[0].split()[0]}")


def _newest_of_each(figures):
    """The rows of `figures` from the newest report materialization holding each figure (same report, dataset,
    method, budget, k, split, metric and query), and how many earlier materializations held one of them."""
    identity = ["report_asset", "dataset", "method", "budget", "k", "split", "metric", "query_id"]
    newest = figures.groupby(identity, dropna=False)["materialization_id"].transform("max")
    keep = figures["materialization_id"] == newest
    return figures[keep], int(figures.loc[~keep, "materialization_id"].nunique())


class _AuditHelp(argparse.Action):
    """-h/--help of `covlab audit`: the help text, then what the results store holds, read only when asked."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.print_help()
        print()
        print(methods_help())
        print()
        print(_stored_figures_help())
        parser.exit()


def methods_help() -> str:
    """Every method of the registry (models/registry.py), one line each: name, the reports it appears in, its
    label, whether it is trained or a bound, and its description."""
    from covlab.models.registry import METHODS

    width = max(len(m.name) for m in METHODS)
    lines = ["methods (models/registry.py; the pool comparison names them <pool>:<method>):"]
    for m in METHODS:
        notes = ", ".join(filter(None, [f"trained: {m.trained}" if m.trained else "",
                                        "bound on gold labels" if m.bound else ""]))
        lines.append(f"  {m.name:<{width}}  [{', '.join(r.value for r in sorted(m.reports, key=lambda r: r.value))}]"
                     f"  {m.label}{f' ({notes})' if notes else ''}: {m.description}")
    return "\n".join(lines)


def _stored_figures_help() -> str:
    """The datasets, methods, metrics and splits of the figures in the results store, for `covlab audit --help`."""
    from sqlalchemy.exc import SQLAlchemyError

    from covlab.orchestration.definitions import default_resources
    from covlab.resources.home import covlab_home

    results = default_resources()["results"]
    try:
        catalog = results.catalog()
    except SQLAlchemyError as exc:
        return f"the results store could not be read ({type(exc).__name__}), so no stored figures are listed"
    finally:
        results.dispose()
    if not any(catalog.values()):
        return (f"the results store under {covlab_home()} holds no figures yet: materialize a report first "
                "(covlab demo, or covlab materialize --dataset NAME)")
    lines = [f"in the results store under {covlab_home()}:"]
    for name, values in catalog.items():
        lines += textwrap.wrap(f"{name}: {', '.join(values) or '(none)'}", width=110, initial_indent="  ",
                               subsequent_indent="    ")
    return "\n".join(lines)


class UsageError(ValueError):
    """A command line that cannot run as given; main prints the message on one line and exits with 2."""


class FigureNotFound(LookupError):
    """No stored figure matches what `covlab audit`/`reproduce` were asked for (exit status 1)."""


def _check_args(args) -> None:
    """Refuse, before anything runs, option values that argparse's types let through."""
    if args.command in ("audit", "reproduce"):
        if args.value is not None and not math.isfinite(args.value):
            raise UsageError(f"--value {args.value}: not a finite number; expected a figure as reported, e.g. 0.702")
        if not (math.isfinite(args.tolerance) and args.tolerance >= 0):
            wrong = "negative" if args.tolerance < 0 else "not a finite number"
            raise UsageError(f"--tolerance {args.tolerance}: {wrong}; expected a finite number >= 0, e.g. 5e-4")
        _budget(args.budget)


def read_run_config(path: str) -> dict:
    """The YAML run config in `path`; UsageError naming the file, and the line of a YAML syntax error."""
    expected = "expected a YAML mapping such as `ops: {bm25_pools: {config: {mode: given}}}`"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{path}: file not found; {expected}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not valid UTF-8; {expected}") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot be read ({exc.strerror}); {expected}") from None
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark, context = getattr(exc, "problem_mark", None), getattr(exc, "context_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        if context is not None and exc.context:
            problem += f", {exc.context} on line {context.line + 1}"
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        raise UsageError(f"{where}: invalid YAML ({problem}); {expected}") from None
    if not isinstance(config, dict):
        found = "no YAML content" if config is None else f"top level is a {type(config).__name__}"
        raise UsageError(f"{path}: {found}; {expected}")
    return config


def refuse_config_of_configless_ops(run_config: dict, assets, resources: dict) -> None:
    """UsageError for settings given under `ops:` to an asset that takes no config, which Dagster accepts and
    ignores: it names the asset, the settings and the resources that hold them (e.g. prune_top_m:
    estimator_scoring), so that a setting kept in a resource is never silently left out of a run."""
    from dagster import AssetsDefinition, ConfigurableResource

    configless = {a.node_def.name for a in assets
                  if isinstance(a, AssetsDefinition) and a.op.config_field.config_type.key == "Any"}
    for op, entry in (run_config.get("ops") or {}).items():
        given = entry.get("config") if isinstance(entry, dict) else None
        if op in configless and isinstance(given, dict) and given:
            homes = [f"{name}: resources.{key}.config" for name in given for key, resource in resources.items()
                     if isinstance(resource, ConfigurableResource) and name in type(resource).model_fields]
            raise UsageError(f"ops.{op}.config: {op} takes no config (given: {', '.join(given)})"
                             + (f"; set {', '.join(homes)} instead" if homes else ""))


def slots_command(args) -> int:
    """`covlab slots list`: the runs holding or waiting for concurrency-pool slots; `covlab slots free`:
    free the slots of runs that are over or whose process is gone, and of the runs given with --run."""
    from covlab.orchestration.concurrency import free_stale_slots, pool_slots

    instance = _instance()
    slots = pool_slots(instance)
    if args.action == "list":
        for pool, limit in slots.limits.items():
            print(f"pool {pool!r}: limit {limit}, {len(slots.holding(pool))} run(s) holding a slot")
        for holder in slots.holders:
            print(f"  {holder.describe()}")
        if not slots.holders:
            print("no run holds or waits for a pool slot")
        return 0
    freed = free_stale_slots(instance, args.run or ())
    for holder in slots.holders:
        if holder.run_id in freed:
            ended = "" if holder.run is None or holder.run.is_finished else "; marked ended"
            print(f"freed {holder.describe()}{ended}")
    refused = 0
    for run_id in args.run or ():
        holder = next((h for h in slots.holders if h.run_id == run_id), None)
        if holder is None:
            print(f"covlab: run {run_id} holds no pool slot", file=sys.stderr)
            refused += 1
        elif holder.alive:
            print(f"covlab: run {run_id} is still running (pid {holder.pid} on {holder.host}); stop that "
                  f"process first", file=sys.stderr)
            refused += 1
    if not freed and not refused:
        print("nothing to free: every run holding a pool slot is alive or cannot be judged "
              "(`covlab slots list`; free one with `covlab slots free --run RUN_ID`)" if slots.holders
              else "nothing to free: no run holds a pool slot")
    return 1 if refused else 0


def serve_command(args) -> int:
    """`covlab serve`: covlab.serving.http.serve with the flags' settings; a method that cannot load exits 2."""
    from dataclasses import fields

    from covlab.serving import ServingError
    from covlab.serving.http import ServeSettings, serve, serve_token
    from covlab.serving.settings import Limits

    try:
        limits = Limits(**{setting.name: getattr(args, setting.name) for setting in fields(Limits)})
    except ValueError as exc:
        raise UsageError(f"--{str(exc).replace('_', '-')}") from None
    try:
        token = serve_token()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not (math.isfinite(args.poll_seconds) and args.poll_seconds >= 0):
        raise UsageError(f"--poll-seconds {args.poll_seconds}: expected a finite number >= 0 (0: do not poll)")
    if not (math.isfinite(args.shutdown_seconds) and args.shutdown_seconds >= 0):
        raise UsageError(f"--shutdown-seconds {args.shutdown_seconds}: expected a finite number >= 0")
    try:
        serve(ServeSettings(tuple(args.method or ()), args.dataset, args.alias, args.tracking_uri, args.host,
                            args.port, args.poll_seconds, args.device, limits, args.shutdown_seconds, token,
                            args.runtime))
    except ServingError as exc:
        raise UsageError(str(exc)) from None
    return 0


def _serve_parser(commands) -> None:
    from dataclasses import fields

    from covlab.models.runtime import DEFAULT_RUNTIME, RUNTIMES
    from covlab.serving.settings import (DEFAULT_HOST, DEFAULT_POLL_SECONDS, DEFAULT_PORT, DEFAULT_SHUTDOWN_SECONDS,
                                         TOKEN_VARIABLE, Limits)

    serve = commands.add_parser(
        "serve", help="the registry's selectors and corpus retriever over HTTP (POST /v1/select, POST /v1/retrieve, "
                      "GET /v1/methods, /docs)",
        description="Serve covlab.serving's selectors and, with --dataset, its corpus retriever over HTTP "
                    "(serving/http.py), following the registry: a method whose model alias moves is reloaded and "
                    "swapped in without a restart. It listens on 127.0.0.1 unless --host says otherwise; any other "
                    "address (0.0.0.0: every interface) serves whoever can reach it, and covlab serve warns so. "
                    f"With {TOKEN_VARIABLE} set in its environment, every request but GET /healthz must carry "
                    "`Authorization: Bearer <that token>` (401 otherwise). A POST's body must be JSON "
                    "(Content-Type: application/json; 415 otherwise). Each limit below is answered with a 4xx naming "
                    "its flag.")
    serve.add_argument("--method", action="append", metavar="M",
                       help="a method to serve (repeatable; default: every servable method that needs no trained "
                            "model, and with --dataset those that do, as far as their models are registered)")
    serve.add_argument("--dataset", help="the dataset whose trained models (covlab.<dataset>.<selector>) to load, and "
                                         "whose corpus POST /v1/retrieve ranks (its mcompass_student's)")
    serve.add_argument("--alias", default="champion", help="the alias the trained models are loaded by (default "
                                                           "champion)")
    serve.add_argument("--tracking-uri", help="MLflow tracking and registry URI (default: COVLAB_MLFLOW_TRACKING_URI, "
                                              "else the store of COVLAB_HOME)")
    serve.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST}; another "
                                                            f"than loopback: set {TOKEN_VARIABLE})")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    serve.add_argument("--poll-seconds", type=float, default=DEFAULT_POLL_SECONDS,
                       help=f"how often to check the aliases (default {DEFAULT_POLL_SECONDS:g}; 0: never)")
    serve.add_argument("--device", default="cpu", help="torch device of the encoders (default cpu)")
    serve.add_argument("--runtime", choices=RUNTIMES, default=DEFAULT_RUNTIME,
                       help=f"what encodes the texts a request sends without embeddings, on the CPU "
                            f"(models/runtime.py: onnx and onnx-int8 run an export of the encoder kept beside its "
                            f"weights; default {DEFAULT_RUNTIME})")
    serve.add_argument("--shutdown-seconds", type=float, default=DEFAULT_SHUTDOWN_SECONDS,
                       help=f"on SIGTERM or Ctrl-C, how long the requests in flight may take to finish before they "
                            f"are cancelled and the process exits (default {DEFAULT_SHUTDOWN_SECONDS:g})")
    for setting in fields(Limits):  # one flag per limit, as Limits declares it
        shown = f"{setting.default:g}" if setting.type is float else setting.default
        serve.add_argument(f"--{setting.name.replace('_', '-')}", type=setting.type, default=setting.default,
                           help=f"{setting.metadata['help']} (default {shown})")


def main(argv: list[str] | None = None) -> int:
    from covlab.resources.datasets import FORMATS

    parser = argparse.ArgumentParser(prog="covlab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="materialize every asset on the embedded demo dataset")
    data = commands.add_parser("dataset", help="register or list datasets").add_subparsers(dest="action",
                                                                                           required=True)
    add = data.add_parser("add", help="register a dataset as a new partition")
    add.add_argument("name")
    add.add_argument("--format", choices=FORMATS, help="the dataset's format (or --like)")
    add.add_argument("--path", help="file or folder of the dataset (not needed for demo)")
    add.add_argument("--replace", action="store_true",
                     help="re-point an already registered name at another format, path or options")
    add.add_argument("--columns", metavar="FIELD=COLUMN,...",
                     help="--format table: the file's column of each covlab field, e.g. query_id=qid,text=question,"
                          "doc_id=pid,passage=body[,nugget=facet,split=fold,...] (docs/datasets.md)")
    add.add_argument("--rating-threshold", type=int, metavar="R",
                     help="--format crux: the lowest judge rating (1-5) that links a passage to a subquestion "
                          "(default 4)")
    add.add_argument("--like", metavar="OTHER", help="the format, path and options of registered dataset OTHER: the "
                                                     "same data under this name (e.g. with --models-from)")
    add.add_argument("--models-from", metavar="SOURCE[@ALIAS|@vN]",
                     help="adopt SOURCE's registered models (its champion, or the version ALIAS or N names) instead "
                          "of training: the coverage estimator, bi-encoder, LMVU ranker and MCompass student "
                          "(docs/datasets.md, \"Models from another dataset\")")
    data.add_parser("list", help="registered datasets: name, format, path and, where a dataset has some, its "
                                 "options as the dataset add flags that give them")
    generate = data.add_parser("generate", help="write a generated dataset in the covlab layout")
    generate.add_argument("generator", choices=["longdoc"],
                          help="longdoc: long-document QA over 150-300-token chunks (resources/longdoc_dataset.py)")
    generate.add_argument("--out", required=True, help="new or empty folder to write the dataset into")
    generate.add_argument("--profile", choices=["small", "full"], default="small",
                          help="small: 70 chunks, 40 questions (CI); full: 356 chunks, 312 questions")
    generate.add_argument("--seed", type=int, default=7, help="generator seed (default 7)")
    run = commands.add_parser("materialize", help="materialize assets of one dataset partition")
    run.add_argument("--dataset", required=True)
    run.add_argument("--select", nargs="*", metavar="SELECTION",
                     help="what to build (default: every asset), in Dagster's asset selection syntax, several "
                          "values together: an asset key; +KEY: the key and all its upstreams; KEY+: the key and all "
                          "its downstreams (2+KEY, KEY+1: that many layers); key:PATTERN (key:budgeted_*); group:NAME; "
                          "kind:NAME; tag:KEY=VALUE; owner:NAME; combined with and, or, not, parentheses (quote "
                          "them for the shell: '+bm25_pools and not group:ingest'). Every selected asset is "
                          "rebuilt, an upstream already materialized for the dataset too: KEY alone reads its "
                          "upstreams as stored, +KEY rebuilds them. A multi-asset that builds its outputs in one "
                          "step (dataset_tables, chunks) is widened to all of them")
    run.add_argument("--config", help="YAML run config (ops: <asset>: config: ...)")
    audit = commands.add_parser(
        "audit", help="the exact lineage of a reported number, and what it cost", add_help=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Find stored report figures and print, for each report materialization behind them, the branch "
                    "of its lineage\nthat produced the figures' methods (one line per materialization, each once) "
                    "and what that branch cost:\nwall seconds per step, seconds on the gpu pool, LLM calls and "
                    "tokens, training epochs and pairs.")
    audit.add_argument("-h", "--help", action=_AuditHelp,
                       help="show this help and the datasets, methods, metrics and splits in the results store")
    _figure_options(audit, "audit")
    audit.add_argument("--all", action="store_true",
                       help="with --value: also the figures of earlier materializations of the same report")
    audit.add_argument("--full", action="store_true",
                       help="the whole lineage of the report (every input) with the config, settings, model and "
                            "data detail of each node, and its cost")
    audit.add_argument("--json", action="store_true",
                       help="machine-readable: the figures, the whole lineage tree in full detail and the cost "
                            "(of the branch; with --full of the whole lineage); numbers as numbers, missing as null")
    again = commands.add_parser(
        "reproduce", help="rebuild a reported figure from its lineage in a scratch instance and compare",
        description="Rebuild the report materialization behind a stored figure from what its lineage records (the "
                    "git commit, each asset's run config, the dataset files checked against their SHA-256) in a "
                    "scratch COVLAB_HOME, then compare each asset's content version with the recorded one in "
                    "dependency order, and the figure with the reported one. Prints REPRODUCED (exit 0), or the "
                    "first asset whose content differs and what differs (exit 1); exit 2 when the lineage cannot "
                    "be rebuilt (no recorded commit, uncommitted changes, changed dataset files).")
    _figure_options(again, "reproduce")
    again.add_argument("--allow-dirty", action="store_true",
                       help="rebuild with this checkout as it is when the lineage was built from uncommitted changes "
                            "(else refused: no commit holds that code)")
    again.add_argument("--keep", action="store_true", help="keep the scratch home even when the figure reproduced")
    again.add_argument("--scratch", help="folder to create the scratch home in (default: the system temp folder)")
    again.add_argument("--json", action="store_true", help="machine-readable: every asset's recorded and rebuilt "
                                                           "content version, the figures, the times")
    board = commands.add_parser(
        "leaderboard", help="which selector, at which budget: the methods of a dataset's newest reports ranked, "
                            "with paired CIs against relevance order")
    board.add_argument("--dataset", required=True)
    board.add_argument("--json", action="store_true", help="machine-readable: each report's rows as records")
    commands.add_parser("methods", help="every method of the registry: the reports it appears in, its label, "
                                        "whether it is trained, what it does")
    slots = commands.add_parser("slots", help="concurrency-pool slots (the gpu pool): who holds them, free "
                                              "those of dead runs").add_subparsers(dest="action", required=True)
    slots.add_parser("list", help="runs holding or waiting for pool slots, and whether they are alive")
    free = slots.add_parser("free", help="free the slots of runs that ended or whose process is gone")
    free.add_argument("--run", nargs="+", metavar="RUN_ID",
                      help="also free these runs (launched outside the CLI or on another host), marking them ended")
    _serve_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "serve":  # nothing of Dagster's is needed to serve
        from covlab.resources.tracking_server import TrackingUnavailable

        try:
            return serve_command(args)
        except (UsageError, TrackingUnavailable) as exc:  # the latter names the tracking URI redacted
            print(f"covlab: {exc}", file=sys.stderr)
            return 2

    from dagster import DagsterInvalidConfigError

    from covlab.models.schemas import DatasetError
    from covlab.orchestration.instance import InstanceBroken

    try:
        _check_args(args)
        if args.command == "dataset" and args.action == "add":
            dataset_add(args.name, args.format, args.path, args.replace, args.columns, args.rating_threshold,
                        args.models_from, args.like)
        elif args.command == "dataset" and args.action == "generate":
            dataset_generate(args.generator, args.out, args.profile, args.seed)
        elif args.command == "audit":
            return audit_command(args)
        elif args.command == "reproduce":
            return reproduce_command(args)
        elif args.command == "leaderboard":
            return leaderboard_command(args)
        elif args.command == "slots":
            return slots_command(args)
        elif args.command == "methods":
            print(methods_help())
        elif args.command == "dataset":
            for name, entry in _registry().entries().items():
                flags = option_flags({**entry.get("options", {}),
                                      **({"models_from": entry["models_from"]} if "models_from" in entry else {})})
                print(f"{name}\t{entry['format']}\t{entry['path'] or '(generated)'}" + (f"\t{flags}" if flags else ""))
        else:
            dataset = "demo" if args.command == "demo" else args.dataset
            select = getattr(args, "select", None)
            if select:  # resolved before the instance opens: a selection that names nothing refuses first
                keys, notes = select_assets(select)
                for note in notes:
                    print(f"covlab: {note}")
                select = sorted(keys, key=lambda key: key.to_user_string())
            config = read_run_config(args.config) if getattr(args, "config", None) else None
            if args.command == "demo":
                from covlab.orchestration.definitions import DEMO_CONFIG

                config = DEMO_CONFIG
            instance = _instance()
            start, run_id = time.perf_counter(), str(uuid.uuid4())
            try:
                result = materialize(dataset, select, config, instance, run_id=run_id)
            except (DagsterInvalidConfigError, DatasetError, UsageError, SystemExit):
                raise
            except Exception as exc:
                if instance.get_run_by_id(run_id) is None:  # failed before the run began: not a run's failure
                    raise
                from covlab.orchestration.failures import invalid_config

                print(f"covlab: {run_failed(exc, instance, run_id)}", file=sys.stderr)
                return 2 if invalid_config(exc) is not None else 1
            print(summarize(result, time.perf_counter() - start))
    except (DatasetError, UsageError, InstanceBroken) as exc:
        print(f"covlab: {exc}", file=sys.stderr)
        return 2
    except FigureNotFound as exc:
        print(f"covlab {exc}", file=sys.stderr)
        return 1
    except DagsterInvalidConfigError as exc:  # checked by Dagster against the selected assets, before any runs
        problems = "; ".join(" ".join(e.message.split()).rstrip(".") for e in exc.errors)
        print(f"covlab: {getattr(args, 'config', None) or 'run config'}: {problems}; expected config for the "
              "selected assets only (`ops: <asset>: config: ...`)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
