"""Hugging Face model folders: config.json + *.safetensors (possibly sharded) [+ tokenizer.json],
read and written."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..tokenizer import Tokenizer
from .config import LoadedModel, ModelConfig, select_weights, weights_checksum


# ----------------------------------------------------------------------------------- HF folders
def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise FileNotFoundError(f"{path}: shard(s) listed in {index.name} are missing: {', '.join(missing)}")
        return [path / f for f in files]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        other = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf")]
        hint = f" (found {', '.join(other[:3])}: only safetensors folders are supported)" if other else ""
        raise FileNotFoundError(f"{path}: no model weights (*.safetensors or model.safetensors.index.json){hint}")
    return files


def load_hf_dir(path: Path, dtype: torch.dtype, name: str | None = None) -> LoadedModel:
    from safetensors import safe_open

    t0 = time.perf_counter()
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if not path.is_dir():
        raise ValueError(f"unsupported model file {path}: expected a Hugging Face model folder or a .gguf file")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path}: missing config.json (not a Hugging Face model folder)")
    cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    config = ModelConfig.from_hf_config(cfg, str(path), name=name)
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        gen_eos = json.loads(gen_file.read_text(encoding="utf-8")).get("eos_token_id")
        for e in [gen_eos] if isinstance(gen_eos, int) else gen_eos or []:
            if int(e) not in config.eos_token_ids:
                config.eos_token_ids.append(int(e))

    raw: dict[str, torch.Tensor] = {}
    for f in _weight_files(path):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                raw[k] = sf.get_tensor(k)
    weights = select_weights(raw, config, str(path), dtype)
    del raw

    tokenizer = None
    if (path / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_dir(path, eos_token_ids=config.eos_token_ids)
        for e in tokenizer.eos_token_ids:
            if e not in config.eos_token_ids:
                config.eos_token_ids.append(e)
        if config.bos_token_id is None:
            config.bos_token_id = tokenizer.bos_token_id
    checksum = weights_checksum(weights)
    return LoadedModel(config, weights, tokenizer, checksum, time.perf_counter() - t0)


def _save_weights(weights: dict[str, torch.Tensor], file: Path) -> None:
    from safetensors.torch import save_file

    save_file(weights, str(file), metadata={"format": "pt"})


def _save_tokenizer(tokenizer: Tokenizer, folder: Path, config: ModelConfig) -> None:
    tokenizer.save(folder)
    cfg_file = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    cfg["model_max_length"] = config.max_position_embeddings
    cfg["add_bos_token"] = False
    cfg["add_prefix_space"] = False
    if tokenizer.eos_token is not None:
        cfg.setdefault("pad_token", tokenizer.eos_token)
    cfg_file.write_text(json.dumps(cfg, indent=2, ensure_ascii=False), encoding="utf-8")


def write_hf_dir(
    folder: Path,
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    tokenizer: Tokenizer | None,
) -> None:
    """Write a Hugging Face-style model folder."""
    (folder / "config.json").write_text(json.dumps(config.to_hf_config("bfloat16"), indent=2), encoding="utf-8")
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_ids or None}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2), encoding="utf-8")
    _save_weights(weights, folder / "model.safetensors")
    if tokenizer is not None:
        _save_tokenizer(tokenizer, folder, config)
