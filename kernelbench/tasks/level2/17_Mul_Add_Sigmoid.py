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
