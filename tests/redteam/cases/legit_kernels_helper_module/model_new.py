"""The kernels/ layout with a Python helper module of its own: kernels/add.cpp built by the judge
as kernels_ext, and kernels/prep.py (imported as kernels.prep) preparing the inputs."""
import kernels_ext
import torch.nn as nn

from kernels.prep import contiguous_f32


class ModelNew(nn.Module):
    def forward(self, a, b):
        return kernels_ext.add(*contiguous_f32(a, b))
