import os

import torch
import torch.nn as nn
import torch.nn.functional as F

SMALL = os.environ.get("CUDA_AGENT_TASK_SIZE") == "small"
BATCH, DIM = (61, 127) if SMALL else (8192, 4096)

# @BODY@


class Model(nn.Module):
    """A running sum gated by log-sigmoid and cosine, then a row softmax."""

    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cumsum(x, dim=1)
        # @FORWARD@
        return F.softmax(F.logsigmoid(y) * torch.cos(x), dim=1)


def get_inputs():
    return [torch.randn(BATCH, DIM)]


def get_init_inputs():
    return []


def get_inputs_alt():
    return [torch.randn(BATCH // 2 | 1, DIM)]
