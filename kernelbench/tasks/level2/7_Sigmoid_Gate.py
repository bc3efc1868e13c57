import os

import torch
import torch.nn as nn
import torch.nn.functional as F

SMALL = os.environ.get("CUDA_AGENT_TASK_SIZE") == "small"
BATCH, DIM = (1009, 7681) if SMALL else (24576, 16384)


class Model(nn.Module):
    """A gated unit: x * sigmoid(g)."""

    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(g)


def get_inputs():
    return [torch.randn(BATCH, DIM), torch.randn(BATCH, DIM)]


def get_init_inputs():
    return []
