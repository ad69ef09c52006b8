"""The serving simulator: what-ifs past one machine, checked against the real engine.

- `simulator`: `Simulator` (calibrated from a live engine or from a named accelerator's
  roofline), `run` (replicas, routers, prefill/decode disaggregation, SLOs), `SimResult`;
- `replica`: one engine replica on simulated time and the event loops over replicas;
- `routes`: `route` (a workload split between models, e.g. short prompts to a small one);
- `workloads`: bench workloads, traces from a recorded timeline, the calibration runs;
- `cost`: step-cost models (`FittedCost` from recorded steps, `RooflineCost` from a profile);
- `profiles`: H100, H200, A100, L4 and "cpu" (this host, measured).
"""

from .cost import FittedCost, RooflineCost, StepShape
from .profiles import PROFILES, Profile
from .routes import RoutedResult, route
from .simulator import ROUTERS, SimResult, Simulator

__all__ = [
    "PROFILES",
    "ROUTERS",
    "FittedCost",
    "Profile",
    "RooflineCost",
    "RoutedResult",
    "SimResult",
    "Simulator",
    "StepShape",
    "route",
]
