"""Two outputs: (a + b, a - b)."""
import torch
import torch.nn as nn

N = 1 << 16


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a: torch.Tensor, b: torch.Tensor):
        return a + b, a - b


def get_inputs():
    return [torch.randn(N), torch.randn(N)]


def get_init_inputs():
    return []


def get_inputs_alt():
    return [torch.randn(N + 3), torch.randn(N + 3)]
