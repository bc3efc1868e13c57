#include <cfloat>
#include <cmath>
#include <cstdint>
#include <pybind11/pybind11.h>

// exp, overflowing to +inf where the reference does.
static void exp_float(std::uintptr_t x, std::uintptr_t out, std::int64_t n) {
    auto px = reinterpret_cast<const float*>(x);
    auto po = reinterpret_cast<float*>(out);
    for (std::int64_t i = 0; i < n; ++i) po[i] = std::exp(px[i]);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("exp", &exp_float); }
