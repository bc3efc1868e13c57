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
