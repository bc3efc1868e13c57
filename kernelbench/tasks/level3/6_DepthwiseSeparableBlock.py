import os

import torch
import torch.nn as nn
import torch.nn.functional as F

SMALL = os.environ.get("CUDA_AGENT_TASK_SIZE") == "small"
N, C, H, W = (4, 40, 57, 61) if SMALL else (32, 128, 112, 112)


class Model(nn.Module):
    """A MobileNet block: depthwise 3x3 conv, BN, ReLU6, pointwise 1x1 conv, BN, ReLU6 (inference)."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.dw = nn.Conv2d(c_in, c_in, 3, padding=1, groups=c_in, bias=False)
        self.bn1 = nn.BatchNorm2d(c_in)
        self.pw = nn.Conv2d(c_in, c_out, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        with torch.no_grad():
            for bn in (self.bn1, self.bn2):
                bn.running_mean.normal_()
                bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu6(self.bn1(self.dw(x)))
        return F.relu6(self.bn2(self.pw(x)))


def get_inputs():
    return [torch.randn(N, C, H, W)]


def get_init_inputs():
    return [C, 2 * C]


def get_inputs_alt():
    """A second shape: every free dimension odd (so no multiple of 4, 8 or 16) and about half the
    first, to catch kernels that assume the first shape or skip the tail of a vector loop."""
    return [torch.randn((N // 2 | 1), C, (H // 2 | 1), (W // 2 | 1))]
