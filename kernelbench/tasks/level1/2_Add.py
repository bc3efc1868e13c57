import os

import torch
import torch.nn as nn

SMALL = os.environ.get("CUDA_AGENT_TASK_SIZE") == "small"
N = 7_750_003 if SMALL else 1 << 29


class Model(nn.Module):
    """Elementwise sum of two vectors."""

    def __init__(self):
        super().__init__()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


def get_inputs():
    return [torch.randn(N), torch.randn(N)]


def get_init_inputs():
    return []


def get_inputs_alt():
    """Another shape (not a multiple of 4), to catch kernels hard-coded to the first."""
    return [torch.randn(N + 3), torch.randn(N + 3)]
