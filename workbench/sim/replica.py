"""One engine replica on simulated time (the engine's own `Scheduler`), and the event loops that
run replicas side by side: colocated behind a router, or prefill/decode disaggregated."""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

from ..cluster.router import POLICIES, Router
from ..engine.scheduler import Scheduler
from ..engine.sequence import Sequence
from ..engine.speculative import ready_for_drafts
from ..sampling_params import SamplingParams
from ..settings import EngineSettings
from ..timeline import TimelineRecorder
from .cost import StepShape

# The cluster's policies (workbench.cluster.router.Router, the very object a ClusterEngine routes
# with, run here on simulated time) and least_outstanding: the fewest prompt and output tokens of
# unfinished requests (a prompt counts until its request ends, unlike least_loaded's).
ROUTERS = (*POLICIES, "least_outstanding")
TOKEN = 0  # the id a simulated step "samples" (no model: only counts and lengths matter)


@dataclass
class Request:
    index: int
    prompt: list[int]
    max_tokens: int
    arrival: float
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None
    replica: int = -1
    preemptions: int = 0
    prefix_hit_tokens: int = 0


class Replica:
    def __init__(
        self,
        index: int,
        settings: EngineSettings,
        num_blocks: int,
        cost,
        *,
        decode_only: bool = False,
        timeline_capacity: int = 20_000,
        acceptance: float = 0.0,
        seed: int = 0,
        draft_cost=None,
        contexts: tuple[float | None, float | None] = (None, None),
    ):
        self.index = index
        self.decode_only = decode_only  # a decode replica of a disaggregated layout
        self.settings = settings
        self.acceptance = acceptance  # chance that each draft token is accepted (speculative decoding)
        self.rng = random.Random(seed + 7919 * index)
        self.t = 0.0
        self.cost = cost
        self.draft_cost = draft_cost  # a draft model's forward, per proposing round (None: free proposals)
        self.timeline = TimelineRecorder(timeline_capacity)
        self.scheduler = Scheduler(settings, num_blocks, self.timeline, clock=lambda: self.t)
        # the model's attention and time contexts, as the engine's scheduler has them
        self.scheduler.attention_context, self.scheduler.time_context = contexts
        self.requests: dict[str, Request] = {}
        self.outstanding = 0  # tokens still to compute over its unfinished requests (the router's load)
        self.router: Router | None = None  # told of each request's tokens and end, as a cluster's is
        self.busy_s = 0.0
        self.steps = 0
        self.kv_peak = 0.0

    @property
    def busy(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def add(
        self,
        req: Request,
        t: float,
        *,
        tokens: list[int] | None = None,
        max_tokens: int | None = None,
        kv_transferred: bool = False,
    ) -> None:
        if not self.busy:
            self.t = max(self.t, t)
        rid = str(req.index)
        ids = req.prompt if tokens is None else tokens
        seq = Sequence(rid, ids, SamplingParams(max_tokens=max_tokens or req.max_tokens, ignore_eos=True), t)
        need = self.scheduler.blocks_needed(len(ids) + seq.params.max_tokens)
        if need is not None:
            raise ValueError(
                f"request {req.index} needs {need} KV blocks ({len(ids)} prompt + {seq.params.max_tokens} "
                f"output tokens), more than the {self.scheduler.kv_blocks[1]} the cache has"
            )
        self.requests[rid] = req
        req.replica = self.index
        self.outstanding += len(ids) + seq.params.max_tokens
        self.timeline.add_request(t, rid, "arrived", f"prompt_tokens={len(ids)}")
        self.scheduler.add(seq, kv_arrived=kv_transferred)

    def _propose(self) -> tuple[int, float]:
        """Draft tokens for the decoding sequences, as the engine's proposer attaches them (their
        values do not matter here; how many are accepted is drawn at verify), and the seconds the
        draft model took: one batched forward per round, over the sequences still proposing."""
        s = self.settings
        if s.speculative == "off" or not s.kv_cache:
            return 0, 0.0
        ready = ready_for_drafts(self.scheduler, s.num_speculative_tokens, 1 << 30)  # no context bound here
        for seq, room in ready:
            self.scheduler.attach_drafts(seq, [TOKEN] * room)
        seconds = 0.0
        if self.draft_cost is not None:
            for r in range(max((room for _, room in ready), default=0)):
                active = [("decode", len(seq) + r, 1) for seq, room in ready if room > r]
                seconds += self.draft_cost(StepShape.of(active))
        return sum(room for _, room in ready), seconds

    def _verify(self, seq: Sequence) -> list[int]:
        """A verify's outcome: the leading draft tokens accepted (each with `acceptance`), plus one."""
        accepted = 0
        for _ in seq.spec_tokens:
            if self.rng.random() >= self.acceptance:
                break
            accepted += 1
        return [TOKEN] * (accepted + 1)

    def step(self) -> list[tuple[Request, Sequence]]:
        """One engine step at this replica's time; returns the requests it finished."""
        proposed, draft_s = self._propose()
        sched = self.scheduler.schedule()
        sched.spec_proposed = proposed
        if not sched.scheduled:
            raise RuntimeError(f"replica {self.index} cannot schedule its waiting requests (KV cache too small)")
        shape = StepShape.of([(s.kind, s.seq.num_computed_tokens, s.num_tokens) for s in sched.scheduled])
        start = self.t
        self.t = end = start + draft_s + self.cost(shape)
        self.busy_s += end - start
        self.steps += 1
        verified = {i for i, s in enumerate(sched.scheduled) if s.kind == "verify"}
        sampled = {
            i: TOKEN
            for i, s in enumerate(sched.scheduled)
            if i not in verified and s.seq.num_computed_tokens + s.num_tokens >= len(s.seq.token_ids)
        }  # `samples`
        self.scheduler.update_from_output(sched, sampled, verified)
        emitted: dict[int, int] = dict.fromkeys(sampled, 1)
        for i in verified:
            seq = sched.scheduled[i].seq
            tokens = self._verify(seq)
            sched.spec_accepted += len(tokens) - 1
            self.scheduler.update_after_verify(seq, len(seq), tokens)
            emitted[i] = len(tokens)
        done = []
        for i, n in emitted.items():
            seq = sched.scheduled[i].seq
            req = self.requests[seq.request_id]
            if not req.token_times:
                self.timeline.add_request(end, seq.request_id, "first_token")
            req.token_times.extend([end] * n)
            self.outstanding -= n
            if self.router is not None:
                self.router.progress(seq.request_id, n)
            if seq.num_output_tokens >= seq.params.max_tokens:
                done.append((req, seq))
        used, total = self.scheduler.kv_blocks
        self.kv_peak = max(self.kv_peak, used / total)
        self.scheduler.record_step(sched, start, end, sum(emitted.values()))
        for req, seq in done:
            req.preemptions += seq.metrics.num_preemptions
            req.prefix_hit_tokens += seq.metrics.prefix_hit_tokens
            self.outstanding -= len(seq.prompt_token_ids)
            self.scheduler.remove(seq)
            self.timeline.add_request(end, seq.request_id, "finished", "length")
            del self.requests[seq.request_id]
            if self.router is not None:
                self.router.finished(seq.request_id)
        return done


# -- the event loops ------------------------------------------------------------------------------------
def run_colocated(reqs: list[Request], replicas: list[Replica], router) -> None:
    arrivals = sorted(reqs, key=lambda r: (r.arrival, r.index))
    pick = pick_router(router, replicas)
    i, n = 0, len(arrivals)
    while True:
        busy = [r for r in replicas if r.busy]
        nxt = min(busy, key=lambda r: r.t) if busy else None
        if i < n and (nxt is None or arrivals[i].arrival <= nxt.t):
            req = arrivals[i]
            i += 1
            replicas[pick(req, replicas, i - 1)].add(req, req.arrival)
        elif nxt is not None:
            for req, _ in nxt.step():
                req.finished = req.token_times[-1]
        else:
            return


def disaggregated_pools(layout, settings, blocks, cost, replica) -> tuple[list[Replica], list[Replica]]:
    if (
        not isinstance(layout, (tuple, list))
        or len(layout) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in layout)
    ):
        raise ValueError(f"disaggregated must be (prefill replicas, decode replicas), each >= 1; got {layout!r}")
    p, d = layout
    prefill = [replica(i, settings, blocks, cost) for i in range(p)]
    decode = [replica(p + i, settings, blocks, cost, decode_only=True) for i in range(d)]
    return prefill, decode


