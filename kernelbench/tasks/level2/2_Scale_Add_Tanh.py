import os

import torch
import torch.nn as nn

SMALL = os.environ.get("CUDA_AGENT_TASK_SIZE") == "small"
BATCH, DIM = (509, 3851) if SMALL else (8192, 16384)


class Model(nn.Module):
    """An elementwise chain: scale, add a bias, tanh, scale again."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale
        self.bias = nn.Parameter(torch.randn(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.scale + self.bias) * 0.5


def get_inputs():
    return [torch.randn(BATCH, DIM)]


def get_init_inputs():
    return [1.7]


def get_inputs_alt():
    """A second shape: every free dimension odd (so no multiple of 4, 8 or 16) and about half the
    first, to catch kernels that assume the first shape or skip the tail of a vector loop."""
    return [torch.randn((BATCH // 2 | 1), DIM)]
