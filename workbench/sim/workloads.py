"""What the simulator serves: the bench's seeded workloads, a recorded timeline replayed as a trace,
the calibration runs, and the model's shape (without loading its weights)."""

from __future__ import annotations

import functools
import random
from collections.abc import Iterable
from typing import Any

from ..bench.workload import BenchRequest, Workload, make_workload
from ..timeline import Timeline

WORKLOAD_KEYS = ("num_requests", "seed", "prompt_len", "output_len", "arrival", "rate")
DEFAULT_WORKLOAD = {"num_requests": 64, "arrival": "poisson", "rate": 4.0, "seed": 0}


def trace_requests(timeline: Timeline, vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """A recorded timeline as a workload: every request that arrived and finished in it, at its
    arrival offset, with its prompt length (the "arrived" event) and the tokens its steps produced
    (one per decode step, one when its prefill completed). Token ids are seeded stand-ins, so
    prefix sharing in the original prompts is not replayed."""

    arrived: dict[str, tuple[float, int]] = {}
    finished: set[str] = set()
    for ev in timeline.requests:
        if ev.kind == "arrived" and ev.detail and ev.detail.startswith("prompt_tokens="):
            arrived[ev.request_id] = (ev.time, int(ev.detail.split("=", 1)[1]))
        elif ev.kind == "finished":
            finished.add(ev.request_id)
    produced: dict[str, int] = {}
    computed: dict[str, int] = {}
    for st in timeline.steps:
        for e in st.batch:
            if e.request_id not in arrived:
                continue
            done = computed.get(e.request_id, 0) + e.num_tokens
            computed[e.request_id] = done
            if e.kind != "prefill" or done >= arrived[e.request_id][1]:
                produced[e.request_id] = produced.get(e.request_id, 0) + 1
    keep = sorted((rid for rid in arrived if rid in finished and produced.get(rid)), key=lambda r: arrived[r][0])
    if not keep:
        raise ValueError("the timeline holds no request that arrived, ran and finished: nothing to replay")
    t0 = arrived[keep[0]][0]
    rng = random.Random(seed)
    return [
        BenchRequest(
            i, [rng.randrange(3, vocab_size) for _ in range(arrived[rid][1])], produced[rid], arrived[rid][0] - t0
        )
        for i, rid in enumerate(keep)
    ]


def describe_workload(workload, requests: list[BenchRequest]) -> dict[str, Any]:
    if isinstance(workload, Workload):
        return workload.describe()
    if isinstance(workload, Timeline):
        return {
            "trace": "timeline",
            "requests": len(requests),
            "prompt_tokens": sum(r.prompt_len for r in requests),
            "output_tokens": sum(r.max_tokens for r in requests),
        }
    d = {**DEFAULT_WORKLOAD, **(workload or {})} if isinstance(workload, dict) or workload is None else {}
    return {
        **{k: list(v) if isinstance(v, tuple) else v for k, v in d.items()},
        "requests": len(requests),
        "prompt_tokens": sum(r.prompt_len for r in requests),
        "output_tokens": sum(r.max_tokens for r in requests),
    }


def calibration_workloads(workload, vocab: int, max_len: int, max_num_seqs: int = 64) -> Iterable[Workload]:
    """Steps of every shape the fit needs: a full-width burst of the bench's prompt lengths with
    short outputs (prefill chunks, the widest decode batches over long contexts), a 16-wide burst
    (the GEMM path's narrow end, which the widest burst only passes through), a narrow burst, a
    few long prompts whose decodes narrow from 4 sequences to 1 (small steps over long contexts:
    without them the fit cannot tell what attending over a long context costs a small step, and
    under-predicted those steps by 20-35%), and a single stream (small steps)."""
    if workload is not None:
        yield make_workload(vocab_size=vocab, **workload)
        return
    longest = max(32, min(512, max_len // 2 - 64))
    yield make_workload(
        max(8, min(max_num_seqs, 64)), seed=11, vocab_size=vocab, prompt_len=(32, longest), output_len=(8, 64)
    )
    if max_num_seqs > 16:
        yield make_workload(16, seed=15, vocab_size=vocab, prompt_len=(32, longest), output_len=(32, 64))
    yield make_workload(8, seed=12, vocab_size=vocab, prompt_len=(32, longest // 2), output_len=(32, 32))
    yield make_workload(
        4,
        seed=14,
        vocab_size=vocab,
        prompt_len=(longest, max(longest, min(2 * longest, max_len - 160))),
        output_len=(32, 96),
    )
    yield make_workload(1, seed=13, vocab_size=vocab, prompt_len=(32, 64), output_len=(64, 64))


def model_config(model):
    """The model's config without loading its weights (None: the embedded default)."""
    import json
    from pathlib import Path

    from ..models import shapes
    from ..models.config import ModelConfig

    if shapes.shape_of(model) is not None:  # a published shape: its config is all the simulator needs
        return shapes.shape_config(shapes.shape_of(model))
    if model is None or (isinstance(model, str) and model in ("smollm2-135m", "default")):
        from ..models.embedded import DEFAULT_MODEL, default_gguf_path, ensure_converted

        path = ensure_converted(default_gguf_path(), DEFAULT_MODEL)
    else:
        path = Path(model).expanduser()
        if not path.exists():
            from ..models.loader import model_not_found

            raise model_not_found(model)
    if path.suffix.lower() == ".gguf":
        from ..models.gguf import read_gguf_config

        return read_gguf_config(path)  # the metadata only: its weights are not needed here
    cfg = path / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"{path}: no config.json (the simulator needs the model's shape, not its weights)")
    return ModelConfig.from_hf_config(json.loads(cfg.read_text(encoding="utf-8")), str(path))


@functools.lru_cache(maxsize=1)
def _embedded_tokenizer():
    try:
        from ..models.embedded import DEFAULT_MODEL, default_gguf_path, ensure_converted
        from ..tokenizer import Tokenizer

        return Tokenizer.from_dir(ensure_converted(default_gguf_path(), DEFAULT_MODEL))
    except Exception:  # the default model is not installed: token-id prompts
        return None


def default_tokenizer(model):
    """The embedded default's tokenizer (one object, loaded once) for it and the named accelerators."""
    if model not in (None, "smollm2-135m", "default"):
        return None
    return _embedded_tokenizer()
