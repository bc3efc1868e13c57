import os

import torch
import torch.nn as nn
import torch.nn.functional as F

SMALL = os.environ.get("CUDA_AGENT_TASK_SIZE") == "small"
BATCH, IN, OUT = (509, 701, 687) if SMALL else (4096, 4096, 8192)


class Model(nn.Module):
    """A linear layer then softmax over its outputs (a classifier head)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.linear(x), dim=-1)


def get_inputs():
    return [torch.randn(BATCH, IN)]


def get_init_inputs():
    return [IN, OUT]


def get_inputs_alt():
    """A second shape: every free dimension odd (so no multiple of 4, 8 or 16) and about half the
    first, to catch kernels that assume the first shape or skip the tail of a vector loop."""
    return [torch.randn((BATCH // 2 | 1), IN)]
