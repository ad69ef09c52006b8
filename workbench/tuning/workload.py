"""The workload a sweep runs: the bench's seeded workloads, or the user's prompts, as token ids."""

from typing import Any

from ..bench.workload import BenchRequest, Workload, make_workload
from .grid import DEFAULT_MAX_TOKENS, DEFAULT_WORKLOAD, stable_hash


# ----------------------------------------------------------------------------- the workload
def _local_tokenizer(engine, status: dict):
    tok = getattr(engine, "tokenizer", None)
    if tok is not None:
        return tok
    try:
        from ..models.embedded import DEFAULT_MODEL, default_gguf_path, ensure_converted

        if status.get("model") == DEFAULT_MODEL:
            from ..tokenizer import Tokenizer

            return Tokenizer.from_dir(ensure_converted(default_gguf_path(), DEFAULT_MODEL))
    except Exception:  # no local copy of the model: fall back to token ids
        pass
    return None


def make_sweep_workload(
    engine, workload=None, *, max_tokens: int = DEFAULT_MAX_TOKENS, status: dict | None = None
) -> Workload:
    """The workload a sweep runs, as token ids (the bench `Workload`):

    - None, an int (number of requests) or a dict of `make_workload` arguments: a bench workload
      (English text when the model's tokenizer is at hand, else seeded token ids), defaults
      `DEFAULT_WORKLOAD`;
    - a bench `Workload`: as is;
    - a list of prompts (str) and/or token-id lists: each one request of `max_tokens` output tokens,
      all arriving at once (text is tokenized by the engine's tokenizer).
    """
    status = status if status is not None else engine.status()
    if isinstance(workload, Workload):
        return workload
    if workload is None or isinstance(workload, (int, dict)):
        kw = dict(DEFAULT_WORKLOAD)
        if isinstance(workload, int):
            kw["num_requests"] = workload
        elif isinstance(workload, dict):
            unknown = set(workload) - {"num_requests", "seed", "prompt_len", "output_len", "arrival", "rate"}
            if unknown:
                raise ValueError(
                    f"unknown workload option(s) {sorted(unknown)}; allowed: num_requests, seed, "
                    "prompt_len, output_len, arrival, rate"
                )
            kw.update(workload)
        kw["prompt_len"], kw["output_len"] = tuple(kw["prompt_len"]), tuple(kw["output_len"])
        tok = _local_tokenizer(engine, status)
        return make_workload(tokenizer=tok, vocab_size=status.get("vocab_size"), **kw)
    if isinstance(workload, (list, tuple)):
        if not workload:
            raise ValueError("the workload's prompt list is empty")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        ids: list[list[int] | None] = []
        texts = [p for p in workload if isinstance(p, str)]
        for p in workload:
            if isinstance(p, str):
                ids.append(None)
            elif isinstance(p, (list, tuple)) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                ids.append(list(p))
            else:
                raise TypeError(f"a workload prompt must be a str or a non-empty list of token ids, got {p!r}")
        if texts:
            encoded = _tokenize(engine, status, texts)
            it = iter(encoded)
            ids = [next(it) if x is None else x for x in ids]
        reqs = [BenchRequest(i, x, max_tokens, 0.0) for i, x in enumerate(ids)]
        w = Workload(
            reqs,
            seed=0,
            source="prompts",
            prompt_len_range=(min(map(len, ids)), max(map(len, ids))),
            output_len_range=(max_tokens, max_tokens),
        )
        w.extra["prompts"] = [p if isinstance(p, str) else None for p in workload]
        return w
    raise TypeError(
        "workload must be None, an int, a dict of make_workload options, a bench Workload or a "
        f"list of prompts; got {type(workload).__name__}"
    )


def _tokenize(engine, status: dict, texts: list[str]) -> list[list[int]]:
    tok = _local_tokenizer(engine, status)
    if tok is not None:
        return [tok.encode(t, add_special_tokens=True) for t in texts]
    # No tokenizer here: let the engine tokenize (one-token requests; their prompts come back as ids).
    from ..sampling_params import SamplingParams

    outs = engine.generate(texts, SamplingParams(max_tokens=1, temperature=0.0))
    return [list(o.prompt_token_ids) for o in outs]


def workload_definition(w: Workload) -> dict[str, Any]:
    d = w.describe()
    d["fingerprint"] = stable_hash([[r.prompt_token_ids, r.max_tokens, r.arrival_s] for r in w.requests])
    if w.extra.get("prompts"):
        d["prompts"] = w.extra["prompts"]
    return d
