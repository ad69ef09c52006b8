"""Named accelerators for machines we do not have: memory bandwidth, dense bf16 peak, per-step
overhead, and the fraction of each a serving engine reaches; "cpu" is this host, measured.

Datasheet figures (dense bf16, no sparsity): H100 SXM 3.35 TB/s and 989 TFLOP/s, H200 4.8 TB/s
and 989, A100 80 GB SXM 2.04 TB/s and 312, L4 300 GB/s and 121. The achievable fractions (80% of
bandwidth, 60% of peak) and the per-step overhead (scheduling, sampling, launches: 0.5 ms on a
GPU) are assumptions, printed with every result; a fit from a real engine replaces them
(`Simulator.calibrate`). Watts are the boards' TDP; prices are typical on-demand cloud prices per
GPU-hour (assumptions too: pass `price_per_hour=` for yours); "cpu" uses `tuning.costs`' defaults.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

__all__ = ["PROFILES", "Profile", "cpu_profile", "get_profile"]


@dataclass(frozen=True)
class Profile:
    name: str
    bandwidth_gbs: float
    peak_tflops: float
    step_overhead_ms: float
    device: str = "cuda"  # what tuning.costs prices it as
    bandwidth_efficiency: float = 0.8
    compute_efficiency: float = 0.6
    source: str = "datasheet"
    price_per_hour: float | None = None  # None: tuning.costs' default for the device
    watts: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


PROFILES: dict[str, Profile] = {
    "h100": Profile("h100", 3350.0, 989.0, 0.5, price_per_hour=3.0, watts=700.0),
    "h200": Profile("h200", 4800.0, 989.0, 0.5, price_per_hour=3.8, watts=700.0),
    "a100": Profile("a100", 2039.0, 312.0, 0.5, price_per_hour=1.8, watts=400.0),
    "l4": Profile("l4", 300.0, 121.0, 0.5, price_per_hour=0.8, watts=72.0),
}


def cpu_profile(quick: bool = True) -> Profile:
    """This host, measured now: read bandwidth (bench.roofline) and the best batch-shaped matmul
    rate as the engine runs it (the fastest of oneDNN bf16, oneDNN fp32 and our tiles, as the
    engine's `gemm_path` picks: without native bf16 instructions oneDNN's bf16 runs ~10x slower
    than its fp32, which the engine takes there), the engine's typical per-step overhead on a CPU
    (2 ms) at full efficiency (they are measured)."""
    from ..bench.roofline import measure_bandwidth
    from ..models.cpu_forward import CpuKernelForward

    bw = max(measure_bandwidth(1 << 28 if quick else 1 << 30, repeats=3))
    flops = CpuKernelForward.gemm_rate(64, 576, 2304, budget_s=0.05 if quick else 0.25, dtype=None)
    return Profile(
        "cpu",
        bw,
        flops / 1e3,
        2.0,
        device="cpu",
        bandwidth_efficiency=1.0,
        compute_efficiency=1.0,
        source="measured on this host",
    )


def get_profile(profile: str | Profile) -> Profile:
    if isinstance(profile, Profile):
        return profile
    if not isinstance(profile, str):
        raise TypeError(f"profile must be a name or a Profile, got {type(profile).__name__}")
    key = profile.lower()
    if key == "cpu":
        return cpu_profile()
    if key not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; known: {', '.join([*PROFILES, 'cpu'])}")
    return replace(PROFILES[key])
