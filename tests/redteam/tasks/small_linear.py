"""A linear layer y = x W^T + b, small enough for a naive CPU kernel."""
import torch
import torch.nn as nn

BATCH, IN, OUT = 96, 128, 80


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def get_inputs():
    return [torch.randn(BATCH, IN)]


def get_init_inputs():
    return [IN, OUT]


def get_inputs_alt():
    return [torch.randn(BATCH + 7, IN)]
