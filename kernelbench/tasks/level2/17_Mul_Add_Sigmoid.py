import os

import torch
import torch.nn as nn
import torch.nn.functional as F

SMALL = os.environ.get("CUDA_AGENT_TASK_SIZE") == "small"
BATCH, DIM = (1009, 5003) if SMALL else (16384, 16384)


class Model(nn.Module):
    """An elementwise chain over three inputs: sigmoid(x * y + z)."""

    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x * y + z)


def get_inputs():
    return [torch.randn(BATCH, DIM), torch.randn(BATCH, DIM), torch.randn(BATCH, DIM)]


def get_init_inputs():
    return []


def get_inputs_alt():
    """A second shape: every free dimension odd (so no multiple of 4, 8 or 16) and about half the
    first, to catch kernels that assume the first shape or skip the tail of a vector loop."""
    return [torch.randn((BATCH // 2 | 1), (DIM // 2 | 1)), torch.randn((BATCH // 2 | 1), (DIM // 2 | 1)), torch.randn((BATCH // 2 | 1), (DIM // 2 | 1))]
