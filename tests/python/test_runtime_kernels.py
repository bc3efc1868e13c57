"""A kernel compiled at run time by NVRTC through torch (`torch.cuda._compile_kernel`) is a
custom kernel: the worker counts its launches as it counts calls into a built extension, so a
candidate written that way is not failed with `no_custom_kernel`. Here without a GPU: the
launcher torch returns is made by hand and its launch fails, but it was counted first. The
candidate that launches one for real is the red-team case `cuda_legit_nvrtc_kernel`."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import cuda_agent_worker as w
from torch.cuda import _utils as cu

counter = w.ExtensionCalls()
w.install_extension_counter(counter)
w.install_extension_counter(counter)  # a second install wraps nothing twice
kernel = cu._CudaKernel(None, None)
try:
    kernel(grid=(1, 1, 1), block=(1, 1, 1), args=[])
    launched = True
except Exception as e:
    launched = type(e).__name__
print(json.dumps({"count": counter.count, "modules": counter.modules, "launched": launched}))
"""


def test_nvrtc_kernel_launches_count_as_custom_kernel_calls():
    out = subprocess.run([sys.executable, "-c", PROBE, str(ROOT / "skills")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["count"] == 1, got
    assert got["modules"] == ["nvrtc"], got
    assert got["launched"] is not True, "no GPU here: the launch itself cannot have run"
