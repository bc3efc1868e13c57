import torch
import torch.nn as nn

# KernelBench level 1's ReLU at its own size: one 4096 x 393216 float32 input (6.4 GB) and an
# output of the same size. The bundled tasks are smaller; this one checks that an evaluation
# fits on one GPU at the sizes KernelBench uses.
BATCH, DIM = 4096, 393216


class Model(nn.Module):
    """Elementwise ReLU."""

    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


def get_inputs():
    return [torch.randn(BATCH, DIM)]


def get_init_inputs():
    return []


def get_inputs_alt():
    return [torch.randn((BATCH // 2 | 1), (DIM // 2 | 1))]
