import os

import torch
import torch.nn as nn
import torch.nn.functional as F

SMALL = os.environ.get("CUDA_AGENT_TASK_SIZE") == "small"
N, C, L, K = (6, 48, 2003, 56) if SMALL else (64, 128, 8192, 128)


class Model(nn.Module):
    """A 1-D convolution, kernel 5, padding 2."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, 5, padding=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def get_inputs():
    return [torch.randn(N, C, L)]


def get_init_inputs():
    return [C, K]


def get_inputs_alt():
    """A second shape: every free dimension odd (so no multiple of 4, 8 or 16) and about half the
    first, to catch kernels that assume the first shape or skip the tail of a vector loop."""
    return [torch.randn((N // 2 | 1), C, (L // 2 | 1))]
