"""The model-loading entry point: a path (GGUF file, HF directory, `dummy:<shape or config.json>`) becomes
a `LoadedModel` (config, model on its device, tokenizer, weights identity).

Invariants: weights stream into the model one tensor at a time (never a second full copy), and a
tensor-parallel rank keeps only its share of each (shared/model/parallel.py); every
failure to read a checkpoint surfaces as one `ModelLoadError` line naming the path and the problem;
the tokenizer is loaded (and timed) apart from the weights, and `load_tokenizer` alone never reads them.
FP8 (shared/model/fp8.py) is refused on a device without it before any weight is read; a model quantized
at load has its own weights identity (the checkpoint's, hashed with the method), an FP8 checkpoint the
checkpoint's. The log says how much device memory the weights take (a GGUF's quantized tensors are
dequantized to the model dtype, so it is the unquantized model's size).
"""

from __future__ import annotations

import json
import logging
import os
import struct
import sys
import time
from dataclasses import dataclass

import torch
from pdserve.shared.model import fp8
from pdserve.shared.model.dummy_weights import dummy_weights_identity, fill_dummy_weights
from pdserve.shared.model.gguf_loader import WeightThunks, read_gguf
from pdserve.shared.model.hf_loader import read_hf_config, read_hf_dir
from pdserve.shared.model.model import LlamaModel
from pdserve.shared.model.model_config import NAMED_SHAPES, ModelConfig
from pdserve.shared.model.parallel import Collectives, RowSlice, SingleRank, TPPlan, plan
from pdserve.shared.model.tokenizer import Tokenizer
from safetensors import SafetensorError
from tqdm import tqdm

DUMMY_PREFIX = "dummy:"
log = logging.getLogger(__name__)
_READ_ERRORS = (OSError, ValueError, KeyError, IndexError, RuntimeError, NotImplementedError, struct.error,
                SafetensorError)  # fmt: skip


class ModelLoadError(Exception):
    """A checkpoint or tokenizer could not be read; the message is one line naming the path."""


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer
    weights_identity: bytes
    source: str
    quantization: str | None = None
    """"fp8" for FP8 weights (an FP8 checkpoint, or quantized at load); None: the model dtype."""
    weights_load_s: float = 0.0  # wall seconds to read, dequantize and place the weights
    tokenizer_load_s: float = 0.0

    @property
    def description(self) -> str:
        """`<architecture> <checkpoint name>` (e.g. `qwen3_moe Qwen3-30B-A3B`): what `kvctl nodes` shows."""
        return f"{self.config.architecture} {os.path.basename(os.path.normpath(self.source))}"


class _LazyWeights:
    """A `WeightSource` over a reader's thunks (each reads one tensor, or a rank's part of it), with a
    progress bar on stderr."""

    def __init__(self, thunks: WeightThunks, bar: tqdm) -> None:
        self._thunks = thunks
        self._bar = bar

    def names(self) -> frozenset[str]:
        return frozenset(self._thunks)

    def read(self, name: str, part: RowSlice | None) -> torch.Tensor:
        tensor = self._thunks[name](part)
        self._bar.update(1)
        return tensor


