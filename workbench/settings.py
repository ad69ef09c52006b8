"""Engine settings, defined once.

`EngineSettings` (traitlets) is the single source of truth: kwargs to `LLM`/`start_engine`,
`configure(**changes)`, `%engine set`, the dashboard widgets and the lab panel all read the
names, allowed values, kinds and help text from here.

Settings tagged `shapes_kv` change the values a step writes into the KV cache (weights,
kernels, experts per token): the prefix cache keys its blocks by them (`kv_salt`).

Kinds say what a change costs:
- live:     takes effect at the next step boundary;
- relayout: weights or KV cache re-laid out inside the running engine, requests kept;
- reload:   a model (the draft) is loaded inside the running engine;
- restart:  fixed when the engine starts.
"""

from __future__ import annotations

from typing import Any

from traitlets import Bool, Enum, HasTraits, Int, TraitError, Unicode

LIVE, RELAYOUT, RELOAD, RESTART = "live", "relayout", "reload", "restart"

# An engine process's limits (flags of `workbench serve`, not engine settings). Admission: what may
# wait before new requests are refused (EngineBusyError); the HTTP front bounds its own text alike.
DEFAULT_MAX_QUEUED_CHARS = 64 << 20  # prompt text waiting for the tokenizer
DEFAULT_MAX_QUEUED_TOKENS = 1 << 22  # prompt tokens of requests admitted but not yet running
DEFAULT_DRAIN_TIMEOUT_S = 30.0  # after SIGTERM, how long running requests may finish


