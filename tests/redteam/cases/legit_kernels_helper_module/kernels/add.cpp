#include <torch/extension.h>

// Elementwise a + b for float32 CPU tensors. Faster than torch.compile? Not the point: unlike
// at::native::add it is one plain loop (no sys._getframe, no /proc reads, nothing but the add).
torch::Tensor add(torch::Tensor a, torch::Tensor b) {
    TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.scalar_type() == torch::kFloat32, "float32 contiguous inputs");
    auto out = torch::empty_like(a);
    const float* x = a.data_ptr<float>();
    const float* y = b.data_ptr<float>();
    float* z = out.data_ptr<float>();
    for (int64_t i = 0; i < a.numel(); ++i) z[i] = x[i] + y[i];
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add", &add); }
