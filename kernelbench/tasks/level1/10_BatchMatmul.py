import os

import torch
import torch.nn as nn
import torch.nn.functional as F

SMALL = os.environ.get("CUDA_AGENT_TASK_SIZE") == "small"
B, M, K, N = (7, 331, 317, 339) if SMALL else (64, 1024, 1024, 1024)


class Model(nn.Module):
    """Batched matrix multiplication."""

    def __init__(self):
        super().__init__()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.bmm(a, b)


def get_inputs():
    return [torch.randn(B, M, K), torch.randn(B, K, N)]


def get_init_inputs():
    return []


def get_inputs_alt():
    """A second shape: every free dimension odd (so no multiple of 4, 8 or 16) and about half the
    first, to catch kernels that assume the first shape or skip the tail of a vector loop."""
    return [torch.randn((B // 2 | 1), (M // 2 | 1), (K // 2 | 1)), torch.randn((B // 2 | 1), (K // 2 | 1), (N // 2 | 1))]
