"""Models adopted from another dataset instead of trained on this one.

A dataset's registry entry may name `models_from`: the dataset whose registered versions its trained assets take
(by alias, `champion` unless another is named, or by version) instead of training their own. That is how a
selector trained on a large labelled set is evaluated on a small judged one, and how a dataset with a test split
only gets every report. The adopting asset registers the version it took as a version of its own dataset's model
(the same files, tagged with where they were trained), so serving and promotion read it as any other.

    ModelSource.parse("argkp")             # argkp's champion
    ModelSource.parse("argkp@candidate")   # the version argkp's candidate alias points at
    ModelSource.parse("argkp@v3")          # version 3
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from covlab.models.dataset import check_dataset_name
from covlab.models.schemas import DatasetError

DEFAULT_ALIAS = "champion"
_SPEC = re.compile(r"(?P<dataset>[^@]+)(@(?:v(?P<version>[0-9]+)|(?P<alias>[a-z][a-z0-9_-]*)))?")
# Where the figures an adopted model's gate reads come from (ModelAdoption.figures_from).
TARGET_TUNE = "measured on this dataset's {split} split"
REPLAYED = "replayed from {dataset}'s record"


@dataclass(frozen=True)
class ModelSource:
    """The registered versions a dataset adopts: those of `dataset` that `alias` points at, or `version`."""
    dataset: str
    alias: str | None = DEFAULT_ALIAS
    version: int | None = None

    @classmethod
    def parse(cls, spec: str, adopting: str | None = None) -> ModelSource:
        """`<dataset>[@<alias>|@v<N>]`; DatasetError saying what was expected, or that `adopting` names itself."""
        found = _SPEC.fullmatch(spec.strip()) if isinstance(spec, str) else None
        if found is None:
            raise DatasetError(f"models from {spec!r}: expected <dataset>, <dataset>@<alias> or <dataset>@v<N> "
                               "(e.g. argkp, argkp@candidate, argkp@v3)")
        dataset = check_dataset_name(found["dataset"])
        if dataset == adopting:
            raise DatasetError(f"dataset {adopting!r} cannot adopt its own models; it trains them")
        if found["version"]:
            return cls(dataset, None, int(found["version"]))
        return cls(dataset, found["alias"] or DEFAULT_ALIAS)

    def spec(self) -> str:
        """The text `parse` reads back."""
        return f"{self.dataset}@v{self.version}" if self.version is not None else f"{self.dataset}@{self.alias}"


@dataclass(frozen=True)
class ModelAdoption:
    """What an adopting asset took: the source version (`source_uri`, e.g. models:/covlab.argkp.lmvu_ranker/3), the
    dataset it was trained on and the data versions of what its training read (the source materialization's
    inputs), the Dagster run that trained it, and where the figures its gate reads came from (`figures_from`).
    What named the version (an alias or a number) is not part of it: the same version adopted either way is the
    same value."""
    trained_on: str
    source_uri: str
    source_version: int
    training_data_versions: Mapping[str, str] = field(default_factory=dict)
    training_run_id: str = ""
    figures_from: str = ""

    @property
    def source_model(self) -> str:
        """The registered model the source version belongs to (`source_uri` is models:/<name>/<version>)."""
        return self.source_uri.removeprefix("models:/").rpartition("/")[0]

    def to_record(self) -> dict:
        return {"trained_on": self.trained_on, "source_uri": self.source_uri, "source_version": self.source_version,
                "training_data_versions": dict(sorted(self.training_data_versions.items())),
                "training_run_id": self.training_run_id, "figures_from": self.figures_from}

    @classmethod
    def from_record(cls, record: Mapping) -> ModelAdoption:
        return cls(str(record["trained_on"]), str(record["source_uri"]), int(record["source_version"]),
                   dict(record.get("training_data_versions") or {}), str(record.get("training_run_id") or ""),
                   str(record.get("figures_from") or ""))


def trained_label(label: str, trained_on: str | None) -> str:
    """A method's label as reports show it: `label (trained on argkp)` for a method whose models were trained on
    another dataset (`trained_on`), else `label`."""
    return f"{label} (trained on {trained_on})" if trained_on else label
