"""Structured output: the grammar a request's output must match, compiled by XGrammar, and each
sequence's matcher, which masks the tokens its next step may choose.

- `Grammars` (one per engine) compiles a `StructuredOutput` once and keeps it (keyed by kind and
  text), off the step loop in an engine process: its tokenizer thread compiles what a submit
  names before the step loop adds the request (`LLMEngine.prepare`).
- `GrammarState` (one per constrained sequence) is fed each output token kept (`accept`, and
  `rollback` for tokens dropped after a stop), checks a token (`allows`), judges a verify window
  (`greedy_accept`; `mask_window` for sampled rows), proposes the continuation the grammar forces
  (`forced_tokens`: jump-forward), and says whether the output so far is complete.
- `sample` chooses a batch's tokens under their grammars, for every sampler: a sampled row's
  logits are masked (a token the grammar forbids gets -inf) before penalties and the draw; a
  greedy row is masked only where the model's own choice breaks its grammar (wherever the grammar
  takes the argmax, it is the masked argmax too), then chosen again. Greedy verify windows do the
  same position by position (`GrammarState.greedy_accept`).

XGrammar is imported on the first constrained request (its import costs ~1.6 s).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..sampling_params import StructuredOutput

CACHE_ENTRIES = 256  # compiled grammars kept (a JSON schema's is tens of KB)
JUMP_MAX_TOKENS = 32  # forced tokens proposed in one step (a long literal takes a few steps)
_WHERE = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # XGrammar's "[time] file.cc:line: " before a message


@dataclass
class Compiled:
    grammar: object  # xgrammar.CompiledGrammar
    kind: str
    ms: float  # how long it took to compile
    uses: int = 0  # requests that used it (the first says "compiled" on the timeline, the rest "cached")


class Grammars:
    """Compiled grammars for one tokenizer, cached; thread-safe (the tokenizer thread compiles,
    the step loop reads)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids or ())
        self._compiler = None
        self._lock = threading.Lock()  # the cache (held for a lookup, never across a compile)
        self._compile_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Compiled] = OrderedDict()

    def _xgr_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import PreTrainedTokenizerFast

            if self.tokenizer is None:
                raise ValueError("structured output needs the model's tokenizer; this model has none")
            fast = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
            info = xgr.TokenizerInfo.from_huggingface(fast, vocab_size=self.vocab_size, stop_token_ids=self.eos_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def get(self, spec: StructuredOutput) -> Compiled:
        """The compiled grammar for `spec`, compiled now if it is new; an invalid schema, regex or
        grammar raises ValueError naming what is wrong."""
        key = (spec.kind, spec.text)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        with self._compile_lock:  # XGrammar releases the GIL while it compiles
            start = time.perf_counter()  # the first compile also loads XGrammar and reads the vocabulary
            compiler = self._xgr_compiler()
            try:
                grammar = _compile(compiler, spec)
            except (RuntimeError, ValueError, TypeError) as e:  # XGrammar's parse and conversion errors
                msg = _WHERE.sub("", str(e).strip())
                raise ValueError(f"structured.{spec.kind} is invalid: {msg}") from None
            entry = Compiled(grammar, spec.kind, (time.perf_counter() - start) * 1e3)
        with self._lock:
            self._cache[key] = entry
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return entry

    def cached(self, spec: StructuredOutput) -> bool:
        with self._lock:
            return (spec.kind, spec.text) in self._cache


def _compile(compiler, spec: StructuredOutput):
    if spec.json is not None:
        # compact JSON (", " and ": "): a free-whitespace grammar lets a small model emit newlines
        # until max_tokens, as vLLM's `disable-any-whitespace` and llama.cpp's grammars avoid
        return compiler.compile_json_schema(spec.text, any_whitespace=False, strict_mode=True)
    if spec.json_object:
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if spec.regex is not None:
        return compiler.compile_regex(spec.regex)
    if spec.grammar is not None:
        return compiler.compile_grammar(spec.grammar)
    if spec.structural_tag is not None:
        return compiler.compile_structural_tag(spec.text)
    # a JSON string literal is an EBNF literal in XGrammar's dialect
    return compiler.compile_grammar("root ::= " + " | ".join(_literal(c) for c in spec.choice))


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class GrammarState:
    """One sequence's place in its grammar: the matcher, fed every output token that is kept."""

    def __init__(self, compiled: Compiled, tokenizer):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled.grammar)
        self.tokenizer = tokenizer
        self.beyond = 0  # tokens kept past the grammar's end (a verify window's tail, dropped after)

    def accept(self, tokens: list[int]) -> None:
        for tok in tokens:
            if self.beyond or self.matcher.is_terminated() or not self.matcher.accept_token(tok):
                self.beyond += 1

    def rollback(self, count: int) -> None:
        """Forget the last `count` tokens (dropped after a stop inside a verify window)."""
        extra = min(count, self.beyond)
        self.beyond -= extra
        if count - extra:
            self.matcher.rollback(count - extra)

    @property
    def complete(self) -> bool:
        """The output so far matches the whole grammar."""
        return not self.beyond and (self.matcher.is_terminated() or self.matcher.is_completed())

    def allows(self, token: int) -> bool:
        """Whether the grammar takes `token` next (accepted, then undone: no mask is filled)."""
        if self.beyond:
            return True
        if self.matcher.accept_token(token):
            self.matcher.rollback(1)
            return True
        return False

    def forced_tokens(self, most: int) -> list[int]:
        """The tokens of the text the grammar forces next (jump-forward), at most `most`."""
        if self.beyond or self.matcher.is_terminated():
            return []
        text = self.matcher.find_jump_forward_string()
        if not text:
            return []
        return self.tokenizer.encode(text, add_special_tokens=False)[:most]

    def greedy_accept(self, logits: torch.Tensor, draft: list[int]) -> list[int]:
        """Greedy verification of `draft` against a verify row's logits [len(draft)+1, V] under the
        grammar: the drafts kept and one more token, as `speculative.accept` finds them on masked
        logits. A position is masked only where the grammar refuses its argmax."""
        top = logits.max(-1).indices.tolist()  # max: argmax's first maximum, faster on a CPU (sampler.py)
        out, fed = [], 0
        for i in range(len(draft) + 1):
            pick = top[i]
            if not self.allows(pick):
                row = logits[i : i + 1].clone()
                apply_masks(row, {0: self})  # the matcher stands after the drafts before position i
                pick = int(row.argmax())
            out.append(pick)
            if i == len(draft) or pick != draft[i] or not self.matcher.accept_token(draft[i]):
                break
            fed += 1
        if fed:
            self.matcher.rollback(fed)
        return out

    def mask_window(self, logits: torch.Tensor, draft: list[int]) -> torch.Tensor:
        """Masked copy of a verify row's logits [len(draft)+1, V]: position i under the grammar after
        the drafts before it (past a draft the grammar refuses, that position's mask is repeated:
        no draft there can be accepted)."""
        import xgrammar as xgr

        rows = logits.shape[0]
        bitmask = xgr.allocate_token_bitmask(rows, logits.shape[-1])
        fed = 0
        for i in range(rows):
            if i > 0 and fed == i - 1 and self.matcher.accept_token(draft[i - 1]):
                fed = i
            if fed == i:
                self.matcher.fill_next_token_bitmask(bitmask, i)
            else:
                bitmask[i] = bitmask[fed]
        if fed:
            self.matcher.rollback(fed)
        out = logits.clone()
        xgr.apply_token_bitmask_inplace(out, bitmask)
        return out


