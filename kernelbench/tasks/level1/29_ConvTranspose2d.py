import os

import torch
import torch.nn as nn
import torch.nn.functional as F

SMALL = os.environ.get("CUDA_AGENT_TASK_SIZE") == "small"
N, C, H, W = (4, 48, 61, 63) if SMALL else (160, 64, 64, 64)


class Model(nn.Module):
    """A transposed 2x2 convolution, stride 2 (upsampling)."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv = nn.ConvTranspose2d(c_in, c_out, 2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def get_inputs():
    return [torch.randn(N, C, H, W)]


def get_init_inputs():
    return [C, C // 2]


def get_inputs_alt():
    """A second shape: every free dimension odd (so no multiple of 4, 8 or 16) and about half the
    first, to catch kernels that assume the first shape or skip the tail of a vector loop."""
    return [torch.randn((N // 2 | 1), C, (H // 2 | 1), (W // 2 | 1))]
