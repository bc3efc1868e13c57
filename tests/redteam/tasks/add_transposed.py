"""A non-contiguous output: (a + b).t(), a view with swapped strides."""
import torch
import torch.nn as nn

R, C = 256, 192


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a + b).t()


def get_inputs():
    return [torch.randn(R, C), torch.randn(R, C)]


def get_init_inputs():
    return []


def get_inputs_alt():
    return [torch.randn(R + 5, C - 7), torch.randn(R + 5, C - 7)]
