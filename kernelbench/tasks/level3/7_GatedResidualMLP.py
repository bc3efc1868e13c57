import os

import torch
import torch.nn as nn
import torch.nn.functional as F

SMALL = os.environ.get("CUDA_AGENT_TASK_SIZE") == "small"
TOKENS, DIM, HIDDEN = (253, 381, 597) if SMALL else (8192, 1024, 4096)


class Model(nn.Module):
    """RMSNorm, a GEGLU MLP and a residual: x + down(gelu(gate(n)) * up(n)), n = rmsnorm(x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return x + self.down(F.gelu(self.gate(n)) * self.up(n))


def get_inputs():
    return [torch.randn(TOKENS, DIM)]


def get_init_inputs():
    return [DIM, HIDDEN]


def get_inputs_alt():
    """A second shape: every free dimension odd (so no multiple of 4, 8 or 16) and about half the
    first, to catch kernels that assume the first shape or skip the tail of a vector loop."""
    return [torch.randn((TOKENS // 2 | 1), DIM)]
