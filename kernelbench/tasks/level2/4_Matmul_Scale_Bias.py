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


def get_inputs_alt():
    """A second shape: every free dimension odd (so no multiple of 4, 8 or 16) and about half the
    first, to catch kernels that assume the first shape or skip the tail of a vector loop."""
    return [torch.randn((M // 2 | 1), (K // 2 | 1)), torch.randn((K // 2 | 1), N)]
