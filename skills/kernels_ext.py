"""`import kernels_ext` in your own scripts: builds kernels/ (every .cpp, .cc and .cu file in it)
into one extension exactly as the evaluation does, with the same flags and the same module, and
imports it. In verify.py, profile.py and the final evaluation the worker builds kernels/ itself
and this file is not used; it is here so that a test script of yours sees what ModelNew sees.

    import torch, kernels_ext
    out = kernels_ext.my_kernel(x)          # whatever kernels/ binds with PYBIND11_MODULE

A rebuild compiles only the files that changed (and those including a changed header), then
links: keep the binding (which includes the torch headers) in its own file and a kernel change
costs one small compile. The device comes from CUDA_AGENT_DEVICE (set in every episode), else CUDA when torch sees
one. A compile error raises ImportError with the compiler's error lines, located in kernels/.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def _build():
    here = Path(__file__).resolve().parent
    workdir = Path.cwd()
    kdir = workdir if (workdir / "kernels").is_dir() else here
    saved = list(sys.path)
    try:
        import cuda_agent_harness as h
        import cuda_agent_worker as w
    finally:
        sys.path[:] = saved  # the worker reorders sys.path for itself; the caller keeps its own
    device = h.pick_device(os.environ.get("CUDA_AGENT_DEVICE", "auto"))
    if not (kdir / "kernels").is_dir():
        raise ImportError(f"no kernels/ directory in {kdir}: put your .cpp/.cu sources there")
    try:
        module = w.build_kernels_dir(kdir, device, w.ExtensionCalls())
    except h.RuleBreak as e:
        raise ImportError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - a failed build is reported the evaluation's way
        raise ImportError(w.describe_build_error(e, kdir)) from None
    if module is None:
        raise ImportError("kernels/ holds no .cpp, .cc or .cu source")
    return module


sys.modules[__name__] = _build()
