import os

import torch
import torch.nn as nn

SMALL = os.environ.get("CUDA_AGENT_TASK_SIZE") == "small"
N, C, H, W = (4, 24, 57, 61) if SMALL else (32, 64, 128, 128)


class Model(nn.Module):
    """A ResNet basic block: conv-bn-relu-conv-bn plus the input, then ReLU (inference)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        with torch.no_grad():
            for bn in (self.bn1, self.bn2):
                bn.running_mean.normal_()
                bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + x)


def get_inputs():
    return [torch.randn(N, C, H, W)]


def get_init_inputs():
    return [C]


def get_inputs_alt():
    """A second shape: every free dimension odd (so no multiple of 4, 8 or 16) and about half the
    first, to catch kernels that assume the first shape or skip the tail of a vector loop."""
    return [torch.randn((N // 2 | 1), C, (H // 2 | 1), (W // 2 | 1))]
