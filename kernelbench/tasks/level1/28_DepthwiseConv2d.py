import os

import torch
import torch.nn as nn
import torch.nn.functional as F

SMALL = os.environ.get("CUDA_AGENT_TASK_SIZE") == "small"
N, C, H, W = (4, 24, 125, 123) if SMALL else (160, 64, 128, 128)


class Model(nn.Module):
    """A depthwise 3x3 convolution (one filter per channel)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, groups=channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def get_inputs():
    return [torch.randn(N, C, H, W)]


def get_init_inputs():
    return [C]
