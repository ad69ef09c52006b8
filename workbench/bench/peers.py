"""Peers: Hugging Face transformers `generate` on the same weights and the same prompts.

- `hf_sequential`: one request at a time, batch 1, no padding;
- `hf_static`: padded static batches (16 by default, left padding): a batch starts when the
  previous one is done and takes the requests that have arrived by then, runs until its longest
  request is done, and each request keeps only its own number of tokens.

`generate` may keep the KV in transformers' preallocated static cache (`cache_kwargs("static")`,
instead of the growing dynamic one) and with it compile the decoding forward with torch.compile
(`compile=True`; transformers does so on CUDA only); the bench gives these to `hf_static`.

Greedy, EOS ignored (the model's generation config is replaced so nothing stops early). Per-token
times come from a streamer, which `generate` calls right after each step's tokens are chosen.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from ..models import shapes
from .stats import RequestRecord
from .workload import BenchRequest, Workload


def load_hf_model(path: str, dtype: torch.dtype, device="cpu", quantization_config=None):
    """The transformers model for a Hugging Face folder, set up for greedy, EOS-free decoding.
    `quantization_config` (e.g. `torchao_config(...)`) loads it through transformers' quantised path."""
    try:
        import transformers

        with quiet_torchao():
            import transformers.modeling_utils  # noqa: F401 - imports torchao where it is installed
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("the hf_* peers need transformers: pip install transformers") from e
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    kw = {} if quantization_config is None else {"quantization_config": quantization_config}
    if shapes.shape_of(path):  # a model shape: our random weights, made on the device
        if quantization_config is not None:
            raise ValueError(f"the quantised transformers peers load a model folder, not {path!r}")
        model = shapes.hf_model(shapes.shape_of(path), dtype, device)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).to(device).eval()
    pad = model.config.pad_token_id
    if pad is None:
        eos = model.config.eos_token_id
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    # No eos_token_id: generate never stops early (ignore_eos), so every request gets its length.
    model.generation_config = transformers.GenerationConfig(
        do_sample=False,
        eos_token_id=None,
        pad_token_id=pad,
        bos_token_id=model.config.bos_token_id,
    )
    return model


TORCHAO_NOTE = (
    "int8: Int8WeightOnlyConfig (per-channel int8, activations in the model dtype); int4: on CPU "
    "PrototypeInt4WeightOnlyConfig (torch's _weight_int4pack_mm_for_cpu), else "
    "Int4WeightOnlyConfig; lm_head and embeddings stay unquantised"
)


@contextlib.contextmanager
def quiet_torchao():
    """Imports of torchao (transformers imports it too, when installed) without its warnings: one
    per CUDA extension a CPU machine cannot load, and torch's deprecation notes on its enums."""
    import logging

    logs = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


def torchao_config(mode: str, group_size: int = 128, device="cpu"):
    """transformers' own quantised path for weight-only `mode` ("int8" or "int4"): a `TorchAoConfig`.
    Raises (ImportError, ValueError, ...) where torchao or the mode is not available."""
    import transformers

    with quiet_torchao():
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig

    if mode == "int8":
        quant = Int8WeightOnlyConfig()
    elif mode == "int4":
        if torch.device(device).type == "cpu":
            with quiet_torchao():
                from torchao.prototype.quantization.int4.inference_workflow import (
                    PrototypeInt4WeightOnlyConfig,
                )

            quant = PrototypeInt4WeightOnlyConfig(group_size=group_size)
        else:
            quant = Int4WeightOnlyConfig(group_size=group_size)
    else:
        raise ValueError(f"no torchao weight-only config for quantization {mode!r}")
    return transformers.TorchAoConfig(quant_type=quant)


class _TokenClock:
    """A transformers streamer (duck-typed: `generate` calls put/end) recording when each
    generation step's tokens arrive."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        now = time.monotonic()
        if not self._prompt_seen:  # the first put is the prompt itself
            self._prompt_seen = True
            return
        self.times.append(now)

    def end(self) -> None:
        pass


def cache_kwargs(cache: str, compile: bool) -> dict:
    """`generate`'s arguments for a KV cache kind ("dynamic", "static") and whether it may compile."""
    if cache not in ("dynamic", "static"):
        raise ValueError(f"invalid hf cache {cache!r}; allowed: 'dynamic', 'static'")
    if compile and cache != "static":
        raise ValueError("transformers compiles generate with a static cache only: pass cache='static'")
    if cache == "dynamic":
        return {}
    from transformers import GenerationConfig

    # with a static cache, transformers compiles on its own where it can; older versions cannot be told not to
    off = {"disable_compile": not compile} if hasattr(GenerationConfig(), "disable_compile") else {}
    return {"cache_implementation": "static", **off}


def generate_batch(
    model, batch: list[BenchRequest], arrivals: list[float], generate_kw: dict | None = None
) -> list[RequestRecord]:
    """One padded `generate` call for `batch` (`generate_kw`: `cache_kwargs`); records each
    request's tokens and token times."""
    pad = model.generation_config.pad_token_id
    width = max(r.prompt_len for r in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):
        ids[row, width - r.prompt_len :] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
        mask[row, width - r.prompt_len :] = 1
    max_new = max(r.max_tokens for r in batch)
    clock = _TokenClock()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=max_new,
            do_sample=False,
            streamer=clock,
            **(generate_kw or {}),
        )
    gen = out[:, width:]
    records = []
    for row, (r, arrival) in enumerate(zip(batch, arrivals)):
        n = r.max_tokens
        times = clock.times[:n]
        records.append(
            RequestRecord(
                r.index, arrival, r.prompt_len, gen[row, :n].tolist(), times, times[-1] if times else time.monotonic()
            )
        )
    return records


def run_hf(
    model,
    workload: Workload,
    *,
    batch_size: int = 1,
    progress: Callable[[int], None] | None = None,
    generate_kw: dict | None = None,
) -> tuple[list[RequestRecord], float]:
    """Serve the workload with `generate`, honouring arrival times. Returns (records, start)."""
    pending = sorted(workload.requests, key=lambda r: (r.arrival_s, r.index))
    records: list[RequestRecord] = []
    start = time.monotonic()
    i = 0
    while i < len(pending):
        release = start + pending[i].arrival_s
        now = time.monotonic()
        if release > now:
            time.sleep(release - now)
            now = time.monotonic()
        batch = [pending[i]]
        i += 1
        while i < len(pending) and len(batch) < batch_size and start + pending[i].arrival_s <= now:
            batch.append(pending[i])
            i += 1
        records += generate_batch(model, batch, [start + r.arrival_s for r in batch], generate_kw)
        if progress is not None:
            progress(len(batch))
    records.sort(key=lambda r: r.index)
    return records, start


def warm_up(model, vocab_size: int) -> None:
    """One short generate so one-time costs (allocations, kernel selection) stay out of the timing."""
    r = BenchRequest(-1, [min(5 + i, vocab_size - 1) for i in range(16)], 4)
    generate_batch(model, [r, BenchRequest(-2, r.prompt_token_ids[:8], 4)], [time.monotonic()] * 2)