def load_model(
    path: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    tokenizer_path: str | None = None,
    seed: int = 0,
    comm: Collectives | None = None,
    progress: bool = True,
    quantization: str | None = None,
) -> LoadedModel:
    """Load weights and tokenizer. `seed` only matters for dummy weights. With `comm` (a tensor-parallel
    group) the model holds rank `comm.rank`'s share; a split the model does not allow raises ModelLoadError
    naming its heads and the size. `progress`: a progress bar on stderr (a node's rank 0 draws the node's
    one bar). `quantization`: "fp8" quantizes the weights at load (an FP8 checkpoint is FP8 without it).
    Raises ModelLoadError."""
    start = time.perf_counter()
    comm = comm or SingleRank()
    try:
        stored = fp8.checkpoint_quantization(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load model from {path}: {_one_line(e)}") from e
    quant = stored or quantization
    if quant is not None:
        reason = fp8.unsupported_reason(device)
        if reason is not None:
            what = "an FP8 checkpoint" if stored else "--quantization fp8"
            raise ModelLoadError(f"cannot load model from {path} with {what}: {reason}")
    if path.startswith(DUMMY_PREFIX):
        config = _dummy_config(path)
        model = LlamaModel(config, device, dtype, _plan(path, config, comm), comm, quant)
        fill_dummy_weights(model, seed)
        identity = dummy_weights_identity(config, seed, device)
    else:
        config, model, identity = _load_checkpoint(path, device, dtype, comm, progress, quant)
    if quant is not None and stored is None:
        identity = fp8.quantized_identity(identity, quant)
    weights_s = time.perf_counter() - start
    n_bytes = sum(t.nbytes for t in model.parameters())
    how = quant or str(dtype).removeprefix("torch.")
    if path.endswith(".gguf"):
        how += ", every GGUF tensor dequantized"
    log.info("weights of %s: %.2f GiB on %s (%s)", path, n_bytes / 2**30, device, how)
    start = time.perf_counter()
    tokenizer = load_tokenizer(path, tokenizer_path)
    tokenizer_s = time.perf_counter() - start
    return LoadedModel(config, model, tokenizer, identity, path, quant, weights_s, tokenizer_s)


def load_config(path: str) -> ModelConfig:
    """The model's architecture alone (a GGUF or safetensors header, a config.json): no weights are read.
    Raises ModelLoadError."""
    if path.startswith(DUMMY_PREFIX):
        return _dummy_config(path)
    try:
        if path.endswith(".gguf"):
            _check_file(path)
            return read_gguf(path)[0]
        if os.path.isdir(path):
            return read_hf_config(path)
    except _READ_ERRORS as e:
        raise ModelLoadError(f"cannot load model from {path}: {_one_line(e)}") from e
    raise ModelLoadError(
        f"cannot load model from {path}: not a .gguf file, an HF directory, or "
        f"dummy:<shape>|<config.json> (named shapes: {sorted(NAMED_SHAPES)})"
    )


def load_tokenizer(path: str, tokenizer_path: str | None = None) -> Tokenizer:
    """The tokenizer of `tokenizer_path` if given, else of `path` (GGUF file, HF dir, or dummy spec:
    the config's directory tokenizer.json if present, else byte-level). Raises ModelLoadError."""
    source = tokenizer_path or path
    try:
        if source.startswith(DUMMY_PREFIX):
            spec = source[len(DUMMY_PREFIX) :]
            spec_dir = os.path.dirname(spec)
            if spec not in NAMED_SHAPES and os.path.exists(os.path.join(spec_dir, "tokenizer.json")):
                return Tokenizer.from_hf_dir(spec_dir)
            cfg = _dummy_config(source)
            return Tokenizer.byte_level(cfg.vocab_size, cfg.eos_token_ids, cfg.bos_token_id)
        if os.path.isdir(source):
            return Tokenizer.from_hf_dir(source)
        if os.path.basename(source) == "tokenizer.json":
            return Tokenizer.from_hf_dir(os.path.dirname(source) or ".")
        if source.endswith(".gguf"):
            _check_file(source)
            return Tokenizer.from_gguf(source)
    except _READ_ERRORS as e:
        raise ModelLoadError(f"cannot load tokenizer from {source}: {_one_line(e)}") from e
    raise ModelLoadError(
        f"cannot load tokenizer from {source}: not a .gguf file, an HF directory or dummy:<shape>"
    )


def _plan(path: str, config: ModelConfig, comm: Collectives) -> TPPlan:
    try:
        return plan(config, comm.rank, comm.size)
    except ValueError as e:
        raise ModelLoadError(f"cannot load model from {path}: {e}") from e


def _load_checkpoint(
    path: str, device: torch.device, dtype: torch.dtype, comm: Collectives, progress: bool, quant: str | None
) -> tuple[ModelConfig, LlamaModel, bytes]:
    try:
        if path.endswith(".gguf"):
            _check_file(path)
            config, thunks, identity = read_gguf(path)
        elif os.path.isdir(path):
            config, thunks, identity = read_hf_dir(path)
        else:
            raise ModelLoadError(
                f"cannot load model from {path}: not a .gguf file, an HF directory, or "
                f"dummy:<shape>|<config.json> (named shapes: {sorted(NAMED_SHAPES)})"
            )
        model = LlamaModel(config, device, dtype, _plan(path, config, comm), comm, quant)
        threads = torch.get_num_threads()
        # dequantizing and copying are small memory-bound ops: on a shared 2-core CI machine, 2 OpenMP
        # threads under contention made the load many times slower than 1 thread
        torch.set_num_threads(1)
        try:
            # a bar on rank 0's terminal only (disable=None: off when stderr is not a TTY, e.g. a node's log
            # file), where one log line says the same
            with tqdm(
                total=len(thunks), desc=f"loading {os.path.basename(path)}", unit="tensor", file=sys.stderr,
                disable=None if progress else True,
            ) as bar:  # fmt: skip
                start = time.perf_counter()
                model.load_weights(_LazyWeights(thunks, bar))
            log.info("loaded %d tensors of %s in %.1f s", len(thunks), path, time.perf_counter() - start)
        finally:
            torch.set_num_threads(threads)
    except _READ_ERRORS as e:
        raise ModelLoadError(f"cannot load model from {path}: {_one_line(e)}") from e
    return config, model.eval(), identity


def _dummy_config(path: str) -> ModelConfig:
    spec = path[len(DUMMY_PREFIX) :]
    if spec in NAMED_SHAPES:
        return NAMED_SHAPES[spec]
    if not spec.endswith(".json"):
        raise ModelLoadError(
            f"cannot load model from {path}: unknown dummy shape {spec!r}; "
            f"named shapes: {sorted(NAMED_SHAPES)}, or a path to a config.json"
        )
    try:
        with open(spec, encoding="utf-8") as f:
            d = json.load(f)
        return ModelConfig.from_hf_config(d) if "model_type" in d else ModelConfig.from_dict(d)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"cannot load model from {path}: {_one_line(e)}") from e


def _check_file(path: str) -> None:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file: {path}")


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text}"
