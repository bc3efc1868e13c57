import os

import torch
import torch.nn as nn

SMALL = os.environ.get("CUDA_AGENT_TASK_SIZE") == "small"
BATCH, IN, OUT = (509, 701, 687) if SMALL else (1024, 8192, 8192)


class Model(nn.Module):
    """A linear layer followed by ReLU."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def get_inputs():
    return [torch.randn(BATCH, IN)]


def get_init_inputs():
    return [IN, OUT]
