"""Which runtime runs a saved encoder's inference: PyTorch, or ONNX Runtime on an export of the same model.

An export is the model's inference function as one ONNX graph: for a bi-encoder the unit-length mean-pooled
embedding (biencoder.py), for the coverage estimator the cross-encoder's logit (cross_encoder.py); each caller
passes the torch function it exports, so the graph computes exactly what the torch path computes. `onnx` runs the
fp32 export (torch.onnx's dynamo exporter, one self-contained file); `onnx-int8` runs that export with its MatMul
weights quantized to int8 per output channel (onnxruntime.quantization.quantize_dynamic: activations are
quantized per batch at run time). bench/inference_runtime.py measures both against torch, speed and scores.

Exports live beside the weights, in the model directory's EXPORTS_FOLDER, with a manifest (EXPORT_MANIFEST) that
records each file's SHA-256, the content hash of the weights it was exported from (versions.directory_hash,
which leaves that folder out, so a registered model keeps its hash) and the versions that produced it. Loading
verifies both: a missing export is exported again (it is derived from the weights, nothing is lost); an export
whose bytes differ from its record, or that was recorded for other weights, is refused (ExportRefused, naming the
file): nothing rewrites it silently, and deleting it exports it again. The manifest is not part of the weights'
registered hash, so it binds an export to the weights; it does not prove who wrote it.

The runtime is a setting with one default, DEFAULT_RUNTIME. On a GPU the torch path runs whatever it says
(`runtime_on`): the exports are a CPU path.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from covlab.models.versions import EXPORTS_FOLDER, directory_hash, file_hash

Runtime = Literal["torch", "onnx", "onnx-int8"]
RUNTIMES: tuple[Runtime, ...] = ("torch", "onnx", "onnx-int8")
DEFAULT_RUNTIME: Runtime = "torch"
EXPORT_MANIFEST = "exports.json"
PRECISIONS = {"onnx": "fp32", "onnx-int8": "int8"}
OPSET = 18


class ExportRefused(RuntimeError):
    """An ONNX export that is not the one recorded for these weights: its bytes changed, or it was recorded for
    other weights."""


def check_runtime(runtime: str) -> Runtime:
    """`runtime` when it is one of RUNTIMES, else a ValueError naming them."""
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime {runtime!r}: expected one of {list(RUNTIMES)}")
    return runtime


def runtime_on(runtime: str, device) -> Runtime:
    """The runtime that runs on `device` (a torch.device or its name): `runtime` on the CPU, torch elsewhere."""
    check_runtime(runtime)
    kind = device if isinstance(device, str) else device.type
    return runtime if kind.split(":")[0] == "cpu" else "torch"


@dataclass(frozen=True)
class ExportRecord:
    """What the manifest records of one export: its file in EXPORTS_FOLDER, the file's SHA-256, what it computes
    (`task`) at which precision, the directory_hash of the weights it came from, its input names in order, and
    the torch and onnxruntime versions that wrote it."""
    file: str
    sha256: str
    task: str
    precision: str
    weights_hash: str
    inputs: tuple[str, ...]
    produced_by: str

    def to_dict(self) -> dict:
        return {**asdict(self), "inputs": list(self.inputs)}

    @classmethod
    def from_dict(cls, record: dict) -> ExportRecord:
        return cls(**{**record, "inputs": tuple(record["inputs"])})


def export_file(task: str, precision: str) -> str:
    return f"{task}.{precision}.onnx"


def export_records(directory: str | os.PathLike) -> dict[str, ExportRecord]:
    """The manifest of a model directory's exports, by file name ({} when it has none)."""
    manifest = Path(directory, EXPORTS_FOLDER, EXPORT_MANIFEST)
    if not manifest.is_file():
        return {}
    return {name: ExportRecord.from_dict(record) for name, record in json.loads(manifest.read_text()).items()}


class OnnxModel:
    """An export in an ONNX Runtime session: called with a batch of model inputs (encoders.collate's tensors), it
    returns the exported function's output as float32. The session runs one intra-op thread: as for torch on
    the CPU, parallelism comes from encoders.run_batches' streams, each scoring whole batches. `config` is the
    model's Hugging Face config (the bi-encoder reads its hidden size)."""

    def __init__(self, path: Path, record: ExportRecord, config):
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        self.path, self.record, self.config = path, record, config
        self.session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def __call__(self, batch: dict) -> np.ndarray:
        feed = {name: batch[name].cpu().numpy() for name in self.record.inputs}
        return np.asarray(self.session.run(None, feed)[0], dtype=np.float32)


