"""PyTorch's add dispatched from C++ on a std::thread of the extension's own, joined before the
call returns: a dispatch mode set on the forward's thread sees nothing of it."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

ext = load_inline(
    name="redteam_cpp_thread_add",
    cpp_sources=r"""
#include <torch/extension.h>
#include <thread>
torch::Tensor add_in_thread(torch::Tensor a, torch::Tensor b) {
    torch::Tensor out;
    std::thread t([&]() { out = at::add(a, b); });
    t.join();
    return out;
}
""",
    functions=["add_in_thread"],
    extra_cflags=["-O2"],
)


class ModelNew(nn.Module):
    def forward(self, a, b):
        return ext.add_in_thread(a, b)