_BATCH = None


def sample(logits: torch.Tensor, seqs, choose) -> list[int]:
    """One token per row of `logits` (in place: sampled rows get their masks), each constrained
    row's under its grammar; `choose(logits, seqs)` is the sampler."""
    rows = {r: s.grammar for r, s in enumerate(seqs) if s.grammar is not None}
    sampled = {r: g for r, g in rows.items() if not seqs[r].params.greedy}
    if sampled:
        apply_masks(logits, sampled)
    tokens = choose(logits, seqs)
    redo = [r for r, g in rows.items() if seqs[r].params.greedy and not g.allows(tokens[r])]
    if redo:
        sub = logits[redo]  # a copy: the rows chosen again under their masks
        apply_masks(sub, {i: rows[r] for i, r in enumerate(redo)})
        for r, tok in zip(redo, choose(sub, [seqs[r] for r in redo])):
            tokens[r] = tok
    return tokens


def apply_masks(logits: torch.Tensor, states: dict[int, GrammarState]) -> None:
    """In place: each row of `logits` named in `states` keeps only the tokens its grammar allows
    next (the others are left as they are)."""
    global _BATCH
    import xgrammar as xgr

    if _BATCH is None:
        _BATCH = xgr.BatchGrammarMatcher(max_threads="auto")
    rows = [r for r, s in states.items() if not s.beyond]  # past the grammar's end: never sampled from
    if not rows:
        return
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])  # all allowed
    _BATCH.batch_fill_next_token_bitmask([states[r].matcher for r in rows], bitmask, indices=rows)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
