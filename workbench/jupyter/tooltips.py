"""The text of a step's tooltip, shared by the notebook views and mirrored by the lab panel's
reducer (extension/src/model.ts): where its time went, its MoE routing, its speculation, and the
step-time target that cut its prefill."""

from __future__ import annotations

from ..timeline import STEP_PARTS, imbalance


def spec_text(accepted: int, proposed: int, jumped: int) -> str:
    """A step's speculation (accepted/proposed drafts) and the tokens jump-forward kept (steps saved)."""
    parts = [f"{accepted}/{proposed}"] if proposed else []
    if jumped:
        parts.append(f"jump-forward {jumped} tok")
    return " · ".join(parts) or "-"


def bound_text(target_ms: float, predicted_ms: float) -> str:
    """What held a step's prefill back: "cut to the 400 ms step target (predicted 392 ms)"."""
    if not target_ms:
        return "-"
    return f"cut to the {target_ms:g} ms step target (predicted {predicted_ms:.0f} ms)"


def parts_text(parts: dict[str, float]) -> str:
    """Where a step's time went, biggest share first: "layers 5.2 ms (71%), lm_head 1.1 ms (15%), ..."."""
    known = [(name, parts[name]) for name in STEP_PARTS if parts.get(name)]
    total = sum(v for _, v in known)
    if not total:
        return "-"
    text = ", ".join(f"{name} {v:.1f} ms ({100 * v / total:.0f}%)" for name, v in sorted(known, key=lambda x: -x[1]))
    if "device_idle" in parts:  # CUDA: the GPU's wait for this step (async scheduling closes it)
        text += f"; the device idled {parts['device_idle']:.2f} ms before it"
    return text


def routing_text(expert_counts: list[list[int]], shown: int = 4) -> str:
    """A step's routing for its tooltip: per MoE layer, the busiest expert and the imbalance."""
    if not expert_counts:
        return "-"
    parts = []
    for i, counts in enumerate(expert_counts[:shown]):
        if sum(counts):
            top = max(range(len(counts)), key=counts.__getitem__)
            parts.append(f"L{i} e{top}:{counts[top]} ({imbalance(counts):.1f}x)")
    more = len(expert_counts) - shown
    return " · ".join(parts) + (f" +{more} layers" if more > 0 else "")
