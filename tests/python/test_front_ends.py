"""verify.py and profile.py as the agent sees them: a line per step while they run, a short
summary (verdict, errors and the tolerance that applied, times), and the whole verdict as
JSON in a file of the workspace that the summary names.

The candidate's kernel is bound with pybind11 alone (kernels/, no torch headers): the
quickest build there is, shared by every test of the module."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKILLS = ROOT / "skills"
TASK = ROOT / "kernelbench" / "tasks" / "level1" / "2_Add.py"
sys.path.append(str(SKILLS))

KERNEL = r"""#include <cstdint>
#include <pybind11/pybind11.h>
static void add(std::uintptr_t a, std::uintptr_t b, std::uintptr_t out, std::int64_t n, double off) {
    auto pa = reinterpret_cast<const float*>(a), pb = reinterpret_cast<const float*>(b);
    auto po = reinterpret_cast<float*>(out);
    for (std::int64_t i = 0; i < n; ++i) po[i] = pa[i] + pb[i];
    if (off != 0.0 && n > 7) po[7] += static_cast<float>(off);
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add", &add); }
"""

MODEL_NEW = """import torch
import torch.nn as nn
import kernels_ext


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        a, b = a.contiguous(), b.contiguous()
        out = torch.empty_like(a)
        kernels_ext.add(a.data_ptr(), b.data_ptr(), out.data_ptr(), a.numel(), OFF)
        return out
"""


@pytest.fixture(scope="module")
def ext_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("torch_extensions")


def workspace(tmp_path: Path, off: float) -> Path:
    ws = tmp_path / "ws"
    (ws / "kernels").mkdir(parents=True)
    shutil.copy(TASK, ws / "model.py")
    (ws / "kernels" / "add.cpp").write_text(KERNEL)
    (ws / "model_new.py").write_text(MODEL_NEW.replace("OFF", repr(off)))
    return ws


def run(script: str, ws: Path, ext_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext_dir), CUDA_AGENT_TASK_SIZE="small", PYTHONUNBUFFERED="0")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return subprocess.run([sys.executable, str(SKILLS / script), "--device", "cpu", "--dir", str(ws), *args],
                          capture_output=True, text=True, env=env, timeout=900)


def test_verify_prints_progress_a_summary_and_writes_the_verdict(tmp_path, ext_dir):
    ws = workspace(tmp_path, 0.0)
    out = run("verify.py", ws, ext_dir, "--trials", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    # Progress first, each with its time, the summary after them.
    for step in ("starting the reference and candidate workers", "model_new.py imported", "checking input set 1 of 2",
                 "checking input set 2 of 2", "checking an input set off the task's distribution", "checking the second input shape"):
        assert any(step in line and line.startswith("[") for line in lines), (step, out.stdout)
    summary = out.stdout[out.stdout.index("PASS"):]
    assert summary.startswith("PASS: ModelNew matches Model on 2 input sets, an input set off the task's distribution, the second input shape"), summary
    assert "output 0 (float32): passes where |got - want| <= atol 0.0001 + rtol 0.0001 * max(|want|," in summary, summary
    assert "times: workers' start (importing torch)" in summary and "build and import of model_new.py" in summary, summary
    assert "full verdict (JSON" in summary and "verify_result.json" in summary, summary
    # The noise of the old output is gone from the observation: no JSON, no timestamps.
    assert "run_windows" not in out.stdout and "{" not in summary, summary
    verdict = json.loads((ws / "verify_result.json").read_text())
    assert verdict["correct"] is True
    assert verdict["details"]["tolerance"][0]["atol"] == 1e-4
    assert verdict["details"]["tolerance"][0]["dtype"] == "float32"
    assert "run_windows" in verdict


def test_a_silent_step_is_said_to_still_run():
    """A build that takes minutes is not silence: a line every heartbeat names the step."""
    import io
    import time

    import cuda_agent_harness as h
    out = io.StringIO()
    p = h.Progress(out, heartbeat_s=0.2)
    p("[   0.0 s] workers ready; building (if the sources changed) and importing model_new.py")
    time.sleep(0.7)
    p("[   0.7 s] model_new.py imported")
    time.sleep(0.1)
    p.close()
    lines = out.getvalue().splitlines()
    beats = [line for line in lines if "still running: workers ready; building" in line]
    assert 1 <= len(beats) <= 4, lines
    assert lines[-1] == "[   0.7 s] model_new.py imported", lines
    # Quiet once closed.
    time.sleep(0.3)
    assert out.getvalue().splitlines() == lines


def test_verify_names_a_failure_once_and_keeps_it_in_the_file(tmp_path, ext_dir):
    ws = workspace(tmp_path, 1.0)
    out = run("verify.py", ws, ext_dir, "--trials", "1", "--quiet")
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.startswith("FAIL: wrong_output: input set 1 of 1: output 0:"), out.stdout
    assert out.stdout.count("wrong_output") == 1, out.stdout
    verdict = json.loads((ws / "verify_result.json").read_text())
    assert verdict["correct"] is False and verdict["rule"] == "wrong_output"


def test_profile_json_keeps_stdout_one_document_and_writes_the_file(tmp_path, ext_dir):
    ws = workspace(tmp_path, 0.0)
    out = run("profile.py", ws, ext_dir, "--compare", "eager", "--budget-s", "0.2", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    assert doc["correct"] is True and doc["times_ms"]["candidate"] > 0
    assert "timing eager and ModelNew" in out.stderr, out.stderr
    assert json.loads((ws / "profile_result.json").read_text())["correct"] is True
    table = run("profile.py", ws, ext_dir, "--compare", "eager", "--budget-s", "0.2", "--quiet")
    assert table.returncode == 0, table.stdout + table.stderr
    assert "speedup vs eager:" in table.stdout and "full verdict (JSON" in table.stdout, table.stdout
    # The reward's rule in the judge's words, as SKILL.md states it.
    import cuda_agent_judge
    assert f"the rule: {cuda_agent_judge.milestone_rule()}" in table.stdout, table.stdout


def test_a_passing_max_rel_error_is_explained():
    import verify
    details = {"checks": 5, "max_abs_error": 2e-5, "max_rel_error": 7.0, "off_distribution": "checked", "second_shape": True,
               "tolerance": [{"output": 0, "dtype": "float32", "atol": 1e-4, "rtol": 1e-4, "typical_magnitude": 0.84}],
               "build_s": 3.2, "stage_s": {"start": 4.0, "check": 1.5}}
    lines = verify.summary({"correct": True, "details": details}, None, "verify_result.json")
    text = "\n".join(lines)
    assert lines[0] == "PASS: ModelNew matches Model on 5 input sets, an input set off the task's distribution, the second input shape"
    assert "every element may differ by 0.000184" in text, text
    assert "max_rel_error 7 is |got - want| / |want| at its worst element, an output near zero" in text, text
    assert "times: workers' start (importing torch) 0.8 s, build and import of model_new.py 3.2 s, checks 1.5 s" in text, text
    # Within the relative tolerance: nothing to explain.
    details["max_rel_error"] = 5e-5
    assert "max_rel_error" not in "\n".join(verify.summary({"correct": True, "details": details}, None, "f"))


CHAIN_TASK = """import torch
import torch.nn as nn

# A chain of {n} steps whose constant makes a graph no compile cache has seen.
C = {c!r}


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        for _ in range({n}):
            x = x * 1.0001 + C
        return x


def get_inputs():
    return [torch.randn(4096)]


def get_init_inputs():
    return []
"""

CHAIN_KERNEL = r"""#include <cstdint>
#include <pybind11/pybind11.h>
static void chain(std::uintptr_t x, std::uintptr_t out, std::int64_t n, std::int64_t steps, double c) {
    auto px = reinterpret_cast<const float*>(x);
    auto po = reinterpret_cast<float*>(out);
    const float cf = static_cast<float>(c);
    for (std::int64_t i = 0; i < n; ++i) {
        float v = px[i];
        for (std::int64_t s = 0; s < steps; ++s) { v = v * 1.0001f; v = v + cf; }
        po[i] = v;
    }
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("chain", &chain); }
"""

CHAIN_MODEL_NEW = """import torch
import torch.nn as nn
import kernels_ext
from model import C


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        kernels_ext.chain(x.data_ptr(), out.data_ptr(), x.numel(), STEPS, C)
        return out
"""


def test_the_compile_baselines_first_call_gets_the_setup_timeout(tmp_path, ext_dir):
    """torch.compile compiles on its first call: tens of seconds with a cold cache, minutes on
    a loaded host, where profile.py's baseline failed as harness_error after a call's 120 s.
    That call is held to the setup's timeout: here a call timeout shorter than the compile of
    a graph no cache holds."""
    import random
    steps = 300
    ws = tmp_path / "ws"
    (ws / "kernels").mkdir(parents=True)
    (ws / "model.py").write_text(CHAIN_TASK.format(n=steps, c=random.uniform(0.001, 0.002)))
    (ws / "kernels" / "chain.cpp").write_text(CHAIN_KERNEL)
    (ws / "model_new.py").write_text(CHAIN_MODEL_NEW.replace("STEPS", str(steps)))
    # A cache of its own: torch.compile lifts the float constant out of the graph, so a cache
    # another run warmed would hold this graph whatever the constant.
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext_dir), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
               TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    call_timeout = 1.0
    out = subprocess.run([sys.executable, str(SKILLS / "evaluate.py"), "candidate", "--task", str(ws / "model.py"), "--candidate", str(ws),
                          "--device", "cpu", "--budget-s", "0.2", "--call-timeout", str(call_timeout), "--seeds", "1"],
                         capture_output=True, text=True, env=env, timeout=900)
    verdict = json.loads(out.stdout.strip().splitlines()[-1])
    assert verdict["correct"] is True, verdict
    assert verdict["times_ms"]["compile"] > 0, verdict
    # The case this is about needs a compile longer than a call may take. On the shared CI
    # host the first call has come back in milliseconds under the parallel suite (a compile
    # served whole from somewhere no variable above reaches; not yet understood): then the
    # case did not happen and there is nothing to conclude.
    if verdict["details"]["compile_first_call_s"] <= call_timeout:
        pytest.skip(f"the first torch.compile call took {verdict['details']['compile_first_call_s']:.3f} s, "
                    f"under the {call_timeout} s call timeout: the slow-compile case did not occur")


SIZE_TASK = """import os
from pathlib import Path

Path(__file__).with_name(f"size-{os.getpid()}").write_text(os.environ.get("CUDA_AGENT_TASK_SIZE", "unset"))

import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return x + 1


def get_inputs():
    return [torch.randn(8)]


def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("flag, env, want", [(None, None, "small"), ("full", None, "full"), (None, "full", "full"), ("small", "full", "small")])
def test_the_judge_run_by_hand_picks_the_servers_task_size(tmp_path, flag, env, want):
    # Run by hand on the CPU, a task at its full size is gigabytes of inputs a call (L1/2_Add:
    # 2 GiB each): without the variable the server sets, the judge takes the server's default
    # for the device, and passes it to both workers; --size overrides either.
    (tmp_path / "task.py").write_text(SIZE_TASK)
    cand = tmp_path / "cand"
    cand.mkdir()
    (cand / "model_new.py").write_text('raise SystemExit("not a candidate")\n')
    e = {k: v for k, v in os.environ.items() if k != "CUDA_AGENT_TASK_SIZE"}
    if env:
        e["CUDA_AGENT_TASK_SIZE"] = env
    argv = [sys.executable, str(SKILLS / "evaluate.py"), "candidate", "--task", str(tmp_path / "task.py"), "--candidate", str(cand),
            "--device", "cpu", "--no-time"] + (["--size", flag] if flag else [])
    out = subprocess.run(argv, capture_output=True, text=True, env=e, timeout=300)
    verdict = json.loads(out.stdout.strip().splitlines()[-1])
    assert verdict["correct"] is False, verdict
    seen = sorted(p.read_text() for p in tmp_path.glob("size-*"))
    # The judge and both workers imported the task.
    assert len(seen) == 3 and set(seen) == {want}, seen
