"""How a router decides: scores, thresholds and the classifier, with no engine in sight.

Members are ordered cheapest first. Every policy turns a request into a score and compares it with
the threshold at each boundary between two neighbouring members:

- `length`: the prompt's token count; above the threshold goes past the cheaper member;
- `classifier`: the probability that the cheaper member is not good enough (`Classifier`, trained
  on labelled prompts with features from the cheapest member's own prefill); above goes past;
- `cascade`: the cheaper member's confidence in its own answer (mean or minimum token
  log-probability); below the threshold escalates to the next member, which answers again;
- `random`: a uniform draw; under the threshold (the share sent past) goes past: the baseline
  every router paper compares against;
- `fixed`: every request to one member (`router_member`, default the dearest).

`calibrate_threshold` is RouteLLM's quantile method: the threshold that sends an asked share of a
calibration set past the cheapest member.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

POLICIES = ("length", "classifier", "cascade", "random", "fixed")
CONFIDENCE = ("mean", "min")  # cascade: how token log-probabilities become one confidence
DEFAULT_THRESHOLDS = {"length": 64.0, "classifier": 0.5, "cascade": -1.0, "random": 0.5, "fixed": 0.0}


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"invalid value {policy!r} for setting 'router'; allowed: {', '.join(map(repr, POLICIES))}")
    return policy


def check_threshold(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"invalid value {value!r} for setting 'router_threshold'; allowed: a finite number")
    return float(value)


def escalates(policy: str, score: float, threshold: float) -> bool:
    """Whether a request with `score` goes past the cheaper member at a boundary."""
    if policy == "cascade":
        return score < threshold  # low confidence: ask the next member
    if policy == "random":
        return score < threshold  # a uniform draw under the share sent past
    return score > threshold  # length, classifier: longer / more likely too hard


def level(policy: str, scores: Sequence[float], thresholds: Sequence[float]) -> int:
    """The member a request goes to: past each boundary whose threshold its score escalates at."""
    at = 0
    while at < len(thresholds) and escalates(policy, scores[at], thresholds[at]):
        at += 1
    return at


def calibrate_threshold(policy: str, scores: Sequence[float], share: float) -> float:
    """The threshold sending round(share * n) of these scores past the cheapest member (RouteLLM's
    quantile method): exactly that many where the scores are distinct, the nearest count where ties
    straddle the cut (ties go together)."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"the share sent to the dearer member must be in [0, 1], got {share}")
    if policy == "random":
        return float(share)
    if policy == "fixed":
        raise ValueError("the fixed policy has no threshold to calibrate")
    if not scores:
        raise ValueError("calibration needs at least one prompt")
    k = round(share * len(scores))
    s = sorted(scores)
    if policy == "cascade":  # the k least confident escalate: threshold just above the k-th lowest
        if k == 0:
            return s[0] - 1.0
        if k == len(s):
            return s[-1] + 1.0
        return (s[k - 1] + s[k]) / 2 if s[k] > s[k - 1] else s[k - 1]
    # length / classifier: the k highest go past: threshold just below the k-th highest
    if k == 0:
        return s[-1] + 1.0
    if k == len(s):
        return s[0] - 1.0
    lo, hi = s[len(s) - k - 1], s[len(s) - k]
    return (lo + hi) / 2 if hi > lo else lo


def check_confidence(how: str) -> str:
    if how not in CONFIDENCE:
        raise ValueError(f"invalid value {how!r} for setting 'router_confidence'; allowed: 'mean', 'min'")
    return how


def confidence(logprobs: Sequence[float], how: str) -> float:
    """The cascade's confidence in an answer: its tokens' mean or minimum log-probability."""
    check_confidence(how)
    if not logprobs:
        return 0.0  # an empty answer is certain of nothing worse
    return min(logprobs) if how == "min" else sum(logprobs) / len(logprobs)


def output_confidence(out, how: str) -> float:
    """`confidence` of an answer (a RequestOutput asked with logprobs)."""
    return confidence([lp.logprob for lp in out.logprobs or ()], how)


