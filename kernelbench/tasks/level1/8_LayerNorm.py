import os

import torch
import torch.nn as nn
import torch.nn.functional as F

SMALL = os.environ.get("CUDA_AGENT_TASK_SIZE") == "small"
BATCH, DIM = (3001, 2563) if SMALL else (131072, 4096)


class Model(nn.Module):
    """LayerNorm over the last dimension, with affine weights."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


def get_inputs():
    return [torch.randn(BATCH, DIM)]


def get_init_inputs():
    return [DIM]
