"""The judge's static check of a candidate's sources for calls into ATen's per-device kernels
around the dispatcher (invisible to the dispatcher trace), and the CUDA utilities next to them
that honest kernels need, which it must leave alone. Sources are read, never built."""

import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "skills"))
import cuda_agent_harness as h  # noqa: E402
import cuda_agent_judge as judge  # noqa: E402

AROUND_THE_DISPATCHER = [
    '#include <ATen/CPUFunctions.h>\n',
    '#include "ATen/CUDAFunctions.h"\n',
    '#include <ATen/CompositeExplicitAutogradFunctions.h>\n',
    '#include <ATen/ops/add_cpu_dispatch.h>\n',
    '#include <ATen/ops/mm_cuda_dispatch.h>\n',
    '#include <ATen/native/BinaryOps.h>\n',
    'torch::Tensor f(torch::Tensor a, torch::Tensor b) { return at::cpu::add(a, b); }\n',
    'torch::Tensor f(torch::Tensor a, torch::Tensor b) { return at :: native :: add(a, b); }\n',
]

HONEST = [
    '#include <ATen/cuda/CUDAContext.h>\n#include <c10/cuda/CUDAGuard.h>\n'
    'void f(float* x) { auto s = at::cuda::getCurrentCUDAStream(); at::cuda::CUDAGuard g(0); k<<<1, 1, 0, s>>>(x); }\n',
    '#include <ATen/Parallel.h>\n#include <ATen/cpu/vec/vec.h>\n'
    'void f(float* x, long n) { at::parallel_for(0, n, 1024, [&](long b, long e) { using V = at::vec::Vectorized<float>; }); }\n',
    '#include <torch/extension.h>\ntorch::Tensor f(torch::Tensor a) { return torch::empty_like(a); }\n',
]


def check(tmp_path: Path, kernel: str, where: str) -> None:
    if where == "model_new.py":
        (tmp_path / "model_new.py").write_text(f'SRC = r"""\n{kernel}"""\n')
    else:
        (tmp_path / "model_new.py").write_text("import kernels_ext\n")
        (tmp_path / "kernels").mkdir()
        (tmp_path / "kernels" / "k.cu").write_text(kernel)
    judge.static_check(tmp_path)


@pytest.mark.parametrize("where", ["model_new.py", "kernels/"])
@pytest.mark.parametrize("kernel", AROUND_THE_DISPATCHER)
def test_kernels_called_around_the_dispatcher_are_refused(tmp_path, kernel, where):
    with pytest.raises(h.RuleBreak) as e:
        check(tmp_path, kernel, where)
    assert e.value.rule == "forbidden_source" and "around its dispatcher" in str(e.value)


@pytest.mark.parametrize("kernel", HONEST)
def test_the_utilities_honest_kernels_need_pass(tmp_path, kernel):
    check(tmp_path, kernel, "kernels/")
