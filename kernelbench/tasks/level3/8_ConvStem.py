import os

import torch
import torch.nn as nn
import torch.nn.functional as F

SMALL = os.environ.get("CUDA_AGENT_TASK_SIZE") == "small"
N, C, H, W = (2, 3, 131, 129) if SMALL else (64, 3, 224, 224)


class Model(nn.Module):
    """A ResNet stem: 7x7 stride-2 conv, BN, ReLU, 3x3 stride-2 max pool (inference)."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 7, stride=2, padding=3, bias=False)
        self.bn = nn.BatchNorm2d(c_out)
        with torch.no_grad():
            self.bn.running_mean.normal_()
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(torch.relu(self.bn(self.conv(x))), 3, stride=2, padding=1)


def get_inputs():
    return [torch.randn(N, C, H, W)]


def get_init_inputs():
    return [C, 64]


def get_inputs_alt():
    """A second shape: every free dimension odd (so no multiple of 4, 8 or 16) and about half the
    first, to catch kernels that assume the first shape or skip the tail of a vector loop."""
    return [torch.randn((N // 2 | 1), C, (H // 2 | 1), (W // 2 | 1))]
