"""How the worker builds a candidate in the agent's workspace: a change to one kernels/ file
recompiles that file alone, a header deleted from kernels/ is not found in an old copy (the
final evaluation, building from kernels/ alone, would not find it), and a build killed midway
leaves nothing that makes the next one wait. The worker's `build` command, as verify.py and
the server run it; pybind11-only sources keep each build to seconds."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "skills" / "cuda_agent_worker.py"
TASK = ROOT / "kernelbench" / "tasks" / "level1" / "2_Add.py"

BINDING = """#include <cstdint>
#include <pybind11/pybind11.h>
void add_kernel(const float* a, const float* b, float* out, std::int64_t n);
static void add(std::uintptr_t a, std::uintptr_t b, std::uintptr_t out, std::int64_t n) {
    add_kernel(reinterpret_cast<const float*>(a), reinterpret_cast<const float*>(b), reinterpret_cast<float*>(out), n);
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add", &add); }
"""

KERNEL = """#include <cstdint>
#include "scale.h"
// variant VARIANT
void add_kernel(const float* a, const float* b, float* out, std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i) out[i] = SCALE * (a[i] + b[i]);
}
"""

MODEL_NEW = """import torch
import torch.nn as nn
import kernels_ext


class ModelNew(nn.Module):
    def forward(self, a, b):
        out = torch.empty_like(a)
        kernels_ext.add(a.data_ptr(), b.data_ptr(), out.data_ptr(), a.numel())
        return out
"""


def build(cand: Path, ext_dir: Path, timeout: float = 300) -> dict:
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext_dir), CUDA_AGENT_TASK_SIZE="small")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    out = subprocess.run([sys.executable, str(WORKER), "build", "--task", str(TASK), "--candidate", str(cand), "--device", "cpu"],
                         capture_output=True, text=True, env=env, timeout=timeout)
    return json.loads(out.stdout.strip().splitlines()[-1])


def objects(ext_dir: Path) -> dict[str, int]:
    """Modification times of every object file the builds left, by name."""
    return {p.name: p.stat().st_mtime_ns for p in ext_dir.glob("kernels_ext_*/*.o")}


def write_candidate(cand: Path, variant: int) -> None:
    (cand / "kernels").mkdir(parents=True, exist_ok=True)
    (cand / "model_new.py").write_text(MODEL_NEW)
    (cand / "kernels" / "binding.cpp").write_text(BINDING)
    (cand / "kernels" / "add.cpp").write_text(KERNEL.replace("VARIANT", str(variant)))
    (cand / "kernels" / "scale.h").write_text("#define SCALE 1.0f\n")


def test_a_one_file_change_recompiles_that_file_alone(tmp_path):
    cand, ext = tmp_path / "ws", tmp_path / "ext"
    write_candidate(cand, 0)
    assert build(cand, ext)["built"]
    first = objects(ext)
    assert set(first) == {"binding.o", "add.o"}, first
    (cand / "kernels" / "add.cpp").write_text(KERNEL.replace("VARIANT", "1"))
    assert build(cand, ext)["built"]
    second = objects(ext)
    assert second["binding.o"] == first["binding.o"], "the untouched binding was compiled again"
    assert second["add.o"] != first["add.o"], "the changed kernel was not compiled again"
    # Unchanged sources: nothing is compiled.
    assert build(cand, ext)["built"]
    assert objects(ext) == second
    # A header is a dependency too.
    (cand / "kernels" / "scale.h").write_text("#define SCALE 1.0f  // touched\n")
    assert build(cand, ext)["built"]
    third = objects(ext)
    assert third["add.o"] != second["add.o"] and third["binding.o"] == second["binding.o"]


def test_a_deleted_header_is_not_found_in_an_old_copy(tmp_path):
    cand, ext = tmp_path / "ws", tmp_path / "ext"
    write_candidate(cand, 0)
    assert build(cand, ext)["built"]
    (cand / "kernels" / "scale.h").unlink()
    (cand / "kernels" / "add.cpp").write_text(KERNEL.replace("VARIANT", "2"))
    r = build(cand, ext)
    assert not r["built"] and r["rule"] == "compile", r
    assert "scale.h" in r["reason"], r


def test_a_build_killed_midway_does_not_stall_the_next(tmp_path):
    """torch's own build leaves a `lock` file in the build directory when it is killed (a
    command that ran out of time); its next build of that name would wait for the file forever."""
    cand, ext = tmp_path / "ws", tmp_path / "ext"
    write_candidate(cand, 0)
    assert build(cand, ext)["built"]
    (lock,) = [d / "lock" for d in ext.glob("kernels_ext_*")]
    lock.touch()
    assert build(cand, ext, timeout=120)["built"]
