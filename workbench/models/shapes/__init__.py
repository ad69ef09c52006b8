"""Model shapes without their weights: the published config.json of models researchers run, kept in
this folder, built with random weights where the engine runs, to measure speed at their size with
no download (speed does not depend on the values; exactness is checked on small random models
against transformers).

    load_model("shape:llama3-8b", device="cuda")        LLM("shape:qwen2.5-7b")
    workbench gpucheck --shape llama3-8b                 workbench bench --model shape:llama3-8b

A shape has no tokenizer: prompts go as token ids.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..config import LoadedModel, ModelConfig, expected_weight_shapes

PREFIX = "shape:"
FOLDER = Path(__file__).resolve().parent
INIT_STD = 0.02  # the weights' scale: the usual initialisation (norms are ones, biases zeros)


def shape_names() -> list[str]:
    return sorted(p.stem for p in FOLDER.glob("*.json"))


def shape_of(model) -> str | None:
    """NAME of a model named "shape:NAME", else None."""
    return model.removeprefix(PREFIX) if isinstance(model, str) and model.startswith(PREFIX) else None


def _published(name: str) -> dict:
    """Shape `name`'s config.json (ValueError naming the known ones)."""
    path = FOLDER / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(shape_names())}")
    return json.loads(path.read_text(encoding="utf-8"))


def shape_config(name: str) -> ModelConfig:
    """The config of shape `name` (ValueError naming the known ones)."""
    return ModelConfig.from_hf_config(_published(name), f"{PREFIX}{name}", name=f"{name} (random weights)")


def load_shape(name: str, dtype: torch.dtype, device: torch.device | str = "cpu", seed: int = 0) -> LoadedModel:
    """Shape `name` with random weights made on `device` (an 8B model's 16 GB are never built on
    the host and copied over)."""
    t0 = time.perf_counter()
    config = shape_config(name)
    weights = {k: torch.empty(s, device=device, dtype=dtype) for k, s in expected_weight_shapes(config).items()}
    fill_random(config, weights, seed)
    checksum = f"random weights of shape {name} (seed {seed})"  # no file behind them to hash
    return LoadedModel(config, weights, None, checksum, load_seconds=time.perf_counter() - t0)


def fill_random(config: ModelConfig, tensors: dict[str, torch.Tensor], seed: int = 0) -> None:
    """Fill a model's tensors (ours, or a transformers model's state dict) in place, key by key in
    one order from one generator, so both hold the same values: matrices normal(0, INIT_STD), norms
    ones, biases zeros."""
    gen = None  # on the tensors' device, made at the first matrix
    with torch.no_grad():
        for key in expected_weight_shapes(config):
            t = tensors[key]
            if t.dim() == 2:
                gen = gen or torch.Generator(t.device).manual_seed(seed)
                t.normal_(0.0, INIT_STD, generator=gen)
            else:
                t.fill_(0.0 if key.endswith(".bias") else 1.0)


def hf_model(name: str, dtype: torch.dtype, device: torch.device | str = "cpu", seed: int = 0):
    """The transformers model of shape `name`, holding exactly `load_shape(name, ..., seed)`'s
    weights (the peers of `workbench bench` and gpucheck on a shape)."""
    import transformers

    hf_config = transformers.AutoConfig.for_model(**_published(name))
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    fill_random(shape_config(name), dict(model.named_parameters()), seed)
    return model.eval()
