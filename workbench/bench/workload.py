"""Fixed, seeded benchmark workloads.

A workload is a list of requests, each with prompt token ids, a forced output length (the
systems run with ignore_eos, so every request produces exactly `max_tokens` tokens) and an
arrival offset in seconds from the start of the run.

Prompts are slices of `data/text.txt` (English prose) cut at distinct seeded offsets, so no two
prompts share a prefix by accident (which would flatter an engine with prefix caching). A model
without a tokenizer gets deterministic token ids drawn from its vocabulary instead.

Everything is drawn from one `random.Random(seed)`: the same arguments give the same workload on
every machine and Python version.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

TEXT_FILE = Path(__file__).with_name("data") / "text.txt"

DEFAULT_NUM_REQUESTS = 64
DEFAULT_PROMPT_LEN = (32, 512)
DEFAULT_OUTPUT_LEN = (32, 256)
ARRIVALS = ("all", "poisson", "bursty")
BURSTY_SHAPE = 0.25  # gamma shape of the bursty gaps: coefficient of variation 2 (Poisson: 1)


@dataclass
class BenchRequest:
    index: int
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0  # offset from the start of the run
    prompt: str | None = None  # sent as this text instead of the ids (servers with other tokenizers)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class Workload:
    requests: list[BenchRequest]
    seed: int
    arrival: str = "all"
    rate: float | None = None
    source: str = "text"  # "text" (tokenized English) or "vocab" (random ids)
    prompt_len_range: tuple[int, int] = DEFAULT_PROMPT_LEN
    output_len_range: tuple[int, int] = DEFAULT_OUTPUT_LEN
    extra: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def describe(self) -> dict:
        """A JSON-ready summary (without the token ids)."""
        return {
            "num_requests": len(self.requests),
            "seed": self.seed,
            "arrival": self.arrival,
            "rate": self.rate,
            "source": self.source,
            "prompt_len_range": list(self.prompt_len_range),
            "output_len_range": list(self.output_len_range),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "last_arrival_s": max((r.arrival_s for r in self.requests), default=0.0),
            **self.extra,
        }

    def to_dict(self) -> dict:
        return {**self.describe(), "requests": [asdict(r) for r in self.requests]}


@lru_cache(maxsize=4)
def _text_tokens(tokenizer) -> tuple[int, ...]:
    return tuple(tokenizer.encode(TEXT_FILE.read_text(encoding="utf-8"), add_special_tokens=False))


def text_token_ids(tokenizer) -> list[int]:
    """The shipped English text, tokenized (cached per tokenizer object)."""
    return list(_text_tokens(tokenizer))


def make_workload(
    num_requests: int = DEFAULT_NUM_REQUESTS,
    *,
    seed: int = 0,
    tokenizer=None,
    vocab_size: int | None = None,
    prompt_len: tuple[int, int] = DEFAULT_PROMPT_LEN,
    output_len: tuple[int, int] = DEFAULT_OUTPUT_LEN,
    arrival: str = "all",
    rate: float | None = None,
    special_token_ids: tuple[int, ...] | list[int] = (),
) -> Workload:
    """Build a workload. Give `tokenizer` (English prompts) or `vocab_size` (random token ids).

    Prompt and output lengths are uniform integers in the inclusive ranges. `arrival="all"`
    releases every request at t=0; `"poisson"` spaces them with exponential gaps at `rate`
    requests per second (the first arrives at t=0); `"bursty"` with gamma gaps of the same mean
    and twice the spread (clumps and lulls).
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    for name, (lo, hi) in (("prompt_len", prompt_len), ("output_len", output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must be a range (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {ARRIVALS}, got {arrival!r}")
    if arrival in ("poisson", "bursty") and (rate is None or rate <= 0):
        raise ValueError(f"arrival={arrival!r} needs a rate > 0 (requests per second), got {rate!r}")
    if tokenizer is None and not vocab_size:
        raise ValueError("give a tokenizer (English prompts) or a vocab_size (random token-id prompts)")

    rng = random.Random(seed)
    lengths = [rng.randint(*prompt_len) for _ in range(num_requests)]
    outputs = [rng.randint(*output_len) for _ in range(num_requests)]

    if tokenizer is not None:
        source = "text"
        corpus = text_token_ids(tokenizer)
        # Distinct start offsets where possible; wrap around the text for long prompts.
        span = max(1, len(corpus) - prompt_len[1])
        if span >= num_requests:
            offsets = rng.sample(range(span), num_requests)
        else:
            offsets = [rng.randrange(len(corpus)) for _ in range(num_requests)]
        prompts = []
        for off, n in zip(offsets, lengths):
            ids = [corpus[(off + i) % len(corpus)] for i in range(n)]
            prompts.append(ids)
    else:
        source = "vocab"
        # Low ids are usually special tokens (pad, bos, eos): draw from above them.
        banned = set(special_token_ids) | (set(range(3)) if vocab_size > 16 else set())
        pool = [t for t in range(vocab_size) if t not in banned] or list(range(vocab_size))
        prompts = [[rng.choice(pool) for _ in range(n)] for n in lengths]

    arrivals = [0.0] * num_requests
    if arrival in ("poisson", "bursty"):
        t = 0.0
        for i in range(1, num_requests):
            # bursty: gamma gaps with the same mean, so requests come in clumps with lulls between
            t += (
                rng.expovariate(rate)
                if arrival == "poisson"
                else rng.gammavariate(BURSTY_SHAPE, 1 / (BURSTY_SHAPE * rate))
            )
            arrivals[i] = t

    reqs = [BenchRequest(i, p, o, a) for i, (p, o, a) in enumerate(zip(prompts, outputs, arrivals))]
    return Workload(
        reqs,
        seed,
        arrival,
        rate if arrival in ("poisson", "bursty") else None,
        source,
        tuple(prompt_len),
        tuple(output_len),
    )


def single_stream_request(
    workload_tokens: list[int] | None,
    *,
    vocab_size: int | None = None,
    prompt_len: int = 64,
    max_tokens: int = 256,
    seed: int = 0,
) -> BenchRequest:
    """The one request of the single-stream decode scenario: a short prompt, long output."""
    if workload_tokens:
        ids = list(workload_tokens[-prompt_len:])  # the end of the text: unlikely to be a workload prefix
    else:
        rng = random.Random(seed + 1)
        ids = [rng.randrange(3 if vocab_size > 3 else 0, vocab_size) for _ in range(prompt_len)]
    return BenchRequest(0, ids, max_tokens, 0.0)
