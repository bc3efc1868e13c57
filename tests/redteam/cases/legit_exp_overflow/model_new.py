"""A correct exp whose output is +inf wherever the reference overflows: infinities that match
are right."""
import kernels_ext
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        assert x.dtype == torch.float32 and x.device.type == "cpu"
        out = torch.empty_like(x)
        kernels_ext.exp(x.data_ptr(), out.data_ptr(), x.numel())
        return out
