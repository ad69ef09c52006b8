"""A linear layer whose storage can be re-laid out (quantised) in place, keeping the original."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight  # original weights, never modified
        self.bias = bias
        self.mode = "none"

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
