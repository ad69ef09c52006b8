"""Which replica serves a request: the routing policies of a cluster (pure, no Ray).

- `round_robin`: each live replica in turn;
- `least_loaded`: the live replica with the fewest tokens still to compute, counted here from
  what each was sent and has answered: a request's prompt until its first token comes, then the
  output tokens it may still produce (fresh at every request, unlike a polled metric);
- `prefix_affinity`: a prompt whose start was routed before goes where that start went (its
  prefix cache holds it), matched at the longest of a few prefix lengths; a new prefix takes the
  least loaded replica and is remembered there. A replica loaded past twice the lightest's (plus
  a margin) is passed over, so one hot prefix cannot pile everything on one replica.

`Router.route(prompt_key, prompt_tokens, max_tokens)` picks; `started` / `progress` /
`finished` keep the load current; `stats()` says what each replica was given.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from dataclasses import dataclass, field

POLICIES = ("round_robin", "least_loaded", "prefix_affinity")
AFFINITY_LENGTHS = (512, 256, 128, 64, 32, 16)  # prefix lengths matched, longest first (tokens or characters)
AFFINITY_TABLE = 100_000  # prefixes remembered (oldest forgotten first)
OVERLOAD_MARGIN = 256  # tokens a preferred replica may exceed twice the lightest's load by


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"invalid router {policy!r}; allowed: {', '.join(POLICIES)}")
    return policy


def prefix_keys(prompt) -> list[str]:
    """Hashes of the prompt's leading AFFINITY_LENGTHS items (token ids or characters), longest
    first, each only where the prompt is longer (its last item is the one that must be computed)."""
    items = list(prompt) if not isinstance(prompt, str) else prompt
    keys = []
    for n in AFFINITY_LENGTHS:
        if len(items) > n:
            head = items[:n]
            data = head.encode() if isinstance(head, str) else b",".join(str(t).encode() for t in head)
            keys.append(f"{n}:{hashlib.blake2b(data, digest_size=12).hexdigest()}")
    return keys


@dataclass
class _Load:
    requests: int = 0  # in flight
    tokens: int = 0  # still to compute: prompts not started, outputs not produced
    served: int = 0  # sent since the start
    by_policy: dict[str, int] = field(default_factory=dict)


class Router:
    def __init__(self, replicas: list[str], policy: str = "least_loaded"):
        self.policy = check_policy(policy)
        self._lock = threading.Lock()
        self._load: dict[str, _Load] = {name: _Load() for name in replicas}
        self._alive: dict[str, bool] = dict.fromkeys(replicas, True)
        self._rr = itertools.count()
        self._affinity: dict[str, str] = {}  # prefix key -> replica (insertion order: oldest first)
        self._inflight: dict[str, tuple[str, int, int, bool]] = {}  # request -> (replica, prompt, left, started)

    # -- replicas -----------------------------------------------------------------------------
    def set_alive(self, name: str, alive: bool) -> None:
        with self._lock:
            self._alive[name] = alive
            self._load.setdefault(name, _Load())
            if not alive:
                self._affinity = {k: v for k, v in self._affinity.items() if v != name}

    def add(self, name: str) -> None:
        self.set_alive(name, True)

    def live(self) -> list[str]:
        return [n for n, ok in self._alive.items() if ok]

    # -- routing ------------------------------------------------------------------------------
    def route(
        self,
        prompt,
        prompt_tokens: int,
        max_tokens: int,
        *,
        exclude: set[str] = frozenset(),
        request_id: str | None = None,
    ) -> tuple[str, str]:
        """(replica, why) for a request; `exclude`: replicas not to use (a failed attempt's)."""
        with self._lock:
            live = [n for n in self.live() if n not in exclude]
            if not live:
                raise RuntimeError(
                    "no live replica to route to" + (f" (excluded: {', '.join(sorted(exclude))})" if exclude else "")
                )
            if self.policy == "round_robin":
                name, why = live[next(self._rr) % len(live)], "round_robin"
            elif self.policy == "least_loaded":
                name, why = self._lightest(live), "least_loaded"
            else:
                name, why = self._affine(prompt, live)
            load = self._load[name]
            load.requests += 1
            load.tokens += prompt_tokens + max_tokens
            load.served += 1
            load.by_policy[why] = load.by_policy.get(why, 0) + 1
            if request_id is not None:
                self._inflight[request_id] = (name, prompt_tokens, max_tokens, False)
            return name, why

    def lightest(self) -> str:
        """The least loaded live replica (for work the router does not track, e.g. scoring)."""
        with self._lock:
            live = self.live()
            if not live:
                raise RuntimeError("no live replica")
            return self._lightest(live)

    def _lightest(self, live: list[str]) -> str:
        return min(live, key=lambda n: (self._load[n].tokens, self._load[n].requests, n))

    def _affine(self, prompt, live: list[str]) -> tuple[str, str]:
        keys = prefix_keys(prompt) if prompt is not None else []
        lightest = self._lightest(live)
        for key in keys:
            owner = self._affinity.get(key)
            if owner in live:
                if self._load[owner].tokens <= 2 * self._load[lightest].tokens + OVERLOAD_MARGIN:
                    self._remember(keys, owner)
                    return owner, f"prefix_affinity (a {key.split(':')[0]}-long prefix seen there)"
                self._remember(keys, lightest)
                return lightest, "prefix_affinity (its prefix's replica is overloaded: the least loaded)"
        self._remember(keys, lightest)
        return lightest, "prefix_affinity (a new prefix: the least loaded)"

    def _remember(self, keys: list[str], name: str) -> None:
        for key in keys:
            self._affinity.pop(key, None)
            self._affinity[key] = name
        while len(self._affinity) > AFFINITY_TABLE:
            self._affinity.pop(next(iter(self._affinity)))

    # -- load bookkeeping ---------------------------------------------------------------------
    def progress(self, request_id: str, new_tokens: int) -> None:
        """`new_tokens` output tokens arrived: the prompt is computed, the output shrinks."""
        with self._lock:
            entry = self._inflight.get(request_id)
            if entry is None:
                return
            name, prompt, left, started = entry
            load = self._load[name]
            drop = (0 if started else prompt) + min(new_tokens, left)
            load.tokens = max(0, load.tokens - drop)
            self._inflight[request_id] = (name, prompt, left - min(new_tokens, left), True)

    def finished(self, request_id: str) -> None:
        with self._lock:
            entry = self._inflight.pop(request_id, None)
            if entry is None:
                return
            name, prompt, left, started = entry
            load = self._load[name]
            load.requests = max(0, load.requests - 1)
            load.tokens = max(0, load.tokens - left - (0 if started else prompt))

    def set_policy(self, policy: str) -> None:
        with self._lock:
            self.policy = check_policy(policy)

    def stats(self) -> dict[str, dict]:
        """Per replica: alive, requests in flight, tokens still to compute, requests sent, by reason."""
        with self._lock:
            return {
                n: {
                    "alive": self._alive.get(n, False),
                    "in_flight": ld.requests,
                    "queued_tokens": ld.tokens,
                    "served": ld.served,
                    "by_policy": dict(ld.by_policy),
                }
                for n, ld in self._load.items()
            }