def onnx_model(directory: str | os.PathLike, runtime: Runtime, *, task: str, input_names: Sequence[str],
               load_torch: Callable[[], object], forward: Callable[[object, dict], object]) -> OnnxModel:
    """The verified export of the model at `directory` that computes `forward(model, inputs)` (`task` names it),
    at `runtime`'s precision, in an ONNX Runtime session; exported first when the directory has none
    (`load_torch()` then gives the torch model). `input_names` are the tokenizer's model inputs; the export reads
    input_ids, attention_mask and, where the tokenizer gives them, token_type_ids. ExportRefused for an export that
    is not the one recorded for these weights (module docstring)."""
    from filelock import FileLock
    from transformers import AutoConfig

    if runtime not in PRECISIONS:
        raise ValueError(f"runtime {runtime!r} has no export; expected one of {list(PRECISIONS)}")
    folder = Path(directory)
    if not folder.is_dir():
        raise ValueError(f"runtime {runtime!r} runs an export saved beside the weights; {str(directory)!r} is not a "
                         "local model directory")
    inputs = tuple(name for name in input_names if name in ("input_ids", "attention_mask", "token_type_ids"))
    if "input_ids" not in inputs or "attention_mask" not in inputs:
        raise ValueError(f"model inputs {list(input_names)}: an export needs input_ids and attention_mask")
    exports = folder / EXPORTS_FOLDER
    try:
        exports.mkdir(exist_ok=True)
    except OSError as error:
        raise OSError(f"runtime {runtime!r}: cannot write the exports beside the weights at {exports} ({error}); "
                      "load it once with this runtime where the model directory is writable") from error
    with FileLock(exports / ".lock"):
        weights = directory_hash(folder)
        fp32 = _verified_or_exported(exports, export_file(task, "fp32"), weights,
                                     lambda target: _export(load_torch(), forward, inputs, target),
                                     task=task, precision="fp32", inputs=inputs)
        record = fp32 if PRECISIONS[runtime] == "fp32" else _verified_or_exported(
            exports, export_file(task, "int8"), weights, lambda target: _quantize(exports / fp32.file, target),
            task=task, precision="int8", inputs=inputs)
    return OnnxModel(exports / record.file, record, AutoConfig.from_pretrained(str(folder)))


def _verified_or_exported(exports: Path, name: str, weights: str, write: Callable[[Path], None], *, task: str,
                          precision: str, inputs: tuple[str, ...]) -> ExportRecord:
    """The record of export `name` after checking the file against it, or of a fresh export (written by
    `write`, recorded in the manifest) when the file or its record is missing."""
    path, record = exports / name, export_records(exports.parent).get(name)
    if record is not None and path.is_file():
        if record.weights_hash != weights:
            raise ExportRefused(f"{path}: exported from weights with content hash {record.weights_hash}, but "
                                f"{exports.parent} holds weights {weights}; delete {path} to export it again")
        found = file_hash(path)
        if found != record.sha256:
            raise ExportRefused(f"{path}: SHA-256 {found}, not the {record.sha256} recorded at export in "
                                f"{exports / EXPORT_MANIFEST}; the file was changed after export, so it is not "
                                f"loaded; delete it to export it again")
        return record
    with tempfile.TemporaryDirectory(dir=exports, prefix=".export-") as work:
        built = Path(work) / name
        write(built)
        os.replace(built, path)
    record = ExportRecord(name, file_hash(path), task, precision, weights, inputs, _producer())
    _write_manifest(exports, {**export_records(exports.parent), name: record})
    return record


def _write_manifest(exports: Path, records: dict[str, ExportRecord]) -> None:
    staging = exports / f".{EXPORT_MANIFEST}.tmp"
    staging.write_text(json.dumps({name: r.to_dict() for name, r in sorted(records.items())}, indent=2,
                                  sort_keys=True))
    os.replace(staging, exports / EXPORT_MANIFEST)


def _producer() -> str:
    import onnxruntime
    import torch

    return f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, opset {OPSET}"


def _export(model, forward: Callable[[object, dict], object], names: tuple[str, ...], target: Path) -> None:
    """`forward(model, inputs)` as one ONNX file (weights inside it), batch and sequence length dynamic. The
    example batch has a padded row, so that the traced graph keeps the attention mask's role. The exporter's
    warnings (deprecations inside torch, axis renames) are not shown; what the file computes is compared with torch by
    tests/test_inference_runtime.py and bench/inference_runtime.py."""
    import warnings

    import torch

    class Exported(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *tensors):
            return forward(self.model, dict(zip(names, tensors)))

    example = {"input_ids": torch.randint(1000, 2000, (2, 16)),
               "attention_mask": torch.tensor([[1] * 16, [1] * 9 + [0] * 7]),
               "token_type_ids": torch.zeros(2, 16, dtype=torch.long)}
    batch, tokens = torch.export.Dim("batch"), torch.export.Dim("tokens")
    with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", (UserWarning, FutureWarning, DeprecationWarning))
        program = torch.onnx.export(Exported().eval(), tuple(example[n] for n in names), input_names=list(names),
                                    output_names=["output"], opset_version=OPSET, dynamo=True, verbose=False,
                                    dynamic_shapes=(tuple({0: batch, 1: tokens} for _ in names),))
    program.save(str(target), external_data=False)


def _quantize(fp32: Path, target: Path) -> None:
    """The fp32 export with its MatMul weights in int8, one scale per output channel: a scale per whole matrix
    moves MiniLM's embeddings several times further from fp32's."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(fp32), str(target), weight_type=QuantType.QInt8, per_channel=True)
