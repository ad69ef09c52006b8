"""`load_model(model, dtype)`: any model form the engine accepts, as a `LoadedModel`.

`model` may be None or "smollm2-135m" (the embedded default, `embedded.py`), a Hugging Face
model folder (`hf.py`) or a `.gguf` file (`gguf.py`). What a loaded model is, whatever its
format, lives in `config.py`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from .config import (
    SUPPORTED_ARCHITECTURES,
    LoadedModel,
    ModelConfig,
    config_dict,
    expected_weight_shapes,
    weights_checksum,
)
from .embedded import (
    DEFAULT_ALIASES,
    DEFAULT_MODEL,
    cache_root,
    convert_gguf_to_hf,
    default_gguf_path,
    ensure_converted,
)
from .gguf import load_gguf, read_gguf, read_gguf_config
from .hf import load_hf_dir
from .shapes import load_shape, shape_config, shape_of

__all__ = [
    "DEFAULT_MODEL",
    "SUPPORTED_ARCHITECTURES",
    "LoadedModel",
    "ModelConfig",
    "cache_root",
    "config_dict",
    "convert_gguf_to_hf",
    "default_gguf_path",
    "ensure_converted",
    "expected_weight_shapes",
    "load_model",
    "model_config",
    "read_gguf",
    "weights_checksum",
]


def load_model(
    model: str | os.PathLike | None = None, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"
) -> LoadedModel:
    """Load a model's config, weights (cast to `dtype`) and tokenizer.

    `model`: None or "smollm2-135m" for the embedded default; a Hugging Face model folder; a
    `.gguf` file (parsed and dequantised on every call; only the default is cached); or
    "shape:NAME" (`models.shapes`: a published config with random weights, made on `device`;
    everything else is loaded on the CPU).
    """
    if shape_of(model):
        return load_shape(shape_of(model), dtype, device)
    if model is None or (isinstance(model, str) and model in DEFAULT_ALIASES and not os.path.exists(model)):
        t0 = time.perf_counter()
        folder = ensure_converted(default_gguf_path(), DEFAULT_MODEL)
        loaded = load_hf_dir(folder, dtype, name=DEFAULT_MODEL)
        loaded.load_seconds = time.perf_counter() - t0
        return loaded
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return load_gguf(path, dtype)
    if not path.exists():
        raise model_not_found(model)
    return load_hf_dir(path, dtype)


def model_config(model: str | os.PathLike | None = None) -> ModelConfig | None:
    """`model`'s config without its weights (to size what loading it takes), or None where it
    cannot be read so (`load_model` then says what is wrong)."""
    try:
        if shape_of(model):
            return shape_config(shape_of(model))
        if model is None or (isinstance(model, str) and model in DEFAULT_ALIASES and not os.path.exists(model)):
            return read_gguf_config(default_gguf_path())
        path = Path(model).expanduser()
        if path.suffix.lower() == ".gguf":
            return read_gguf_config(path)
        return ModelConfig.from_hf_config(json.loads((path / "config.json").read_text(encoding="utf-8")), str(path))
    except Exception:
        return None


def model_not_found(model) -> FileNotFoundError:
    """The error for a model named by a path that is not there, listing what a model can be."""
    return FileNotFoundError(
        f"model {str(model)!r} not found: expected {DEFAULT_MODEL!r}, a Hugging Face model folder or a .gguf file, "
        "or shape:NAME (a published model's shape, random weights)"
    )
