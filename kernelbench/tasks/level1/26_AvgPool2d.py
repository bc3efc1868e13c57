import os

import torch
import torch.nn as nn
import torch.nn.functional as F

SMALL = os.environ.get("CUDA_AGENT_TASK_SIZE") == "small"
N, C, H, W = (2, 19, 123, 121) if SMALL else (32, 64, 256, 256)


class Model(nn.Module):
    """3x3 average pooling, stride 1, padding 1."""

    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.avg_pool2d(x, 3, stride=1, padding=1)


def get_inputs():
    return [torch.randn(N, C, H, W)]


def get_init_inputs():
    return []
