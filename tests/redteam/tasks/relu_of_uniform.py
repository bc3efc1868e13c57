"""ReLU of inputs drawn from [0, 1): on every input get_inputs can make, the identity is right."""
import torch
import torch.nn as nn

N = 1 << 16


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


def get_inputs():
    return [torch.rand(N)]


def get_init_inputs():
    return []


def get_inputs_alt():
    return [torch.rand(N + 3)]
