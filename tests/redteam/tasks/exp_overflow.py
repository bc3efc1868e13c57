"""exp of inputs large enough that part of the output overflows to +inf (float32's exp
overflows above 88.72). Inputs are multiples of 5, so no element sits at the threshold where
two correct implementations could round to the largest float and to infinity."""
import torch
import torch.nn as nn

N = 1 << 16


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)


def get_inputs():
    return [torch.randint(-24, 25, (N,)).float() * 5.0]


def get_init_inputs():
    return []


def get_inputs_alt():
    return [torch.randint(-24, 25, (N + 3,)).float() * 5.0]
