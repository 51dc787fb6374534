"""Inference on ONNX Runtime (models/runtime.py): the fp32 export of a bi-encoder's embedding and of a
cross-encoder's logit computes what torch computes, the int8 export keeps the order of what it scores, an export's
SHA-256 is recorded beside it and checked at every load (a changed export, or one recorded for other weights, is
refused by name; a missing one is exported again), the weights' content hash does not see the exports, and the
runtime is one setting with one default, torch on a GPU."""

import shutil

import numpy as np
import pytest
from scipy.stats import spearmanr

from covlab.models.biencoder import encode, load_biencoder
from covlab.models.cross_encoder import load_cross_encoder, save_cross_encoder, score_pairs
from covlab.models.runtime import (DEFAULT_RUNTIME, EXPORT_MANIFEST, ExportRefused, OnnxModel, check_runtime,
                                   export_records, runtime_on)
from covlab.models.versions import EXPORTS_FOLDER, directory_hash, file_hash
from tiny_bert import one_thread, save_tiny_bert

# Sentences of 2 to ~60 tokens, so that batches of 4 pad differently from one another.
TEXTS = [" ".join(f"word{(i * 7 + j) % 23} about topic {i % 5}" for j in range(1 + (i * 5) % 15)) for i in range(24)]
PAIRS = [(f"what about topic {i % 5}?", text) for i, text in enumerate(TEXTS)]


