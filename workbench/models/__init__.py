"""Models: the transformer and loading it from every format the engine accepts.

- `llama`: the Llama-family transformer, composed in torch ops; `cpu_forward`: the same
  forward on our C kernels; `linear`: quantised linears (int8 / int4 / fp8);
- `loader`: `load_model(model, dtype)`, the entry point; `config`: what a loaded model is
  (`ModelConfig`, `LoadedModel`, weight names and shapes); `hf`: Hugging Face folders;
  `gguf`: GGUF files; `embedded`: the embedded default model and its cache.
"""

from .loader import DEFAULT_MODEL, LoadedModel, ModelConfig, load_model

__all__ = ["DEFAULT_MODEL", "LoadedModel", "ModelConfig", "load_model"]