class EngineSettings(HasTraits):
    batching = Enum(["continuous", "static", "off"], default_value="continuous").tag(
        label="Batching",
        headline=True,
        kind=LIVE,
        doc="continuous: admit every step; static: run a batch to completion; off: one at a time",
    )
    max_num_seqs = Int(64, min=1, max=4096).tag(
        label="Max sequences per batch",
        kind=LIVE,
        doc="most sequences in one batch",
    )
    max_num_batched_tokens = Int(1024, min=16, max=1 << 20).tag(
        label="Token budget per step",
        kind=LIVE,
        doc="token budget per step (chunked-prefill size)",
    )
    attention_aware_budget = Bool(True).tag(
        label="Budget counts long-context attention",
        kind=LIVE,
        doc="a prefill chunk's tokens past the model's attention context count for their attention too, so "
        "long prompts take smaller chunks and no step stalls the decodes beside it",
    )
    step_time_target_ms = Int(350, min=0, max=600_000).tag(
        label="Step time target (ms)",
        kind=LIVE,
        doc="while requests decode, cap a step's prefill work so the step is predicted (from recent steps' time "
        "per token and attended position) to take at most this long: their gap between tokens; 0: off",
    )
    kv_cache = Bool(True).tag(
        label="KV cache",
        headline=True,
        kind=LIVE,
        doc="False recomputes the whole context every step",
    )
    prefix_caching = Bool(True).tag(
        label="Prefix caching",
        headline=True,
        kind=LIVE,
        doc="reuse KV blocks of identical prompt prefixes",
    )
    response_cache = Bool(False).tag(
        label="Response cache",
        kind=LIVE,
        doc="answer an exact repeat of a greedy or seeded request from its earlier answer, without a step",
    )
    kv_cache_dtype = Enum(["auto", "int8", "fp8"], default_value="auto").tag(
        shapes_kv=True,
        label="KV cache dtype",
        kind=RELAYOUT,
        doc="KV cache storage type",
    )
    quantization = Enum(["none", "int8", "int4", "fp8"], default_value="none").tag(
        shapes_kv=True,
        label="Quantisation",
        headline=True,
        kind=RELAYOUT,
        doc="weight-only quantisation of the linear layers",
    )
    quant_group_size = Enum(["auto", 32, 64, 128], default_value="auto").tag(
        shapes_kv=True,
        label="int4 group size",
        kind=RELAYOUT,
        doc="int4 group size (auto: the source checkpoint's quantisation block, else 128)",
    )
    speculative = Enum(["off", "ngram", "draft"], default_value="off").tag(
        label="Speculative decoding",
        headline=True,
        kind=LIVE,
        doc="speculative decoding proposer",
    )
    num_speculative_tokens = Int(4, min=1, max=16).tag(
        label="Draft tokens per step",
        kind=LIVE,
        doc="tokens proposed per step",
    )
    jump_forward = Bool(True).tag(
        label="Jump-forward (structured output)",
        kind=LIVE,
        doc="where a structured request's grammar forces the next text, propose its tokens and verify them in "
        "one step (the output is unchanged; fewer steps)",
    )
    ngram_size = Int(3, min=1, max=8).tag(
        label="n-gram length",
        kind=LIVE,
        doc="n-gram length matched by the ngram proposer",
    )
    draft_model = Unicode(None, allow_none=True).tag(
        label="Draft model",
        kind=RELOAD,
        doc="draft model for speculative=draft (None: the target's own int4 copy)",
    )
    attention_backend = Enum(["auto", "torch", "triton"], default_value="auto").tag(
        shapes_kv=True,
        label="Attention backend",
        kind=LIVE,
        doc="auto: Triton on CUDA; on a CPU our C attention kernel with cpu_kernels, else the torch reference",
    )
    prefill_attention = Enum(["auto", "kernel", "sdpa"], default_value="auto").tag(
        shapes_kv=True,
        label="Prefill attention",
        kind=LIVE,
        doc="the path of prompts on our attention backends: our kernel (Triton's, or the C one, on AMX where "
        "the CPU has it), or torch's SDPA (FlashAttention/cuDNN on CUDA, flash attention on a CPU; on CUDA for "
        "prompts with no cached context, on a CPU later chunks and prefix hits too); auto: the faster at this "
        "model's heads, measured once per process (on CUDA; always on the C backend), status() says which and "
        "the times; outputs equal within rounding",
    )
    moe_top_k = Int(None, allow_none=True, min=1, max=1024).tag(
        shapes_kv=True,
        label="Experts per token",
        kind=LIVE,
        doc="experts per token on mixture-of-experts models (None: the checkpoint's); changes outputs",
    )
    cpu_kernels = Bool(True).tag(
        shapes_kv=True,
        label="CPU kernels",
        kind=LIVE,
        doc="bf16 on a CPU: our C kernels (built for this CPU's instruction set) for decode GEMVs, "
        "attention and fused layer ops, large steps in the faster GEMM dtype (False: torch's ops only)",
    )
    cuda_graphs = Bool(False).tag(
        label="CUDA graphs",
        kind=LIVE,
        doc="on a CUDA device, replay decode steps as CUDA graphs captured per batch-size bucket (steps that "
        "do not fit run eagerly; status() says why); no effect elsewhere",
    )
    async_scheduling = Bool(False).tag(
        label="Async scheduling",
        kind=LIVE,
        doc="schedule and launch the next step before reading the last one's tokens, so the host's work "
        "overlaps the device's (a GPU stops idling between steps); outputs are unchanged. Steps with "
        "penalties, grammars, logprobs or speculation run synchronously",
    )
    dtype = Enum(["auto", "bfloat16", "float16", "float32"], default_value="auto").tag(
        label="Compute dtype",
        kind=RESTART,
        doc="compute dtype (auto: bfloat16)",
    )
    device = Unicode("auto").tag(label="Device", kind=RESTART, doc="auto, cpu, cuda, cuda:N")
    block_size = Int(16, min=1, max=256).tag(label="KV block size", kind=RESTART, doc="tokens per KV block")
    num_kv_blocks = Int(None, allow_none=True, min=1).tag(
        label="KV blocks",
        kind=RESTART,
        doc="KV cache capacity in blocks (None: from kv_cache_memory_mb)",
    )
    kv_cache_memory_mb = Int(None, allow_none=True, min=1).tag(
        label="KV cache memory (MB)",
        kind=RESTART,
        doc="KV cache budget when num_kv_blocks is None (None: 512 on a CPU; on CUDA 40% of the memory "
        "free once the weights are loaded)",
    )
    host_memory_mb = Int(None, allow_none=True, min=1).tag(
        label="Host memory (MB)",
        kind=RESTART,
        doc="on a CPU, the most the engine may hold in memory: weights, the kernels' copies of them, KV cache "
        "and draft (status()['memory_mb']); None: what the machine (or its cgroup) has available, less a "
        "reserve. A model or quantisation that does not fit is refused; a kernel's copy that does not fit is "
        "not made, and that layer multiplies from the weights as they are",
    )
    max_model_len = Int(None, allow_none=True, min=1).tag(
        label="Max context length",
        kind=RESTART,
        doc="longest prompt+output (None: the model's context length)",
    )

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in setting_names()}


def setting_names() -> list[str]:
    return list(EngineSettings.class_trait_names())


# Settings whose change alters what status() says serves (kernels, attention and prefill paths):
# views that show it (the dashboard's kernels line, the lab panel's) read status again after one
STATUS_SETTINGS = frozenset({"cpu_kernels", "attention_backend", "prefill_attention", "kv_cache_dtype"})


def kv_shaping_settings() -> list[str]:
    """The settings that change the values a step writes into the KV cache."""
    return [name for name, trait in EngineSettings.class_traits().items() if trait.metadata.get("shapes_kv")]


def kv_salt(settings: EngineSettings) -> int:
    """A key of the settings that shape KV values; the prefix cache's hash chains start from it."""
    return hash(tuple((name, getattr(settings, name)) for name in kv_shaping_settings()))


def setting_kind(name: str) -> str:
    return EngineSettings.class_traits()[name].metadata["kind"]


