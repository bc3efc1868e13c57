"""A matmul with a long inner dimension and a small output: every output is a sum of 65536
products, so where such a sum cancels to near zero its rounding (which depends on the order of
the additions) is large next to the output itself."""
import torch
import torch.nn as nn

M, K, N = 128, 65536, 8


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a, b)


def get_inputs():
    return [torch.randn(M, K), torch.randn(K, N)]


def get_init_inputs():
    return []


def get_inputs_alt():
    return [torch.randn(M - 3, K + 5), torch.randn(K + 5, N - 1)]
