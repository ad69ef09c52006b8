"""An engine client's requests in flight: each one's sink, whether its caller wants every chunk,
and the output processor that turns the engine's token ids into their chunks (text, stop
strings: `workbench.processing.output`, run here in the client, off the engine's step loop).
Callers add and drop requests; the client's IO thread hands in outputs, refusals and the engine's
death. The engine's tokenizer comes over the socket when a request first needs it, once per model
and process (`shipped_tokenizer`): a client that only watches never fetches it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from ..interface import deliver
from ..outputs import CoreOutput
from ..processing.output import OutputProcessor, Stop
from ..sampling_params import SamplingParams
from ..tokenizer import Tokenizer, TokenizerSpec
from .protocol import NewRequest

_tokenizers: dict[str, Tokenizer] = {}  # by digest: one per engine model in this process, whatever the clients
_tokenizers_lock = threading.Lock()


def shipped_tokenizer(digest: str | None, fetch: Callable[[], TokenizerSpec]) -> Tokenizer | None:
    """The engine's tokenizer named by `digest`, fetched (`fetch`: ~1.5 MB for SmolLM2, 0.1 s to
    build) only the first time this process meets it; None for a model without one."""
    if digest is None:
        return None
    with _tokenizers_lock:
        tok = _tokenizers.get(digest)
        if tok is None:
            tok = _tokenizers[digest] = Tokenizer.from_spec(fetch())
    return tok


class PendingRequests:
    def __init__(self):
        self._lock = threading.Lock()
        self._sinks: dict[str, Callable[[Any], None]] = {}
        self._quiet: set[str] = set()  # requests whose caller wants only the final chunk
        self.outputs = OutputProcessor(None)
        self._digest: str | None = None
        self._fetch: Callable[[], TokenizerSpec] | None = None
        self._have_tokenizer = True

    def expect_tokenizer(self, digest: str | None, fetch: Callable[[], TokenizerSpec]) -> None:
        """A (re)connected engine's tokenizer, by its digest; fetched when first needed."""
        with self._lock:
            self.outputs = OutputProcessor(None)
            self._digest, self._fetch, self._have_tokenizer = digest, fetch, digest is None

    def tokenizer(self) -> Tokenizer | None:
        if not self._have_tokenizer:
            tok = shipped_tokenizer(self._digest, self._fetch)  # an RPC: not under the lock the IO thread takes
            with self._lock:
                self.outputs.tokenizer, self._have_tokenizer = tok, True
        return self.outputs.tokenizer

    def add(self, reqs: list[NewRequest], sink: Callable[[Any], None], stream: bool) -> None:
        self.tokenizer()  # before the first request's outputs can arrive
        with self._lock:
            for r in reqs:
                self._sinks[r.request_id] = sink
                if not stream:
                    self._quiet.add(r.request_id)
                self.outputs.add(r.request_id, r.prompt, r.params or SamplingParams())

    def drop(self, rids: Iterable[str]) -> None:
        """Forget requests: nothing of theirs is delivered any more."""
        with self._lock:
            for rid in rids:
                self._forget(rid)

    def _forget(self, rid: str) -> Callable[[Any], None] | None:
        self._quiet.discard(rid)
        self.outputs.drop(rid)
        return self._sinks.pop(rid, None)

    def on_outputs(self, outs: list[CoreOutput], send_stop: Callable[[Stop], None]) -> None:
        """Deliver the chunks these outputs make; a stop string found goes to `send_stop` first
        (for the engine: the sooner it knows, the fewer steps it runs past the stop)."""
        ready = []
        with self._lock:
            chunks, stops = self.outputs.process(outs)
            for chunk in chunks:
                rid = chunk.request_id
                sink = self._sinks.get(rid)
                if sink is None or (chunk.finish_reason is None and rid in self._quiet):
                    continue
                if chunk.finish_reason is not None:
                    self._forget(rid)
                ready.append((sink, chunk))
        for stop in stops:
            send_stop(stop)
        for sink, chunk in ready:
            deliver(sink, chunk)

    def fail(self, rids: Iterable[str], error: Callable[[], BaseException]) -> None:
        """The engine refused these: each caller gets its own `error()`."""
        with self._lock:
            sinks = [self._forget(rid) for rid in rids]
        for sink in sinks:
            if sink is not None:
                deliver(sink, error())

    def fail_all(self, error: Callable[[], BaseException]) -> None:
        """The engine is gone: every caller waiting gets the error, once."""
        with self._lock:
            sinks, self._sinks = self._sinks, {}
            self._quiet.clear()
            self.outputs.requests.clear()
        for sink in set(sinks.values()):
            deliver(sink, error())
