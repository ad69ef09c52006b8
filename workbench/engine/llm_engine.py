"""The engine: requests in, a step at a time, new token ids out.

    sched = scheduler.schedule()          # who runs, how many tokens each
    result = runner.forward(sched)        # one flat forward over the paged cache
    outs = self._postprocess(sched, result, parts)   # sample; the scheduler advances each sequence
                                                # and its KV; the emitter stops (EOS, stop ids,
                                                # lengths) and finishes

That is the core (`core_add`, `core_step`, `core_abort`, `core_stop`): token ids in, `CoreOutput`s
(new ids) out. Text is the output processor's (`workbench.processing.output`), run by whoever
consumes the outputs: the engine client for an engine process (`workbench.ipc`), and this class's
`step` for in-process callers (`LLM`, tests), which processes each core step's outputs here.

The scheduler owns sequence and KV-block state (admit, preempt, advance, free); the engine
never edits blocks. `LLM` (in-process) and the engine process both drive this class from one
thread; `configure` must be called between steps.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import torch
from workbench_kernels import hostmem

from ..models.linear import LAYOUT_LOCK
from ..models.llama import WeightsByName
from ..models.loader import weights_checksum as checksum_of
from ..outputs import CoreOutput, RequestMetrics, StreamChunk
from ..processing.input import InputProcessor, ProcessedRequest
from ..processing.output import OutputProcessor
from ..reports import TOTALS, EngineMetrics, EngineStatus, as_dict, percentile
from ..sampling_params import SamplingParams
from ..settings import EngineSettings, kv_salt, validate
from ..timeline import TimelineRecorder, expert_totals, imbalance, prompt_label, step_breakdown
from . import inflight, live_settings, sampler, structured
from .device import Marks
from .emitter import Emitter, RequestState
from .hostload import HostSampler
from .loading import build_draft, host_memory, kv_cache_blocks, load_placed
from .model_runner import ModelRunner, memory_mb
from .response_cache import ResponseCache
from .scheduler import ScheduledSeq, Scheduler, SchedulerOutput, attention_context_of, time_context_of
from .sequence import SeqState, Sequence
from .speculative import DraftProposer, SpeculativeDecoder

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class LLMEngine:
    # What an engine process calls from a thread other than its step loop's (the calls thread):
    # it reads only the original weights, under the lock every re-layout of their bytes takes
    # (`LAYOUT_LOCK`: the tiles may hold them in place, `Linear.hold_once`). Everything else changes
    # under a step: tests/test_engine_loop_thread.py fails on any other use off the loop. (The
    # tokenizer thread uses `self.inputs`, an object of its own, never the engine.)
    THREAD_SAFE = frozenset({"weights_checksum"})

    def __init__(self, model: str | os.PathLike | None = None, **settings: Any):
        self.settings = EngineSettings(**validate(settings))
        s = self.settings
        self.device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if s.device == "auto" else s.device)
        self.dtype = DTYPES["bfloat16" if s.dtype == "auto" else s.dtype]
        self.memory = host_memory(self)  # what the engine may hold on a CPU, asked before it takes it
        loaded = load_placed(model, s, self.device, self.dtype, self.memory)
        self.model_name = loaded.config.name
        self.model_config = c = loaded.config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(s.max_model_len or c.max_position_embeddings, c.max_position_embeddings)
        weights = loaded.weights
        if self.device.type == "cpu":
            hostmem.keep_step_buffers()  # once an engine: a draft loaded inside own_mappings must not undo it
        num_blocks = kv_cache_blocks(s, c, self.device, self.dtype)
        self.runner = ModelRunner(
            c,
            weights,
            device=self.device,
            dtype=self.dtype,
            block_size=s.block_size,
            num_blocks=num_blocks,
            kv_cache_dtype=s.kv_cache_dtype,
            attention_backend=s.attention_backend,
            max_model_len=self.max_model_len,
            cpu_kernels=s.cpu_kernels,
            prefill_attention=s.prefill_attention,
            own_weights=True,
            memory=self.memory,
        )
        self._weights = WeightsByName(weights, self.runner.model)  # by name, whatever layout the layers hold
        self.runner.set_cuda_graphs(s.cuda_graphs, s.max_num_seqs)
        if s.moe_top_k is not None:
            live_settings.check_moe_top_k(s.moe_top_k, self.model_config, self.model_name)
            self.runner.model.set_moe_top_k(s.moe_top_k)
        if s.quantization != "none":
            live_settings.check_quantization(self, s.quantization)
            self.runner.model.quantize(s.quantization, s.quant_group_size)
        self.timeline = TimelineRecorder()
        self.host = HostSampler()
        self.scheduler = Scheduler(s, num_blocks, self.timeline)
        self.scheduler.attention_context = attention_context_of(c)
        self.scheduler.time_context = time_context_of(c)
        self.scheduler.set_kv_salt(kv_salt(s))
        self.event_hooks: list[Callable[[str, dict], None]] = []
        self.started = time.monotonic()
        self._seed_rng = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
        self.totals = dict.fromkeys(TOTALS, 0)
        self.emitter = Emitter(c.eos_token_ids, self.max_model_len, self.scheduler, self.timeline, self.totals)
        self.requests = self.emitter.requests  # request_id -> RequestState, while unfinished
        self.outputs = OutputProcessor(self.tokenizer)  # in-process callers' text (`step`)
        self.spec = SpeculativeDecoder(s, self.scheduler, self.max_model_len, self.load_draft, self.totals)
        self._weights_checksum = loaded.checksum  # the loader hashed these very tensors
        self.grammars = structured.Grammars(self.tokenizer, c.vocab_size, c.eos_token_ids)
        self.inputs = InputProcessor(self.tokenizer, self.max_model_len, c.vocab_size, self.grammars)
        self.response_cache = ResponseCache()
        # request_id -> its response-cache key and state, while it runs
        self._cache_keys: dict[str, tuple[tuple, RequestState]] = {}
        self._ready: list[CoreOutput] = []  # answers from the response cache, handed out at the next step
        self._inflight: inflight.InFlight | None = None  # a launched step's tokens on their way (async_scheduling)
        self._device_end = None  # where the device finished the last step (CUDA: an event; its idle gap)

    # -- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | None = None,
        params: SamplingParams | dict | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        chat: bool = False,
        request_id: str | None = None,
        arrival: float | None = None,
    ) -> str:
        """Process a request (`self.inputs`) and add it: what `LLM` and tests call."""
        processed = self.inputs.process(prompt, params, prompt_token_ids=prompt_token_ids, chat=chat)
        return self.add_processed(processed, request_id=request_id, arrival=arrival)

    def add_processed(
        self, req: ProcessedRequest, *, request_id: str | None = None, arrival: float | None = None
    ) -> str:
        """In-process: add to the core, and expect its outputs here (`step`)."""
        request_id = self.core_add(req, request_id=request_id, arrival=arrival)
        self.outputs.add(request_id, req.prompt, req.params)
        return request_id

    def core_add(self, req: ProcessedRequest, *, request_id: str | None = None, arrival: float | None = None) -> str:
        """Add a request the input processor checked whole; its ids are not read again here, only
        what the step loop's own state decides (the id is free, the KV cache can ever hold it)."""
        ids, params, prompt, grammar = req.prompt_token_ids, req.params, req.prompt, req.grammar
        request_id = request_id or uuid.uuid4().hex[:12]
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if len(ids) >= self.max_model_len:  # O(1), and what a step could not survive
            raise ValueError(self.inputs.too_long(len(ids)))
        need = self.scheduler.blocks_needed(min(len(ids) + params.max_tokens, self.max_model_len))
        if need is not None:
            raise ValueError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) needs {need} KV blocks; the "
                f"cache holds {self.scheduler.kv_blocks[1]} (raise num_kv_blocks or kv_cache_memory_mb)"
            )
        key = ResponseCache.key(ids, params, kv_salt(self.settings)) if self.settings.response_cache else None
        if key is not None:
            hit = self.response_cache.get(key)
            if hit is not None:
                return self._answer_from_cache(request_id, prompt, ids, hit, arrival)
        seq = Sequence(request_id, ids, params, arrival if arrival is not None else time.monotonic())
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._seed_rng))
        # on the CPU whatever the device: the sampler draws one uniform a row from it on the host (a CUDA
        # generator raised there), and a seed then gives the same uniforms on every device
        seq.generator = torch.Generator().manual_seed(seed)
        if grammar is not None:
            seq.grammar = structured.GrammarState(grammar, self.tokenizer)
        state = self.emitter.add(seq, keep_logprobs=key is not None)
        if key is not None:
            self._cache_keys[request_id] = (key, state)
        self.scheduler.add(seq)
        self.totals["prompt_tokens"] += len(ids)
        self.timeline.add_request(
            seq.metrics.arrival,
            request_id,
            "arrived",
            f"prompt_tokens={len(ids)}",
            label=self._prompt_label(prompt, ids),
        )
        if grammar is not None:
            grammar.uses += 1
            if grammar.uses == 1:  # compiled for this request (counted here, on the step loop's thread)
                self.totals["grammar_compiles"] += 1
            detail = f"compiled in {grammar.ms:.1f} ms"
            detail = detail if grammar.uses == 1 else f"cached ({detail})"
            self.timeline.add_request(seq.metrics.arrival, request_id, "grammar", f"{grammar.kind} {detail}")
        return request_id

    def _answer_from_cache(self, request_id: str, prompt, ids: list[int], hit: CoreOutput, arrival) -> str:
        """An exact repeat: the earlier answer's ids under this request's id, at the next step, no
        step run (the output processor turns them into text again, stop strings and all)."""
        assert hit.final is not None
        now = time.monotonic()
        start = arrival if arrival is not None else now
        final = msgspec.structs.replace(
            hit.final,
            metrics=RequestMetrics(arrival=start, first_scheduled=now, first_token=now, finished=now,
                                   token_times=[now] * len(hit.new_token_ids), prefix_hit_tokens=len(ids)),
            from_cache=True,
        )  # fmt: skip
        self.totals["response_cache_hits"] += 1
        self.timeline.add_request(start, request_id, "arrived", f"prompt_tokens={len(ids)}",
                                  label=self._prompt_label(prompt, ids))  # fmt: skip
        self.timeline.add_request(now, request_id, "finished", f"{hit.finish_reason} (response cache hit)")
        self.emitter.recent.append(final.metrics)
        self._ready.append(msgspec.structs.replace(hit, request_id=request_id, final=final))
        return request_id

    def _cache_answers(self, outs: list[CoreOutput]) -> None:
        """Keep the finished answers (their ids) of deterministic requests for their repeats."""
        for c in outs:
            if c.final is not None:
                entry = self._cache_keys.pop(c.request_id, None)
                if entry is not None and self.settings.response_cache:
                    key, state = entry
                    whole = CoreOutput(c.request_id, c.final.token_ids, c.finish_reason, state.logprobs, c.final)
                    self.response_cache.put(key, whole)

    def _prompt_label(self, prompt, ids: list[int]) -> str | None:
        if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):  # chat: the last message
            prompt = prompt[-1].get("content")
        if not isinstance(prompt, str) and self.tokenizer is not None:
            prompt = self.tokenizer.decode(ids[:16])
        return prompt_label(prompt if isinstance(prompt, str) else None)

    def abort_request(self, request_id: str) -> StreamChunk | None:
        """In-process: abort, and the request's last chunk (None for one not running)."""
        chunks = self._processed([out]) if (out := self.core_abort(request_id)) is not None else []
        return chunks[0] if chunks else None  # none: a request added to the core alone

    def core_abort(self, request_id: str) -> CoreOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._cache_keys.pop(request_id, None)
        return self.emitter.finish(req, "abort")

    def core_stop(self, request_id: str, keep: int) -> CoreOutput | None:
        """An output processor found a stop string in the first `keep` output tokens: finish the
        request there (tokens the core ran past it are dropped). None if it already finished."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        out = self.emitter.finish(req, "stop", keep=keep)
        if self._cache_keys:
            self._cache_answers([out])
        return out

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._ready) or self._inflight is not None

    def num_queued_tokens(self) -> int:
        """Prompt tokens of the requests waiting to start (what admission control bounds)."""
        return sum(len(seq) - seq.num_computed_tokens for seq in self.scheduler.waiting)

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list[StreamChunk]:
        """In-process: a core step and its outputs processed here; a stop string ends its request
        in the same step (no step wasted)."""
        return self._processed(self.core_step())

    def _processed(self, outs: list[CoreOutput]) -> list[StreamChunk]:
        chunks, stops = self.outputs.process(outs)
        for rid, keep in stops:
            out = self.core_stop(rid, keep)
            if out is not None:
                chunks += self.outputs.process([out])[0]
        return chunks

    def core_step(self) -> list[CoreOutput]:
        try:
            return self._core_step()
        except BaseException:
            self._inflight = None  # a failed step's tokens are not waited for (its requests end with it)
            raise

    def _core_step(self) -> list[CoreOutput]:
        outs, self._ready = self._ready, []
        s = self.settings
        if self._inflight is not None and not (self.requests and inflight.allowed(s)):
            outs += self._land()  # nothing to overlap it with, or settings that read its tokens on the host
        if not self.requests:
            return outs
        start = time.monotonic()
        marks = Marks(self.device, after=self._device_end)
        self._device_end = None
        proposed = self.spec.propose() if (s.speculative != "off" or s.jump_forward) and s.kv_cache else 0
        marks.host("draft")
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return outs + self._land()
        sched.spec_proposed = proposed
        marks.host("schedule")
        result = self.runner.forward(sched.scheduled, marks=marks, fill=self._inflight)
        if inflight.allowed(s) and inflight.overlappable(sched):
            # a MoE step's expert counts now: routing read them on the host already
            experts = self.runner.model.expert_counts()
            launched = inflight.launch(sched, result, marks, start, self.scheduler, experts)
            self.totals["overlapped_steps"] += 1
            self._device_end = marks.end_event
            outs += self._land()  # the step before, while the device runs this one
            self._inflight = launched
            if not self.requests:  # all finished as that step landed: this one's rows are dropped now
                outs += self._land()
            return outs
        if self._inflight is not None:
            outs += self._land()  # first: this step's sampling and outputs read its tokens
            marks.skip()
        step_outs, parts = self._postprocess(sched, result, marks)
        self._device_end = marks.end_event
        self._record_step(sched, start, time.monotonic(), step_outs, parts)
        if self._cache_keys:
            self._cache_answers(step_outs)
        return outs + step_outs

    def _land(self) -> list[CoreOutput]:
        """The step in flight's tokens, read (waiting for them) and emitted; its blocks registered.
        A request that finished meanwhile (its token before was EOS, an abort) drops its row."""
        f, self._inflight = self._inflight, None
        if f is None:
            return []
        tokens = f.landing.values()
        landed = time.monotonic()
        for s in f.sched.scheduled:
            if s.seq not in f.holes:
                self.scheduler.settle(s.seq)
        outs: list[CoreOutput] = []
        for seq, (position, row) in f.holes.items():
            req = self.requests.get(seq.request_id)
            if req is None or req.seq is not seq:
                continue
            self.scheduler.settle(seq, position, tokens[row])
            outs.append(self.emitter.emit(req, [tokens[row]], None, landed))
        parts = f.marks.parts()
        end = time.monotonic()
        parts["outputs"] = (end - landed) * 1e3
        self._record_step(f.sched, f.start, end, outs, parts, f.experts)
        if self._cache_keys:
            self._cache_answers(outs)
        return outs

    def _postprocess(self, sched: SchedulerOutput, result, marks: Marks) -> tuple[list[CoreOutput], dict]:
        """Sample, let the scheduler advance every sequence (tokens, KV), then emit outputs; and
        the step's parts. A request that finished as the step before landed drops its row."""
        now = time.monotonic()
        rows = result.rows
        alive = [s.seq.state is not SeqState.FINISHED for s in sched.scheduled]
        verified = [i for i, s in enumerate(sched.scheduled) if s.kind == "verify" and i in rows and alive[i]]
        sampled = [i for i, s in enumerate(sched.scheduled) if s.kind != "verify" and i in rows and alive[i]]
        tokens: list[int] = []
        lps = None
        mask = 0.0  # ms the grammar masks took
        if sampled:
            sampled_rows = [rows[i][0] for i in sampled]
            in_order = sampled_rows == list(range(result.logits.shape[0]))
            logits = result.logits if in_order else result.logits[sampled_rows]
            tokens, lps, mask = self._sample(logits, [sched.scheduled[i].seq for i in sampled])
        for i, (first, count) in result.prompt_rows.items():
            if alive[i]:
                self._score_prompt(sched.scheduled[i].seq, result.logits[first : first + count])
        marks.device("sample")  # after the tokens reached the host: from the LM head's end to here
        self.scheduler.update_from_output(sched, dict(zip(sampled, tokens)), set(verified))
        outs: list[CoreOutput] = []
        for i in verified:
            first, count = rows[i]
            outs.append(self._verify(sched.scheduled[i].seq, result.logits[first : first + count], sched, now))
        for j, (i, tok) in enumerate(zip(sampled, tokens)):
            req = self.requests[sched.scheduled[i].seq.request_id]
            outs.append(self.emitter.emit(req, [tok], None if lps is None else [lps[j]], now))
        marks.host("outputs")
        parts = marks.parts()
        # verify rows: their sampling counts here, their grammar masks as "mask"
        verify_masks, self.spec.mask_ms = self.spec.mask_ms, 0.0
        parts["sample"] -= mask
        parts["outputs"] -= verify_masks
        if mask or verify_masks:
            parts["mask"] = mask + verify_masks
        return outs, parts

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]):
        """Each row's next token, its logprobs where asked, and the ms grammar masks took (the
        step's "mask" part)."""
        want_lp = [seq.params.logprobs for seq in seqs]
        drawing = mask = 0.0

        def choose(rows: torch.Tensor, row_seqs: list[Sequence]) -> list[int]:
            nonlocal drawing
            start = time.monotonic()
            # before the tokens are appended: penalties read them
            out = sampler.sample(rows, row_seqs, self.emitter.eos_ids)
            drawing += time.monotonic() - start
            return out

        if any(seq.grammar is not None for seq in seqs):
            start = time.monotonic()
            # logprobs are the model's own (vLLM's default): masks go on a copy where any are asked for
            masked = logits.clone() if any(n is not None for n in want_lp) else logits
            tokens = structured.sample(masked, seqs, choose)
            mask = (time.monotonic() - start - drawing) * 1e3
        else:
            tokens = choose(logits, seqs)
        lps = sampler.logprobs_of(logits, tokens, want_lp) if any(n is not None for n in want_lp) else None
        return tokens, lps, mask

    def _score_prompt(self, seq: Sequence, logits: torch.Tensor) -> None:
        """A prefill chunk's prompt log-probabilities: position p's logits score prompt token p+1."""
        start = seq.num_computed_tokens  # before this step's tokens count as computed
        n = min(len(logits), len(seq.prompt_token_ids) - 1 - start)
        if n > 0:
            targets = seq.prompt_token_ids[start + 1 : start + 1 + n]
            lps = sampler.logprobs_of(logits[:n], targets, [seq.params.prompt_logprobs] * n)
            self.emitter.add_prompt_logprobs(self.requests[seq.request_id], start, lps)

    # -- speculative decoding ------------------------------------------------------------------
    def load_draft(self, draft_model: str | None) -> DraftProposer:
        """The draft for `speculative='draft'`: the named model, else this model in int4 (built in
        mappings of its own: it is dropped when speculation stops, and its memory goes back whole)."""
        with hostmem.own_mappings():
            return build_draft(self, draft_model)

    def _verify(self, seq: Sequence, logits: torch.Tensor, sched: SchedulerOutput, now: float) -> CoreOutput:
        tokens = self.spec.verify(seq, logits, sched)
        lps = None
        if seq.params.logprobs is not None:
            lps = sampler.logprobs_of(logits[: len(tokens)], tokens, [seq.params.logprobs] * len(tokens))
        return self.emitter.emit(self.requests[seq.request_id], tokens, lps, now)

    def _record_step(self, sched: SchedulerOutput, start: float, end: float, outs, parts, experts=None) -> None:
        """`experts`: the step's expert counts, read at its launch (default: the last forward's)."""
        self.totals["prefix_hit_tokens"] += sched.prefix_hit_tokens
        self.scheduler.record_step(
            sched,
            start,
            end,
            sum(len(c.new_token_ids) for c in outs),
            expert_counts=self.runner.model.expert_counts() if experts is None else experts,
            parts=parts,
        )

    # -- settings -------------------------------------------------------------------------------
    def configure(self, **changes: Any) -> dict[str, Any]:
        return self.apply_settings(changes, by=f"in-process (pid {os.getpid()})")

    def apply_settings(self, changes: dict[str, Any], by: str) -> dict[str, Any]:
        """Validate all changes, then apply them (between steps; `live_settings.apply`)."""
        return live_settings.apply(self, changes, by)

    def score(self, token_ids: list[int], chunk: int = 128) -> list[float]:
        """Log-probability of each token after the first, given those before it (for perplexity
        reports). Runs between steps on spare KV blocks; other requests are untouched."""
        ids = self.inputs.encode(None, token_ids, False)
        if len(ids) < 2:
            return []  # nothing comes after the first token
        if len(ids) > self.max_model_len:
            raise ValueError(f"{len(ids)} tokens exceed the context of {self.max_model_len}")
        seq = Sequence("__score__", ids, SamplingParams(max_tokens=1), time.monotonic())
        if not self.scheduler.reserve(seq, len(ids)):
            raise RuntimeError("not enough free KV blocks to score this text now")
        out: list[float] = []
        try:
            while seq.num_computed_tokens < len(ids):
                n = min(chunk, len(ids) - seq.num_computed_tokens)
                result = self.runner.forward([ScheduledSeq(seq, n, "prefill")], all_logits=True)
                lp = torch.log_softmax(result.logits, dim=-1)
                start = seq.num_computed_tokens
                targets = ids[start + 1 : start + n + 1]
                out.extend(lp[torch.arange(len(targets)), torch.tensor(targets)].tolist())
                self.scheduler.computed(seq, n)
        finally:
            self.scheduler.release(seq)
        return out

    def reset_prefix_cache(self) -> int:
        return self.scheduler.reset_prefix_cache()

    def emit_event(self, kind: str, payload: dict) -> None:
        """Tell the hooks (the engine process's event stream) what happened: settings, re-layouts."""
        for hook in list(self.event_hooks):
            hook(kind, payload)

    # -- introspection ----------------------------------------------------------------------------
    def weights_checksum(self) -> str:
        """Recomputed from the tensors in memory, so it proves serving left them untouched."""
        with LAYOUT_LOCK:  # no re-layout moves the bytes under it
            return checksum_of(self._weights)

    def status(self) -> dict[str, Any]:
        return as_dict(self.status_report())

    def status_report(self) -> EngineStatus:
        return EngineStatus(
            pid=os.getpid(),
            model=self.model_name,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            uptime_s=time.monotonic() - self.started,
            weights_checksum=self._weights_checksum,
            num_kv_blocks=self.scheduler.kv_blocks[1],
            block_size=self.settings.block_size,
            max_model_len=self.max_model_len,
            **self.runner.backend.report(),
            cpu_kernels=self.runner.model.cpu_kernels,
            **self.runner.model.kernel_report(),
            max_token_chars=self.tokenizer.max_token_chars if self.tokenizer is not None else None,
            num_layers=self.model_config.num_hidden_layers,
            vocab_size=self.model_config.vocab_size,
            **self.runner.graph_report(),
            memory_mb=memory_mb(self.runner, self.spec.draft),
            host_memory=None if self.memory is None else self.memory.report(self.runner.model.copies_skipped()),
        )

    def metrics(self, window_s: float = 10.0) -> dict[str, Any]:
        now = time.monotonic()
        recent_steps = [s for s in self.timeline.steps if s.end >= now - window_s]
        out_tokens = sum(s.output_tokens for s in recent_steps)
        span = (now - recent_steps[0].start) if recent_steps else 0.0
        ttft = [m.ttft for m in self.emitter.recent if m.ttft is not None]
        itl = [x for m in self.emitter.recent for x in m.itl]
        t = self.totals
        used, total = self.scheduler.kv_blocks
        load = expert_totals(st.expert_counts for st in recent_steps)
        per_layer = [imbalance(row) if sum(row) else None for row in load]
        worst = max((x for x in per_layer if x is not None), default=None)
        breakdown = step_breakdown(recent_steps)
        return as_dict(
            EngineMetrics(
                output_tok_s=out_tokens / span if span > 0 else 0.0,
                num_waiting=len(self.scheduler.waiting),
                num_running=len(self.scheduler.running),
                kv_blocks_used=used,
                kv_blocks_total=total,
                kv_usage=used / total,
                prefix_hit_rate=t["prefix_hit_tokens"] / t["prompt_tokens"] if t["prompt_tokens"] else 0.0,
                spec_acceptance_rate=t["spec_accepted"] / t["spec_proposed"] if t["spec_proposed"] else 0.0,
                spec_mean_accepted=t["spec_accepted"] / t["spec_verifies"] if t["spec_verifies"] else 0.0,
                window_s=window_s,
                recent_requests=len(self.emitter.recent),
                ttft_p50_ms=percentile(ttft, 50) * 1e3,
                ttft_p99_ms=percentile(ttft, 99) * 1e3,
                itl_p50_ms=percentile(itl, 50) * 1e3,
                itl_p99_ms=percentile(itl, 99) * 1e3,
                expert_load=load,
                moe_layer_imbalance=per_layer,
                moe_imbalance=worst,
                **self.host.sample(),
                step_parts_share=breakdown.get("parts_share", {}),
                step_limit=breakdown.get("limit"),
                device_busy_share=breakdown.get("device_busy_share"),
                **{f"total_{k}": v for k, v in t.items()},
                response_cache_entries=len(self.response_cache),
            )
        )
