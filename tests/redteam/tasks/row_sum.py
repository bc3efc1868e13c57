"""Sum over dim 1, keeping it (a small SumReduction)."""
import torch
import torch.nn as nn

R, C = 512, 1024


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sum(x, dim=1, keepdim=True)


def get_inputs():
    return [torch.randn(R, C)]


def get_init_inputs():
    return []


def get_inputs_alt():
    return [torch.randn(R - 3, C + 5)]
