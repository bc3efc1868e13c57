import os

import torch
import torch.nn as nn
import torch.nn.functional as F

SMALL = os.environ.get("CUDA_AGENT_TASK_SIZE") == "small"
B, S, D = (7, 509, 61) if SMALL else (192, 1024, 128)


class Model(nn.Module):
    """Attention weights applied to values: softmax(scores) @ v."""

    def __init__(self):
        super().__init__()

    def forward(self, scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.matmul(torch.softmax(scores, dim=-1), v)


def get_inputs():
    return [torch.randn(B, S, S), torch.randn(B, S, D)]


def get_init_inputs():
    return []


def get_inputs_alt():
    """A second shape: every free dimension odd (so no multiple of 4, 8 or 16) and about half the
    first, to catch kernels that assume the first shape or skip the tail of a vector loop."""
    return [torch.randn((B // 2 | 1), (S // 2 | 1), (S // 2 | 1)), torch.randn((B // 2 | 1), (S // 2 | 1), (D // 2 | 1))]
