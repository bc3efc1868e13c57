"""The kernels/ layout: kernels/add.cpp built by the judge and imported as kernels_ext."""
import kernels_ext
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, a, b):
        return kernels_ext.add(a.contiguous(), b.contiguous())
