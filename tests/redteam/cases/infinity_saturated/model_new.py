"""Finite values where the reference overflows to infinity: exp saturated at the largest
float. An infinite reference must be matched by infinity, not by a tolerance that is itself
infinite."""
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