def run_disaggregated(reqs, pools, router, cost, kv_gbs: float, kv_bytes_per_token: float) -> None:
    """Prefill replicas produce the first token; after the KV transfer the request decodes on a
    decode replica (which admits it with that KV in place)."""
    if not kv_gbs > 0:
        raise ValueError(f"kv_transfer_gbs must be > 0, got {kv_gbs!r}")
    prefill, decode = pools
    pick_p, pick_d = pick_router(router, prefill), pick_router("least_outstanding", decode)
    events: list[tuple[float, int, int, Request]] = [(r.arrival, 0, r.index, r) for r in reqs]  # (t, stage, ...)
    heapq.heapify(events)
    handed = 0
    while True:
        busy = [r for r in prefill + decode if r.busy]
        nxt = min(busy, key=lambda r: r.t) if busy else None
        if events and (nxt is None or events[0][0] <= nxt.t):
            t, stage, _, req = heapq.heappop(events)
            if stage == 0:
                prefill[pick_p(req, prefill, handed)].add(req, t, max_tokens=1)
                handed += 1
            else:
                decode[pick_d(req, decode, 0)].add(
                    req, t, tokens=req.prompt + [TOKEN], max_tokens=req.max_tokens - 1, kv_transferred=True
                )
        elif nxt is not None:
            for req, _seq in nxt.step():
                if nxt in prefill and req.max_tokens > 1:
                    transfer = len(req.prompt) * kv_bytes_per_token / (kv_gbs * 1e9)
                    heapq.heappush(events, (nxt.t + transfer, 1, req.index, req))
                else:
                    req.finished = req.token_times[-1]
        else:
            return


def pick_router(router, replicas: list[Replica]):
    """(request, replicas, arrival index) -> the replica's index. The cluster's policies are its
    own Router, told of every token and end by the replicas (so least_loaded and prefix_affinity
    decide on what a ClusterEngine's router would know)."""
    if callable(router):
        return lambda req, replicas, i: int(router(req, replicas))
    if router == "least_outstanding":
        return lambda req, replicas, i: min(range(len(replicas)), key=lambda k: (replicas[k].outstanding, k))
    shared = Router([str(r.index) for r in replicas], router)
    for r in replicas:
        r.router = shared
    by_name = {str(r.index): k for k, r in enumerate(replicas)}

    def routed(req, replicas, i):
        name, _ = shared.route(req.prompt, len(req.prompt), req.max_tokens, request_id=str(req.index))
        return by_name[name]

    return routed


def check_router(router) -> None:
    if not callable(router) and router not in ROUTERS:
        raise ValueError(
            f"router must be one of {', '.join(ROUTERS)} or a function (request, replicas) -> index; got {router!r}"
        )
