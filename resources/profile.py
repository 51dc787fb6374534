"""What a run covers: every method (the default), or a first verdict without training. Under the untrained
profile the reports cover the methods that need no trained model, with the exact oracles as bounds, and name the
methods they leave out and why (models/registry.py untrained_left_out); `covlab materialize` leaves out the assets
that train and what reads them (orchestration/cli.py untrained_assets). configs/untrained.yaml sets it."""

from collections.abc import Mapping

from dagster import ConfigurableResource
from pydantic import Field

from covlab.models.registry import Report, untrained_left_out

# The resource key of the profile in the code location's resources (run config `resources: profile: ...`).
PROFILE_RESOURCE = "profile"


class RunProfile(ConfigurableResource):
    """Whether this run trains: untrained, the reports leave out the methods whose selections read a trained
    model (the coverage estimator, the coverage bi-encoder, the LMVU ranker) and say so; else every method of a
    report is required, and a selection that was never materialized fails the report."""

    untrained: bool = Field(False, description="a first verdict without training: the reports cover the methods "
                                               "that need no trained model (and the exact oracles as bounds) and "
                                               "name those they leave out; covlab materialize leaves out the "
                                               "assets that train and what reads them")

    def left_out(self, report: Report) -> dict[str, str]:
        """Method -> why this run leaves it out of `report`; empty when the run covers every method."""
        return untrained_left_out(report) if self.untrained else {}


def untrained_in(run_config: Mapping) -> bool:
    """Whether `run_config` sets the profile resource's `untrained` (Dagster checks its type before the run)."""
    entry = (run_config.get("resources") or {}).get(PROFILE_RESOURCE)
    settings = entry.get("config") if isinstance(entry, Mapping) else None
    return isinstance(settings, Mapping) and settings.get("untrained") is True
