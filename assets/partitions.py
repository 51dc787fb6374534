"""Datasets are dynamic partitions: `covlab dataset add` adds one, `demo` is always registered."""

from dagster import DynamicPartitionsDefinition

DATASETS = DynamicPartitionsDefinition(name="datasets")