class Draws:
    """The random policy's uniform draws: seeded, so a run can be repeated."""

    def __init__(self, seed: int = 0):
        self._rng = random.Random(seed)

    def __call__(self) -> float:
        return self._rng.random()


# -- the classifier ------------------------------------------------------------------------------
HASH_BUCKETS = 64  # hashed token-id counts: what the prompt is about, beyond its surprise


def features(token_ids: Sequence[int], logprobs: Sequence[float]) -> list[float]:
    """A prompt's features from the cheapest member's prefill: its length, how surprised the member
    was by it (mean, minimum, spread and tail share of its tokens' log-probabilities) and a hashed
    bag of its tokens."""
    lp = list(logprobs) or [0.0]
    mean = sum(lp) / len(lp)
    std = math.sqrt(sum((x - mean) ** 2 for x in lp) / len(lp))
    head = [math.log1p(len(token_ids)), mean, min(lp), std, sum(x < -5.0 for x in lp) / len(lp)]
    bag = [0.0] * HASH_BUCKETS
    for t in token_ids:
        bag[(t * 2654435761) % HASH_BUCKETS] += 1.0
    n = max(1, len(token_ids))
    return head + [b / n for b in bag]


@dataclass
class Classifier:
    """Logistic regressions, one per boundary between neighbouring members: P(the cheaper side of
    the boundary is not good enough | features). Saved as JSON (no pickle)."""

    members: list[str]
    weights: list[list[float]] = field(default_factory=list)  # per boundary: bias first
    mean: list[float] = field(default_factory=list)  # feature standardisation
    scale: list[float] = field(default_factory=list)

    @classmethod
    def fit(
        cls, rows: list[list[float]], labels: list[str], members: list[str], *, l2: float = 1e-2, steps: int = 500
    ) -> Classifier:
        if len(rows) != len(labels) or not rows:
            raise ValueError(f"fit needs one label per prompt, got {len(labels)} labels for {len(rows)} prompts")
        unknown = sorted({lab for lab in labels if lab not in members})
        if unknown:
            raise ValueError(f"labels name no member: {unknown}; members: {', '.join(members)}")
        import torch

        x = torch.tensor(rows, dtype=torch.float64)
        mean, scale = x.mean(0), x.std(0, unbiased=False).clamp(min=1e-6)
        x = torch.cat([torch.ones(len(rows), 1, dtype=torch.float64), (x - mean) / scale], 1)
        level = torch.tensor([members.index(lab) for lab in labels])
        weights = []
        for b in range(len(members) - 1):
            y = (level > b).double()
            w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
            opt = torch.optim.LBFGS([w], max_iter=steps, line_search_fn="strong_wolfe")

            def loss(w=w, y=y, opt=opt):
                opt.zero_grad()
                out = torch.nn.functional.binary_cross_entropy_with_logits(x @ w, y) + l2 * (w[1:] ** 2).sum()
                out.backward()
                return out

            opt.step(loss)
            weights.append(w.detach().tolist())
        return cls(list(members), weights, mean.tolist(), scale.tolist())

    def probabilities(self, row: list[float]) -> list[float]:
        """P(past the cheaper member) at each boundary."""
        z = [1.0] + [(v - m) / s for v, m, s in zip(row, self.mean, self.scale)]
        return [1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, sum(a * b for a, b in zip(w, z)))))) for w in self.weights]

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(
                {"kind": "workbench-router-classifier", "version": 1, "members": self.members, "weights": self.weights,
                 "mean": self.mean, "scale": self.scale},
                f,
            )  # fmt: skip

    @classmethod
    def load(cls, path: str | os.PathLike) -> Classifier:
        with open(path) as f:
            data = json.load(f)
        if data.get("kind") != "workbench-router-classifier":
            raise ValueError(f"{path} is not a router classifier saved by Router.save_classifier")
        return cls(data["members"], data["weights"], data["mean"], data["scale"])
