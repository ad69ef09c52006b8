"""What a router decides from (`RoutedEngine`'s policy side): each request's scores under a policy
(its prompt's length in the cheapest member's tokens, the classifier's probabilities over the
cheapest member's own prefill, a seeded draw), the member they pick, and how the thresholds and
the classifier are set: RouteLLM's quantile calibration, training on labelled prompts."""

from __future__ import annotations

import msgspec

from .policies import Classifier, calibrate_threshold, features, level, output_confidence


class Decisions:
    """A mixin over the router's members (`members`, `names`, cheapest first), its policy state
    (`policy`, `thresholds`, `member`, `how`, `classifier`, `_draw`) and its `_lock`."""

    def _prompt_ids(self, item) -> list[int]:
        """The prompt's token ids in the cheapest member's vocabulary (its tokenizer here, or its
        engine's: one token generated returns them)."""
        prompt, ids, params = item
        if ids is not None:
            return list(ids)
        cheap = self.members[self.names[0]]
        tok = getattr(cheap, "tokenizer", None)
        if tok is not None:
            return tok.encode(prompt)
        from ..sampling_params import SamplingParams

        [out] = cheap.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
        return list(out.prompt_token_ids)

    def prompt_features(self, item) -> list[float]:
        """The classifier's features of one request, from the cheapest member's own prefill."""
        ids = self._prompt_ids(item)
        lps = self.members[self.names[0]].score(ids) if len(ids) > 1 else []
        return features(ids, [x for x in lps if x is not None])

    def scores(self, item, policy: str | None = None) -> list[float]:
        """The policy's score at each boundary for one request (cascade: none before it runs)."""
        policy = policy or self.policy
        n = len(self.names) - 1
        if policy == "length":
            return [float(len(self._prompt_ids(item)))] * n
        if policy == "classifier":
            if self.classifier is None:
                raise ValueError("the classifier policy needs a classifier: call fit(prompts, labels) first")
            return self.classifier.probabilities(self.prompt_features(item))
        if policy == "random":
            return [self._draw()] * n
        return []

    def _level(self, policy: str, scores: list[float], thresholds: list[float]) -> int:
        if policy == "fixed":
            return self.names.index(self.member)
        return level(policy, scores, thresholds)

    # -- calibration and training ---------------------------------------------------------------
    def items(self, prompts, params=None) -> list[tuple]:
        """Prompts (texts or token-id lists) as requests: (prompt, ids, params)."""
        from ..sampling_params import normalize_batch

        if isinstance(prompts, str) or not prompts:
            raise TypeError("give a non-empty list of prompts (texts or token-id lists)")
        if all(isinstance(p, str) for p in prompts):
            return normalize_batch(list(prompts), params, None)
        return normalize_batch(None, params, [list(p) for p in prompts])

    def calibrate(self, prompts, large_share: float = 0.3, *, params=None) -> float:
        """Set and return the threshold that sends `large_share` of `prompts` past the cheapest
        member (RouteLLM's quantile method) under the current policy; every boundary gets it. A
        cascade runs the cheapest member on each prompt for its confidence (`params`: greedy, 32
        tokens by default)."""
        from ..sampling_params import SamplingParams

        policy = self.policy
        if policy == "cascade":
            sp = SamplingParams.coerce(params or SamplingParams(max_tokens=32, temperature=0.0))
            sp = msgspec.structs.replace(sp, logprobs=max(sp.logprobs or 0, 0))
            items = self.items(prompts, sp)
            cheap = self.members[self.names[0]]
            if items[0][1] is not None:
                outs = cheap.generate(prompt_token_ids=[ids for _, ids, _ in items], params=sp)
            else:
                outs = cheap.generate([p for p, _, _ in items], sp)
            scores = [output_confidence(o, self.how) for o in outs]
        else:
            scores = [s[0] for s in (self.scores(item, policy) for item in self.items(prompts)) if s] or []
        threshold = calibrate_threshold(policy, scores, large_share)
        with self._lock:
            self.thresholds = [threshold] * (len(self.names) - 1)
        return threshold

    def fit(self, prompts, labels: list[str]) -> Classifier:
        """Train the classifier policy: `labels[i]` names the cheapest member good enough for
        `prompts[i]`. Features come from the cheapest member's own prefill of each prompt."""
        rows = [self.prompt_features(item) for item in self.items(prompts)]
        self.classifier = Classifier.fit(rows, list(labels), self.names)
        return self.classifier

    def save_classifier(self, path) -> None:
        if self.classifier is None:
            raise ValueError("no classifier to save: fit(prompts, labels) first")
        self.classifier.save(path)

    def load_classifier(self, path) -> None:
        clf = Classifier.load(path)
        if clf.members != self.names:
            raise ValueError(f"{path} was trained for members {clf.members}, this router has {self.names}")
        self.classifier = clf
