"""How the trained coverage estimator scores pairs, one resource for every step that scores with it: the
estimated matrices over the BM25 pools, over their gold nuggets and over the MCompass pools, and the MCompass
teacher. So no matrix can be pruned, or batched, differently from another. What a pair reads of its document
(max_length, the window selection) is not set here: it is the estimator's own, saved with it at training
(models/coverage.py `load_estimator_scorer`), so that scoring reads pairs as training did. Which runtime runs
the cross-encoder and the first stage on the CPU is set here, once for all of them (models/runtime.py). torch is
imported lazily."""

from collections.abc import Callable

import numpy as np
from dagster import ConfigurableResource
from pydantic import Field, field_validator

from covlab.models.coverage import check_prune_top_m, load_estimator_scorer
from covlab.models.runtime import DEFAULT_RUNTIME, RUNTIMES, Runtime
from covlab.resources.device import DeviceResource


class EstimatorScoring(ConfigurableResource):
    """The estimator's inference batch and the bi-encoder first stage that prunes the estimated matrices."""

    batch_size: int = Field(64, ge=1, description="pairs per estimator batch (the first stage: texts per batch)")
    prune_top_m: int | None = Field(
        None, description="None: the estimator scores every (pool document, subquestion) pair of an estimated "
                          "matrix. m: a bi-encoder first stage keeps each subquestion's m pool documents most "
                          "similar to it and only those pairs are scored; the others get probability 0.0 (not "
                          "covered). Counted as pairs_scored / pairs_pruned in each matrix's metadata")
    first_stage: str = Field("", description="the first stage's bi-encoder: a saved model path (e.g. the "
                                             "coverage bi-encoder's) or HF name; empty: packaged MiniLM")
    first_stage_max_length: int = Field(256, ge=1, description="tokens per text for the first stage")
    runtime: Runtime = Field(DEFAULT_RUNTIME, description=f"what runs the estimator's cross-encoder, its window "
                                                          f"scorer and the first stage on the CPU, one of "
                                                          f"{', '.join(RUNTIMES)}: PyTorch, or ONNX Runtime on an "
                                                          "fp32 or int8 export saved beside the weights "
                                                          "(models/runtime.py). A GPU always runs torch")

    @field_validator("prune_top_m")
    @classmethod
    def _prune_top_m(cls, value: int | None) -> int | None:
        """Checked where the resource is built from config, by the rule the first stage applies."""
        return value if value is None else check_prune_top_m(value)

    def estimator(self, directory: str, device: DeviceResource,
                  progress: Callable[[object], None] | None = None) -> Callable[[list[tuple[str, str]]], np.ndarray]:
        """The saved estimator at `directory` as a function from (subquestion, document) pairs to coverage
        probabilities, at this batch size on the device resource's device."""
        return load_estimator_scorer(directory, batch_size=self.batch_size, device=device.torch_device(),
                                     autocast_dtype=device.autocast_dtype(), progress=progress, runtime=self.runtime)

    def first_stage_encoder(self, device: DeviceResource,
                            progress: Callable[[object], None] | None = None) -> Callable[[list[str]], np.ndarray]:
        """The first stage's bi-encoder as a function from texts to unit vectors."""
        from covlab.models.biencoder import load_first_stage
        from covlab.models.encoders import default_base_model

        return load_first_stage(self.first_stage or default_base_model(), batch_size=self.batch_size,
                                max_length=self.first_stage_max_length, device=device.torch_device(),
                                autocast_dtype=device.autocast_dtype(), progress=progress, runtime=self.runtime)