def allowed_values(name: str) -> str:
    trait = EngineSettings.class_traits()[name]
    if isinstance(trait, Enum):
        return ", ".join(repr(v) for v in trait.values)
    if isinstance(trait, Bool):
        return "True, False"
    if isinstance(trait, Int):
        lo, hi = trait.min, trait.max
        rng = f"int >= {lo}" if hi is None else f"int in [{lo}, {hi}]"
        return rng + (" or None" if trait.allow_none else "")
    return "str" + (" or None" if trait.allow_none else "")


def schema() -> list[dict[str, Any]]:
    """Everything a front end needs to draw a control for each setting."""
    out = []
    defaults = EngineSettings()
    for name, trait in EngineSettings.class_traits().items():
        entry = {
            "name": name,
            "kind": trait.metadata["kind"],
            "help": trait.metadata.get("doc", ""),
            "default": getattr(defaults, name),
            "type": type(trait).__name__.lower(),
            "allow_none": bool(trait.allow_none),
            "label": trait.metadata["label"],  # for people; `name` is for code
            "headline": bool(trait.metadata.get("headline")),  # the serving ideas a front end shows first
        }
        if isinstance(trait, Enum):
            entry["values"] = list(trait.values)
        if isinstance(trait, Int):
            entry["min"], entry["max"] = trait.min, trait.max
        out.append(entry)
    return out


def validate(changes: dict[str, Any], current: EngineSettings | None = None) -> dict[str, Any]:
    """Check names and values without touching any live object; return the coerced changes.

    Raises ValueError (unknown name, bad value) or TypeError (wrong type), naming the setting and
    what it allows. Either all changes are valid or none is applied.
    """
    names = setting_names()
    scratch = EngineSettings(**(current.as_dict() if current is not None else {}))
    out = {}
    for name, value in changes.items():
        if name not in names:
            raise ValueError(f"unknown setting {name!r}; known settings: {', '.join(names)}")
        trait = EngineSettings.class_traits()[name]
        if isinstance(trait, (Int, Enum)) and isinstance(value, bool) and not isinstance(trait, Bool):
            raise TypeError(f"setting {name!r} got {value!r}; allowed: {allowed_values(name)}")
        if isinstance(trait, Bool) and not isinstance(value, bool):
            raise TypeError(f"setting {name!r} must be a bool, got {value!r}; allowed: True, False")
        try:
            setattr(scratch, name, value)
        except TraitError:
            exc = TypeError if _wrong_type(trait, value) else ValueError
            raise exc(f"invalid value {value!r} for setting {name!r}; allowed: {allowed_values(name)}") from None
        out[name] = getattr(scratch, name)
    return out


def _wrong_type(trait, value) -> bool:
    if value is None:
        return False
    if isinstance(trait, Int):
        return not isinstance(value, int)
    if isinstance(trait, Unicode):
        return not isinstance(value, str)
    if isinstance(trait, Enum):
        return not any(type(value) is type(v) for v in trait.values)
    return False


def parse_value(name: str, text: str) -> Any:
    """Turn the text of `%engine set name=value` or a CLI flag into a typed value."""
    if name not in setting_names():
        raise ValueError(f"unknown setting {name!r}; known settings: {', '.join(setting_names())}")
    trait = EngineSettings.class_traits()[name]
    low = text.strip().lower()
    if trait.allow_none and low in ("none", "null", ""):
        return None
    if isinstance(trait, Bool):
        if low in ("true", "1", "on", "yes"):
            return True
        if low in ("false", "0", "off", "no"):
            return False
        raise ValueError(f"invalid value {text!r} for setting {name!r}; allowed: True, False")
    if isinstance(trait, Enum) and any(isinstance(v, int) for v in trait.values) and low.isdigit():
        return int(low)
    if isinstance(trait, Int):
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"invalid value {text!r} for setting {name!r}; allowed: {allowed_values(name)}") from None
    return text.strip()


# -- command-line flags ---------------------------------------------------------------------------
def add_setting_flags(parser, title: str = "engine settings (same names as configure())") -> None:
    """One flag per setting on an argparse parser (`--max-num-seqs` and `--max_num_seqs`), with its
    help, kind, allowed values and default from the schema; read them back with `settings_from_flags`."""
    import argparse

    group = parser.add_argument_group(title)
    for entry in schema():
        name = entry["name"]
        flags = [f"--{name.replace('_', '-')}"] + ([f"--{name}"] if "_" in name else [])
        text = f"{entry['help']} [{entry['kind']}; {allowed_values(name)}; default {entry['default']!r}]"
        group.add_argument(
            *flags, dest=f"setting_{name}", default=argparse.SUPPRESS, metavar="VALUE", help=text.replace("%", "%%")
        )


def settings_from_flags(args, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """Typed, validated settings from the flags given (over `base`); raises ValueError/TypeError."""
    out = dict(base or {})
    for name in setting_names():
        text = getattr(args, f"setting_{name}", None)
        if text is not None:
            out[name] = parse_value(name, text)
    return validate(out)
