import os

import torch
import torch.nn as nn
import torch.nn.functional as F

SMALL = os.environ.get("CUDA_AGENT_TASK_SIZE") == "small"
N, C, H, W = (2, 29, 126, 127) if SMALL else (128, 64, 256, 256)


class Model(nn.Module):
    """2x2 max pooling, stride 2."""

    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(x, 2)


def get_inputs():
    return [torch.randn(N, C, H, W)]


def get_init_inputs():
    return []


def get_inputs_alt():
    """A second shape: every free dimension odd (so no multiple of 4, 8 or 16) and about half the
    first, to catch kernels that assume the first shape or skip the tail of a vector loop."""
    return [torch.randn((N // 2 | 1), (C // 2 | 1), (H // 2 | 1), (W // 2 | 1))]
