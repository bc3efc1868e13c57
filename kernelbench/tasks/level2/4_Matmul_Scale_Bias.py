import os

import torch
import torch.nn as nn
import torch.nn.functional as F

SMALL = os.environ.get("CUDA_AGENT_TASK_SIZE") == "small"
M, K, N = (613, 701, 577) if SMALL else (4096, 4096, 4096)


class Model(nn.Module):
    """A matrix product, scaled, plus a bias row."""

    def __init__(self, n: int):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(n))
        self.scale = 0.125

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a, b) * self.scale + self.bias


def get_inputs():
    return [torch.randn(M, K), torch.randn(K, N)]


def get_init_inputs():
    return [N]
