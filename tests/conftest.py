import os

# Triton reads this when @triton.jit runs, so it must be set before any kernel module is
# imported; without a GPU only the interpreter can run the kernels.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass
