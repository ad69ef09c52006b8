"""Paged-attention kernels (Triton) and their torch references.

Installed as `workbench_kernels` (never as a top-level `kernels`, a name that belongs to Hugging
Face's package). The layout of the paged KV cache is documented in `reference.py`.
"""

if __name__ == "kernels":
    # Imported as a top-level `kernels`: a checkout's root is on sys.path (`python -m ...` started
    # there) and this folder shadows the name, while whoever imported it (transformers does, when
    # Hugging Face's `kernels` is installed) wants that package. Load it in this module's place.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    )
    if _spec is not None:  # else this stays an empty module, as a probe for the package expects
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)
