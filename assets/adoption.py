"""`adopted_models`: the registered versions a dataset adopts from another (models/adoption.py), as an observable
source asset that every adoptable trained asset reads. Its observations (orchestration/automation.py
`adopted_model_sensor` records one per dataset when what it adopts changes; Observe in the UI runs the function
below) carry as data version the versions and content hashes that the source's alias or version resolves to now:
when the source's champion moves, the adopting dataset's trained assets have a changed input, and the nightly
re-evaluates them and what reads them."""

import warnings

from dagster import AssetSpec, BetaWarning, DataVersion, MetadataValue, ObserveResult, multi_observable_source_asset

from covlab.assets.model_registry import source_version
from covlab.assets.partitions import DATASETS
from covlab.assets.presentation import OWNERS
from covlab.models.adoption import ModelSource
from covlab.models.registry import ADOPTED
from covlab.models.versions import record_version
from covlab.resources.datasets import DatasetRegistry
from covlab.resources.model_store import CONTENT_HASH_TAG
from covlab.resources.tracking import TrackingResource

# The data version of a dataset that adopts nothing: it trains its own models, and that never changes here.
TRAINS_ITS_OWN = "trains its own models"


# Observable source assets are beta in Dagster 1.13: the decorator warns, and so does Dagster each time it
# re-creates adopted_models while resolving the code location (its execution type). Those two warnings, nothing else.
warnings.filterwarnings("ignore", message=r"Function `multi_observable_source_asset` is currently in beta",
                        category=BetaWarning)
warnings.filterwarnings("ignore", message=r"Parameter `execution_type` of function `AssetsDefinition.__init__`",
                        category=BetaWarning)


@multi_observable_source_asset(
    specs=[AssetSpec("adopted_models", partitions_def=DATASETS, group_name="coverage", owners=OWNERS,
                     kinds={"mlflow"},
                     description="The registered versions a dataset adopts from another instead of training "
                                 "(`covlab dataset add ... --models-from SOURCE`), as its data version; observed "
                                 "by adopted_model_sensor (or Observe in the UI). A dataset that trains its own "
                                 "never changes.")],
    partitions_def=DATASETS)
def adopted_models(context, datasets: DatasetRegistry, tracking: TrackingResource):
    source = datasets.models_source(context.partition_key)
    if source is None:
        yield ObserveResult(asset_key="adopted_models", data_version=DataVersion(TRAINS_ITS_OWN))
        return
    version, metadata = observed_adoption(source, tracking)
    yield ObserveResult(asset_key="adopted_models", data_version=DataVersion(version), metadata=metadata)


def observed_adoption(source: ModelSource, tracking: TrackingResource) -> tuple[str, dict]:
    """What `source` names now, as an observation of `adopted_models` records it: the data version (a hash of the
    source and, for each adoptable trained selector, the version it resolves to as `<uri>#<content hash>`, None
    where the source has no such version yet) and the metadata that shows them."""
    versions = {}
    for trained in ADOPTED:
        ref = source_version(tracking, source, trained.asset)
        versions[trained.asset] = None if ref is None else f"{ref.uri}#{ref.tags.get(CONTENT_HASH_TAG, '')}"
    return (record_version({"source": source.spec(), "versions": versions}),
            {"models_from": source.spec(), "versions": MetadataValue.json(versions)})