@pytest.fixture(autouse=True)
def single_threaded():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def biencoder_dir(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("biencoder") / "model", seed=1)


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory):
    """A tiny BERT with a one-logit head, saved as a trained estimator is (covlab.json kind cross_encoder)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from covlab.models.encoders import default_base_model
    from tiny_bert import TINY_BERT

    tokenizer = AutoTokenizer.from_pretrained(default_base_model())
    torch.manual_seed(2)
    model = BertForSequenceClassification(BertConfig(vocab_size=tokenizer.vocab_size, num_labels=1, **TINY_BERT))
    return str(save_cross_encoder(model, tokenizer, tmp_path_factory.mktemp("estimator") / "model", max_length=64))


def embeddings(directory: str, runtime: str) -> np.ndarray:
    model, tokenizer, _ = load_biencoder(directory, runtime=runtime)
    return encode(model, tokenizer, TEXTS, batch_size=4, max_length=64)


def probabilities(directory: str, runtime: str) -> np.ndarray:
    model, tokenizer, _ = load_cross_encoder(directory, runtime=runtime)
    return score_pairs(model, tokenizer, PAIRS, batch_size=4, max_length=64)


def test_onnx_embeddings_equal_torch_and_int8_keeps_their_order(biencoder_dir):
    reference = embeddings(biencoder_dir, "torch")
    exported = embeddings(biencoder_dir, "onnx")
    assert np.abs(exported - reference).max() < 1e-4
    np.testing.assert_allclose(np.linalg.norm(exported, axis=1), 1.0, atol=1e-5)
    quantized = embeddings(biencoder_dir, "onnx-int8")
    assert not np.array_equal(quantized, exported)  # the int8 file is what ran
    similarities = (reference @ reference.T)[np.triu_indices(len(TEXTS), 1)]
    assert spearmanr(similarities, (quantized @ quantized.T)[np.triu_indices(len(TEXTS), 1)]).statistic > 0.9


def test_onnx_coverage_probabilities_equal_torch_and_int8_keeps_their_order(cross_encoder_dir):
    reference = probabilities(cross_encoder_dir, "torch")
    assert np.abs(probabilities(cross_encoder_dir, "onnx") - reference).max() < 1e-4
    assert spearmanr(reference, probabilities(cross_encoder_dir, "onnx-int8")).statistic > 0.9


def test_export_hashes_are_recorded_and_the_weights_hash_does_not_see_them(tmp_path, biencoder_dir):
    folder = shutil.copytree(biencoder_dir, tmp_path / "model", ignore=shutil.ignore_patterns(EXPORTS_FOLDER))
    before = directory_hash(folder)
    model, _, _ = load_biencoder(folder, runtime="onnx-int8")
    assert isinstance(model, OnnxModel) and model.path.name == "embedding.int8.onnx"
    records = export_records(folder)
    assert sorted(records) == ["embedding.fp32.onnx", "embedding.int8.onnx"]
    for name, record in records.items():
        assert record.sha256 == file_hash(folder / EXPORTS_FOLDER / name)
        assert record.weights_hash == before
        assert record.inputs == ("input_ids", "token_type_ids", "attention_mask")
    assert directory_hash(folder) == before  # a registered model keeps its content hash


@pytest.mark.parametrize("name, runtime", [("embedding.fp32.onnx", "onnx"), ("embedding.int8.onnx", "onnx-int8")])
def test_a_changed_export_is_refused_by_name_and_a_deleted_one_exported_again(tmp_path, biencoder_dir, name,
                                                                                runtime):
    folder = shutil.copytree(biencoder_dir, tmp_path / "model", ignore=shutil.ignore_patterns(EXPORTS_FOLDER))
    load_biencoder(folder, runtime="onnx-int8")
    export = folder / EXPORTS_FOLDER / name
    recorded = export_records(folder)[name].sha256
    export.write_bytes(export.read_bytes() + b"\0")
    with pytest.raises(ExportRefused, match=f"{name}: SHA-256 .* not the {recorded} recorded"):
        load_biencoder(folder, runtime=runtime)
    export.unlink()
    model, _, _ = load_biencoder(folder, runtime=runtime)
    assert file_hash(model.path) == export_records(folder)[name].sha256


def test_an_export_of_other_weights_is_refused(tmp_path, biencoder_dir):
    folder = shutil.copytree(biencoder_dir, tmp_path / "model", ignore=shutil.ignore_patterns(EXPORTS_FOLDER))
    load_biencoder(folder, runtime="onnx")
    exported_from = export_records(folder)["embedding.fp32.onnx"].weights_hash
    shutil.copy(save_tiny_bert(tmp_path / "other", seed=5) + "/model.safetensors", folder / "model.safetensors")
    with pytest.raises(ExportRefused, match=f"embedding.fp32.onnx: exported from weights with content hash "
                                            f"{exported_from}, but .* holds weights {directory_hash(folder)}"):
        load_biencoder(folder, runtime="onnx")
    assert (folder / EXPORTS_FOLDER / EXPORT_MANIFEST).is_file()


def test_only_a_saved_estimator_is_exported(tiny_model):
    with pytest.raises(ValueError, match="not a saved cross-encoder"):
        load_cross_encoder(tiny_model, runtime="onnx")  # a plain encoder's head is drawn afresh at each load


def test_the_runtime_is_one_setting_with_one_default_and_a_gpu_runs_torch():
    from covlab.resources.scoring import EstimatorScoring
    from covlab.serving.shared import Encoder

    assert DEFAULT_RUNTIME == "torch"
    assert EstimatorScoring().runtime == DEFAULT_RUNTIME == Encoder("model").runtime
    assert EstimatorScoring(runtime="onnx-int8").runtime == "onnx-int8"
    with pytest.raises(ValueError):
        EstimatorScoring(runtime="tensorrt")
    with pytest.raises(ValueError, match="runtime 'tensorrt': expected one of"):
        check_runtime("tensorrt")
    assert runtime_on("onnx", "cpu") == "onnx"
    assert runtime_on("onnx-int8", "cuda:0") == runtime_on("onnx", "cuda") == "torch"


def test_the_served_encoder_runs_the_export(biencoder_dir):
    from covlab.serving.shared import shared_encoder

    torch_encoder, onnx_encoder = (shared_encoder(biencoder_dir, runtime=runtime) for runtime in ("torch", "onnx"))
    assert onnx_encoder is not torch_encoder and onnx_encoder is shared_encoder(biencoder_dir, runtime="onnx")
    assert np.abs(onnx_encoder(TEXTS) - torch_encoder(TEXTS)).max() < 1e-4
