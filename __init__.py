"""covlab: coverage-aware context selection for retrieval-augmented generation, as Dagster assets."""

__version__ = "0.1.0"
