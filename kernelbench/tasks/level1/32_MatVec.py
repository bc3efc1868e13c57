import os

import torch
import torch.nn as nn
import torch.nn.functional as F

SMALL = os.environ.get("CUDA_AGENT_TASK_SIZE") == "small"
M, K = (4001, 4099) if SMALL else (98304, 16384)


class Model(nn.Module):
    """Matrix-vector product."""

    def __init__(self):
        super().__init__()

    def forward(self, a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.mv(a, v)


def get_inputs():
    return [torch.randn(M, K), torch.randn(K)]


def get_init_inputs():
    return []
