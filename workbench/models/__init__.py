"""Model loading (Hugging Face folders, GGUF files, the embedded default)."""

from .loader import DEFAULT_MODEL, LoadedModel, ModelConfig, load_model

__all__ = ["DEFAULT_MODEL", "LoadedModel", "ModelConfig", "load_model"]
