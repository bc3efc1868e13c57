import os

import torch
import torch.nn as nn
import torch.nn.functional as F

SMALL = os.environ.get("CUDA_AGENT_TASK_SIZE") == "small"
M, K, N = (613, 701, 577) if SMALL else (4096, 4096, 4096)


class Model(nn.Module):
    """A matrix product, tanh, then a scale."""

    def __init__(self):
        super().__init__()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.matmul(a, b)) * 2.0


def get_inputs():
    return [torch.randn(M, K) * 0.05, torch.randn(K, N) * 0.05]


def get_init_inputs():
    return []


def get_inputs_alt():
    """A second shape: every free dimension odd (so no multiple of 4, 8 or 16) and about half the
    first, to catch kernels that assume the first shape or skip the tail of a vector loop."""
    return [torch.randn((M // 2 | 1), (K // 2 | 1)) * 0.05, torch.randn((K // 2 | 1), (N // 2 | 1)) * 0.05]
