import os

import torch
import torch.nn as nn
import torch.nn.functional as F

SMALL = os.environ.get("CUDA_AGENT_TASK_SIZE") == "small"
N, C, H, W = (4, 28, 69, 73) if SMALL else (32, 64, 128, 128)


class Model(nn.Module):
    """A 3x3 convolution, GroupNorm and SiLU (a diffusion-UNet unit)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.GroupNorm(4, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.norm(self.conv(x)))


def get_inputs():
    return [torch.randn(N, C, H, W)]


def get_init_inputs():
    return [C]


def get_inputs_alt():
    """A second shape: every free dimension odd (so no multiple of 4, 8 or 16) and about half the
    first, to catch kernels that assume the first shape or skip the tail of a vector loop."""
    return [torch.randn((N // 2 | 1), C, (H // 2 | 1), (W // 2 | 1))]
