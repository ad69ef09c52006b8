"""Tokenizer: a thin wrapper over a Hugging Face `tokenizers.Tokenizer` plus the chat template.

`Tokenizer` loads `tokenizer.json` (and `tokenizer_config.json` / `chat_template.jinja` when
present), encodes and decodes, and renders the model's chat template with a sandboxed jinja2
environment the way transformers does.

`IncrementalDetokenizer` turns a stream of generated ids into text deltas. It decodes only a
small window of recent ids (prefix offset .. end) per step, so the cost per token is O(1), and it
holds text back while the window's decoded tail is an incomplete UTF-8 character (U+FFFD).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
import tokenizers

__all__ = ["Tokenizer", "TokenizerSpec", "IncrementalDetokenizer", "ChatTemplateError"]

_REPLACEMENT = "\ufffd"
_UNKNOWN = object()

# Normalizers that never shorten the text, and those that shorten it at most 4-fold (canonical
# composition: no precomposed character decomposes into more than 4 code points).
_KEEPS_LENGTH = {"NFD", "NFKD", "Prepend", "Lowercase", "ByteLevel"}
_COMPOSES = {"NFC", "NFKC"}
# Pre-tokenizers that drop characters (whitespace, delimiters) or may (a "removed" behaviour).
_DROPS = {"Whitespace", "WhitespaceSplit", "BertPreTokenizer", "CharDelimiterSplit"}


def _shrink_factor(normalizer: dict | None) -> int | None:
    """How many times shorter the normalizer can make a text (None: without bound)."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers", []):
            f = _shrink_factor(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in _KEEPS_LENGTH:
        return 1
    if kind in _COMPOSES:
        return 4
    if kind == "Replace":  # a fixed string replaced by one at least as long keeps the length
        pattern, content = normalizer.get("pattern", {}).get("String"), normalizer.get("content", "")
        return 1 if pattern is not None and len(content) >= len(pattern) else None
    return None


def _drops_text(pre: dict | None) -> bool:
    if pre is None:
        return False
    if pre.get("type") == "Sequence":
        return any(_drops_text(p) for p in pre.get("pretokenizers", []))
    return pre.get("type") in _DROPS or str(pre.get("behavior", "")).lower() == "removed"


def _max_token_chars(spec: dict) -> int | None:
    """`Tokenizer.max_token_chars` from the tokenizer.json document."""
    model = spec.get("model") or {}
    # WordPiece spells an over-long word as one [UNK]; others have per-character fallbacks.
    if model.get("type") not in ("BPE", "Unigram") or _drops_text(spec.get("pre_tokenizer")):
        return None
    factor = _shrink_factor(spec.get("normalizer"))
    if factor is None:
        return None
    vocab = model.get("vocab") or {}
    # A vocabulary entry is at least as long as the text it matches: byte-level BPE spells one
    # byte per symbol, byte-fallback tokens (<0x41>) are longer than their byte.
    pieces = vocab.keys() if isinstance(vocab, dict) else (entry[0] for entry in vocab)
    longest = max((len(p) for p in pieces), default=1)
    longest = max([longest] + [len(t.get("content", "")) for t in spec.get("added_tokens") or []])
    return longest * factor


def lower_thread_priority(niceness: int = 10) -> None:
    """Make the calling thread yield the CPU to the step loop's threads (Linux: a thread is a
    task with its own nice value). A thread that tokenizes beside the engine calls this, so a
    long prompt slows its own admission, not the decode steps of everyone else."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
        except OSError:
            pass


def too_long_message(why: str, max_tokens: int) -> str:
    """Why a prompt is refused for its length, in the words every path uses (the tokenizer, the
    engine, the engine process's transport)."""
    return f"{why}; the model's context is {max_tokens} tokens (prompt plus at least one output token must fit)"


def _too_long(why: str, max_tokens: int) -> ValueError:
    return ValueError(too_long_message(why, max_tokens))


def _word_boundary(text: str, before: int) -> int:
    """The last index < `before` where a space follows a non-space character (0: none near).

    No pre-tokenizer that `max_token_chars` trusts (byte-level and Llama-style regexes,
    Metaspace, digit splits) lets a piece run across such a point: a word piece stops at the
    space, a whitespace piece starts there. So the tokens of text[:cut] are exactly the first
    tokens of text, and their count is a lower bound on the whole."""
    i = before
    for _ in range(64):
        i = text.rfind(" ", before // 2, i)
        if i <= 0:
            return 0
        if not text[i - 1].isspace():
            return i
    return 0


class ChatTemplateError(ValueError):
    """Raised by a chat template through `raise_exception(...)`."""


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or a serialised AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return value.get("content")
    return str(value)


class TokenizerSpec(msgspec.Struct, array_like=True):
    """A tokenizer as data: tokenizer.json's text and what `Tokenizer` adds to it."""

    tokenizer_json: str
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: list[int]
    bos_token_id: int | None


class Tokenizer:
    """Encode/decode text and render chat prompts for one model.

    Parameters
    ----------
    tokenizer:
        the `tokenizers.Tokenizer` (from tokenizer.json).
    chat_template:
        the model's jinja2 chat template, or None.
    bos_token, eos_token:
        the special token strings given to the template (and used to find their ids).
    eos_token_ids:
        extra end-of-sequence ids (e.g. from config.json / generation_config.json); the id of
        `eos_token` is always included, first.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Iterable[int] | None = None,
        bos_token_id: int | None = None,
    ):
        self._tk = tokenizer
        self._max_token_chars: Any = _UNKNOWN
        self.chat_template = chat_template or None
        self.bos_token = bos_token
        self.eos_token = eos_token
        if bos_token_id is None and bos_token is not None:
            bos_token_id = tokenizer.token_to_id(bos_token)
        self.bos_token_id: int | None = bos_token_id
        if self.bos_token is None and bos_token_id is not None:
            self.bos_token = tokenizer.id_to_token(bos_token_id)
        ids: list[int] = []
        if eos_token is not None and tokenizer.token_to_id(eos_token) is not None:
            ids.append(tokenizer.token_to_id(eos_token))
        for i in eos_token_ids or ():
            if int(i) not in ids:
                ids.append(int(i))
        self.eos_token_ids: list[int] = ids
        if self.eos_token is None and ids:
            self.eos_token = tokenizer.id_to_token(ids[0])
        self._template = None  # compiled lazily

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dir(cls, path: str | os.PathLike, eos_token_ids: Iterable[int] | None = None) -> Tokenizer:
        """Load tokenizer.json (+ tokenizer_config.json, chat_template.jinja) from a model folder."""
        path = Path(path)
        tk_file = path / "tokenizer.json"
        if not tk_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        tk = tokenizers.Tokenizer.from_file(str(tk_file))
        cfg: dict[str, Any] = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        return cls(
            tk,
            chat_template=template,
            bos_token=_token_content(cfg.get("bos_token")),
            eos_token=_token_content(cfg.get("eos_token")),
            eos_token_ids=eos_token_ids,
        )

    # ------------------------------------------------------------------ basics
    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tk

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # The batch entry point releases the GIL while it works (`encode` holds it: a 4 MiB
        # prompt froze every other thread of the process for over a second); `_fast` skips
        # the character offsets, which nothing here reads.
        batch = getattr(self._tk, "encode_batch_fast", self._tk.encode_batch)
        return batch([text], add_special_tokens=add_special_tokens)[0].ids

    @property
    def max_token_chars(self) -> int | None:
        """Most characters of input one token can stand for, when that is provable from the
        tokenizer's definition (None when a normalizer or pre-tokenizer may drop text, or the
        model splits words it cannot spell into one unknown token)."""
        if self._max_token_chars is _UNKNOWN:
            self._max_token_chars = _max_token_chars(json.loads(self._tk.to_str()))
        return self._max_token_chars

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), found without encoding it (0 when unknown)."""
        most = self.max_token_chars
        return -(-len(text) // most) if most else 0

    def check_fits(self, text: str, max_tokens: int, what: str = "prompt") -> None:
        """Refuse, before tokenizing, a text that cannot encode to fewer than `max_tokens` tokens."""
        least = self.min_tokens(text)
        if least >= max_tokens:
            raise _too_long(
                f"{what} has {len(text):,} characters, so at least {least:,} tokens (no token of this "
                f"model spans more than {self.max_token_chars} characters)",
                max_tokens,
            )

    def encode_within(
        self, text: str, max_tokens: int, add_special_tokens: bool = False, what: str = "prompt"
    ) -> list[int]:
        """`encode(text)`, refusing (ValueError) a text that cannot encode to fewer than
        `max_tokens` tokens: from its length alone, then from the tokens of a prefix, so a text
        just under the length bound costs a small part of its full encoding."""
        self.check_fits(text, max_tokens, what)
        # Prefixes of 2x and 8x the context in characters: the first settles dense text (digits are a
        # token each), the second about twice the context of ordinary text.
        for probe in (2 * max_tokens, 8 * max_tokens):
            if not self.max_token_chars or len(text) <= 2 * probe:
                break
            cut = _word_boundary(text, probe) or self._piece_boundary(text, probe)
            if cut:
                counted = len(self.encode(text[:cut], add_special_tokens))
                if counted >= max_tokens:
                    raise _too_long(
                        f"{what} has {len(text):,} characters and its first {cut:,} alone are {counted:,} tokens",
                        max_tokens,
                    )
        return self.encode(text, add_special_tokens)

    def _piece_boundary(self, text: str, before: int, window: int = 1024) -> int:
        """For text with no word boundary (a run of digits, of letters without spaces): the start of
        a pre-tokenizer piece shortly before `before`, 0 when none is found. The pre-tokenizers
        `max_token_chars` trusts match locally (a regex, digit or whitespace split re-finds the
        whole text's pieces a few characters into any window), so a piece start that is neither of
        the window's first two is one of the whole text's, and tokens never cross it. Only without
        a normalizer: offsets then count the text's own characters."""
        pre = self._tk.pre_tokenizer
        if pre is None or self._tk.normalizer is not None:
            return 0
        start = max(0, before - window)
        pieces = pre.pre_tokenize_str(text[start:before])
        return start + pieces[-1][1][0] if len(pieces) >= 3 else 0

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, path: str | os.PathLike) -> None:
        """Write tokenizer.json and tokenizer_config.json into folder `path`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._tk.save(str(path / "tokenizer.json"))
        cfg: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
        }
        if self.bos_token is not None:
            cfg["bos_token"] = self.bos_token
        if self.eos_token is not None:
            cfg["eos_token"] = self.eos_token
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False), encoding="utf-8")

    def to_spec(self) -> TokenizerSpec:
        """Everything another process needs to rebuild this tokenizer (an engine client's output
        processor, maybe on another host)."""
        return TokenizerSpec(
            self._tk.to_str(), self.chat_template, self.bos_token, self.eos_token, self.eos_token_ids, self.bos_token_id
        )

    @classmethod
    def from_spec(cls, spec: TokenizerSpec) -> Tokenizer:
        tk = tokenizers.Tokenizer.from_str(spec.tokenizer_json)
        return cls(tk, spec.chat_template, spec.bos_token, spec.eos_token, spec.eos_token_ids, spec.bos_token_id)

    # ------------------------------------------------------------------ chat
    def _compiled_template(self):
        if self._template is None:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise ChatTemplateError(message)

            def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
                return json.dumps(
                    x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
                )

            def strftime_now(fmt):
                return datetime.now().strftime(fmt)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = strftime_now
            self._template = env.from_string(self.chat_template)
        return self._template

    def apply_chat_template(
        self, messages: list[dict[str, Any]] | str, add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render the model's chat template to a prompt string.

        `messages` is a list of {"role": ..., "content": ...} dicts; a plain string is one user
        message. Extra keyword arguments are passed to the template (e.g. tools=...).
        """
        if self.chat_template is None:
            raise ValueError("the model has no chat template; pass a plain prompt string instead")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return self._compiled_template().render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
            f"eos_token_ids={self.eos_token_ids}, chat_template={'yes' if self.chat_template else 'no'})"
        )


class IncrementalDetokenizer:
    """Turn generated ids into text deltas, one step at a time.

    The concatenation of everything `add` (and `flush`) returns equals
    `tokenizer.decode(generated_ids, skip_special_tokens)`, and no delta ends in a partial UTF-8
    character. With `prompt_ids`, the last few prompt ids seed the window so that the first
    generated token is decoded in context (leading spaces etc.), but no prompt text is emitted.

    Each step decodes only ids[prefix_offset:], a window that restarts at every emission, so the
    cost per token does not grow with the length of the output.
    """

    _CONTEXT = 5  # prompt ids kept as left context

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        ctx = list(prompt_ids[-self._CONTEXT :]) if prompt_ids else []
        self._ids: list[int] = ctx  # window: only ids from prefix_offset on are kept
        self.prefix_offset = 0  # start of the window's left context, relative to self._ids
        self.read_offset = len(ctx)  # ids before this have been emitted as text
        self.text = ""  # all text emitted so far
        self.num_ids = 0  # generated ids seen

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: int | Iterable[int]) -> str:
        """Append generated ids; return the new text they complete (possibly "")."""
        if isinstance(new_ids, int):
            new_ids = [new_ids]
        new_ids = list(new_ids)
        if not new_ids:
            return ""
        self.num_ids += len(new_ids)
        self._ids.extend(new_ids)
        prefix_text = self._decode(self._ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self._ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT):
            delta = full_text[len(prefix_text) :]
            # Slide the window: the newly emitted ids become the next step's left context.
            del self._ids[: self.read_offset]
            self.prefix_offset, self.read_offset = 0, len(self._ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of a sequence: emit whatever was held back (even a trailing U+FFFD)."""
        prefix_text = self._decode(self._ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self._ids[self.prefix_offset :])
        delta = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        del self._ids[: self.read_offset]
        self._ids = self._ids[-self._CONTEXT :]
        self.prefix_offset, self.read_offset = 0, len(self._ids)
        self.text += delta
        return delta
