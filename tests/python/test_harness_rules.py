"""The final-evaluation judge on real PyTorch (CPU): a correct C++ candidate passes and is timed
against eager in the same run, a wrong one fails naming the input set, and each rule is broken
by a candidate that breaks only it. (tests/redteam holds the wider adversarial corpus.)

All candidates share one inline C++ extension (same name, same source), so it is built once.
"""

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EVALUATE = ROOT / "skills" / "evaluate.py"
TASK = ROOT / "kernelbench" / "tasks" / "level1" / "2_Add.py"

EXT = r'''
import torch
from torch.utils.cpp_extension import load_inline

SRC = r"""
#include <torch/extension.h>
torch::Tensor vadd(torch::Tensor a, torch::Tensor b) {
    auto out = torch::empty_like(a);
    const float* x = a.data_ptr<float>(); const float* y = b.data_ptr<float>(); float* z = out.data_ptr<float>();
    for (int64_t i = 0; i < a.numel(); ++i) z[i] = x[i] + y[i];
    return out;
}
torch::Tensor vadd_off(torch::Tensor a, torch::Tensor b) {
    auto out = vadd(a, b);
    out.data_ptr<float>()[7] += 1.0f;
    return out;
}
torch::Tensor vadd_clobber(torch::Tensor a, torch::Tensor b) {
    auto out = vadd(a, b);
    b.data_ptr<float>()[0] = 0.0f;
    return out;
}
torch::Tensor uninitialised(torch::Tensor a, torch::Tensor b) { return torch::empty_like(a); }
torch::Tensor vadd_aten(torch::Tensor a, torch::Tensor b) { return at::add(a, b); }
"""
ext = load_inline(name="harness_rules_ext", cpp_sources=SRC,
                  functions=["vadd", "vadd_off", "vadd_clobber", "uninitialised", "vadd_aten"], extra_cflags=["-O2"])
'''

HEADER = EXT + "\nimport torch.nn as nn\n\nclass ModelNew(nn.Module):\n    def __init__(self):\n        super().__init__()\n"

CANDIDATES = {
    "correct": "    def forward(self, a, b):\n        return ext.vadd(a, b)\n",
    "wrong": "    def forward(self, a, b):\n        return ext.vadd_off(a, b)\n",
    "pytorch_compute_python": "    def forward(self, a, b):\n        ext.vadd(a, b)\n        return a + b\n",
    "pytorch_compute_cpp": "    def forward(self, a, b):\n        return ext.vadd_aten(a, b)\n",
    "no_custom_kernel": "    def forward(self, a, b):\n        out = torch.empty_like(a)\n        out.copy_(a)\n        return out\n",
    "numpy_compute": "    def forward(self, a, b):\n        return torch.from_numpy(a.numpy() + b.numpy())\n",
    "constant_output": (
        "        self.cache = None\n"
        "    def forward(self, a, b):\n"
        "        if self.cache is None:\n"
        "            self.cache = ext.vadd(a, b)\n"
        "        ext.vadd(a, b)\n"
        "        return self.cache\n"
    ),
    "uninitialised_output": "    def forward(self, a, b):\n        return ext.uninitialised(a, b)\n",
    "tensor_subclass": (
        "    def forward(self, a, b):\n"
        "        class Lazy(torch.Tensor):\n"
        "            pass\n"
        "        return ext.vadd(a, b).as_subclass(Lazy)\n"
    ),
    "input_mutation": "    def forward(self, a, b):\n        return ext.vadd_clobber(a, b)\n",
    "idle_thread": (
        "    def forward(self, a, b):\n"
        "        import threading, time\n"
        "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "        return ext.vadd(a, b)\n"
    ),
    "late_thread": (
        "    def forward(self, a, b):\n"
        "        import threading, time\n"
        "        import numpy as np\n"
        "        def spin():\n"
        "            # Matrix products release the GIL: the forward returns while this works on.\n"
        "            x = np.random.rand(200, 200)\n"
        "            end = time.perf_counter() + 0.05\n"
        "            while time.perf_counter() < end:\n"
        "                x @ x\n"
        "        threading.Thread(target=spin, daemon=True).start()\n"
        "        return ext.vadd(a, b)\n"
    ),
    "late_process": (
        "    def forward(self, a, b):\n"
        "        import subprocess, sys\n"
        "        subprocess.Popen([sys.executable, '-c', 'import time\\nend = time.time() + 0.3\\nwhile time.time() < end: pass'])\n"
        "        return ext.vadd(a, b)\n"
    ),
    "clock_patched": (
        "        import time\n"
        "        real = time.perf_counter\n"
        "        time.perf_counter = lambda: real() / 2\n"
        "    def forward(self, a, b):\n"
        "        return ext.vadd(a, b)\n"
    ),
    # The same patch disguised from the static check: it changes only the worker's clock.
    # Names turned round at run time: beyond the static check's reading, so that the judge's
    # own clock is what is tested.
    "own_clock_patched": (
        "        rev = lambda s: s[::-1]\n"
        "        mod = __import__(rev('emit'))\n"
        "        real = mod.perf_counter\n"
        "        setattr(mod, rev('retnuoc_frep'), lambda: real() / 2)\n"
        "    def forward(self, a, b):\n"
        "        return ext.vadd(a, b)\n"
    ),
    "hard_coded_shape": "    def forward(self, a, b):\n        return ext.vadd(a[:MAIN_N], b[:MAIN_N])\n",
    "precision_dtype": "    def forward(self, a, b):\n        return ext.vadd(a, b).double()\n",
    "precision_flags": (
        "        torch.backends.cuda.matmul.allow_tf32 = True\n"
        "    def forward(self, a, b):\n"
        "        return ext.vadd(a, b)\n"
    ),
}


@functools.cache
def main_n() -> int:
    """The task's first input length at the small size (what a hard-coded kernel would assume);
    read once per process (a fresh Python that imports torch)."""
    env = dict(os.environ, CUDA_AGENT_TASK_SIZE="small")
    code = f"import runpy; t = runpy.run_path({str(TASK)!r}); print(t['get_inputs']()[0].numel())"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout)


@pytest.fixture(scope="module")
def ext_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("torch_extensions")


def evaluate(tmp_path, ext_dir, body, seeds="11,12,13,14,15", extra=(), task=TASK):
    cand = tmp_path / "candidate"
    cand.mkdir(parents=True)
    source = HEADER + body
    if "MAIN_N" in source:
        source = source.replace("MAIN_N", str(main_n()))
    (cand / "model_new.py").write_text(source)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext_dir), CUDA_AGENT_TASK_SIZE="small")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    out = subprocess.run(
        [sys.executable, str(EVALUATE), "candidate", "--task", str(task), "--candidate", str(cand), "--device", "cpu", "--seeds", seeds,
         "--no-compile", "--budget-s", "0.5", *extra],
        capture_output=True, text=True, env=env, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_correct_candidate_passes_and_is_timed(tmp_path, ext_dir):
    r = evaluate(tmp_path, ext_dir, CANDIDATES["correct"])
    assert r["correct"] is True, r
    assert r["times_ms"]["candidate"] > 0 and r["times_ms"]["eager"] > 0
    assert r["timing"]["candidate"]["trials"] >= 10 and r["timing"]["eager"]["trials"] == r["timing"]["candidate"]["trials"]
    assert r["details"]["checks"] == 5 and r["details"]["max_abs_error"] == 0.0 and r["details"]["second_shape"] is True
    # Every timed call was checked, warm-up rounds included.
    assert r["details"]["timed_calls_checked"] >= r["timing"]["candidate"]["trials"]
    lo, hi = r["noise_band"]["eager"]
    assert lo <= r["speedup"]["eager"] <= hi
    # The late-work allowance's control: the reference worker, tracked between its own calls
    # in the same window. On CPU an idle worker costs microseconds a gap, so the allowance
    # stays near its fixed 1 ms (a control that counted the judge or the candidate would not).
    d = r["details"]
    assert d["gaps_between_calls"] >= d["rounds"] and d["reference_gaps_between_calls"] >= d["rounds"], d
    assert 0.0 <= d["reference_cpu_between_calls_ms"] < 2.0, d


def test_a_wrong_candidate_names_the_input_set(tmp_path, ext_dir):
    r = evaluate(tmp_path, ext_dir, CANDIDATES["wrong"])
    assert r["correct"] is False
    assert r["rule"] == "wrong_output"
    assert r["reason"].startswith("wrong_output: input set 1 of 5: output 0: 1 of "), r
    assert "first at index [7]" in r["reason"], r


@pytest.mark.parametrize("name,rule", [
    ("pytorch_compute_python", "pytorch_compute"),
    ("pytorch_compute_cpp", "pytorch_compute"),
    ("no_custom_kernel", "no_custom_kernel"),
    ("constant_output", "timed_output"),
    ("uninitialised_output", "wrong_output"),
    ("input_mutation", "input_mutation"),
    ("late_thread", "late_work"),
    ("late_process", "late_work"),
    ("hard_coded_shape", "hard_coded_shape"),
    ("precision_dtype", "precision"),
    ("precision_flags", "forbidden_source"),
    ("clock_patched", "forbidden_source"),
    ("numpy_compute", "forbidden_source"),
])
def test_each_rule_break_gets_its_reason(tmp_path, ext_dir, name, rule):
    r = evaluate(tmp_path, ext_dir, CANDIDATES[name])
    assert r["correct"] is False, (name, r)
    assert r["rule"] == rule, (name, r)
    assert r["reason"].startswith(rule + ":"), (name, r)


@pytest.mark.parametrize("name", ["tensor_subclass", "idle_thread", "own_clock_patched"])
def test_what_cannot_change_a_verdict_is_no_rule_break(tmp_path, ext_dir, name):
    """A subclass output is copied out as plain bytes, an idle thread does no work, and the
    worker's own clock is not the judge's: none of them changes a verdict or a time."""
    r = evaluate(tmp_path, ext_dir, CANDIDATES[name])
    assert r["correct"] is True, (name, r)


def test_the_op_allowlist_is_configurable(tmp_path, ext_dir):
    body = CANDIDATES["pytorch_compute_python"]
    cand = tmp_path / "c1"
    r = evaluate(cand, ext_dir, body, extra=["--allow-ops", "add"])
    assert r["correct"] is True, r


def test_a_task_allows_operators_of_its_own(tmp_path, ext_dir):
    """A task's ALLOW_OPS (what `agent-runner optimize --allow-ops` writes) lets the candidate
    dispatch those operators, and the verdict says so for the server's outside observation;
    the same candidate on the task without it breaks pytorch_compute."""
    body = CANDIDATES["pytorch_compute_python"]
    task = tmp_path / "task_with_ops.py"
    task.write_text(TASK.read_text() + "\n\nALLOW_OPS = ('add',)\n")
    r = evaluate(tmp_path / "c1", ext_dir, body, task=task)
    assert r["correct"] is True, r
    assert r["allowed_ops"] == ["add"] and r["details"]["allowed_ops"] == ["add"], r
    r = evaluate(tmp_path / "c2", ext_dir, body)
    assert r["correct"] is False and r["rule"] == "pytorch_compute", r
    assert "allowed_ops" not in r


def test_a_malformed_allow_ops_is_the_tasks_error(tmp_path, ext_dir):
    task = tmp_path / "task_bad_ops.py"
    task.write_text(TASK.read_text() + "\n\nALLOW_OPS = 'add'\n")
    r = evaluate(tmp_path, ext_dir, CANDIDATES["correct"], task=task)
    assert r["correct"] is False and r["rule"] == "harness_error", r
    assert "ALLOW_OPS must be a list or tuple" in r["reason"], r


def test_a_failing_reference_is_the_evaluations_error_not_a_verdict(tmp_path, ext_dir):
    """The reference worker runs no candidate code: its failure (a task that does not run, a
    machine that cannot share memory between processes) is never a -1 for the candidate."""
    task = tmp_path / "broken_task.py"
    task.write_text(TASK.read_text().replace("        return a + b", "        raise RuntimeError('the reference broke')"))
    r = evaluate(tmp_path, ext_dir, CANDIDATES["correct"], task=task)
    assert r["correct"] is False and r["rule"] == "harness_error", r
    assert "reference worker failed" in r["reason"] and "the reference broke" in r["reason"], r


def test_a_broken_candidate_is_a_compile_failure(tmp_path, ext_dir):
    r = evaluate(tmp_path, ext_dir, "    def forward(self, a, b)\n        return a\n")
    assert r["rule"] == "compile" and "SyntaxError" in r["reason"], r


BUILD_ERROR = r'''
import sys
import time
from pathlib import Path
sys.path.append(sys.argv[1])
import cuda_agent_worker as w

cand, build = Path(sys.argv[2]), Path(sys.argv[3])
src = "#include <cstdint>\nstatic int f(int x) {\n    return y + x;\n}\n"
(cand / "model_new.py").write_text("import torch\nSRC = r\"\"\"\n" + src + "\"\"\"\n")
(cand / "kernels").mkdir()
(cand / "kernels" / "k.cpp").write_text("int g() { return 0 }\n")
(build / "main.cpp").write_text("#include <torch/extension.h>\n" + src)
(build / "src").mkdir()
notes = "".join(f"/venv/lib/python3/site-packages/torch/include/c10/x.h:{i}:1: note: candidate {i}\n" for i in range(400))
text = (
    "Error building extension 'ext': [1/3] c++ -MMD -MF main.o.d -O3 -c " + str(build / "main.cpp") + "\n"
    "FAILED: main.o\n"
    + str(build / "main.cpp") + ":4:12: error: 'y' was not declared in this scope\n"
    "    4 |     return y + x;\n"
    "      |            ^\n"
    + notes
    + str(build / "src" / "k.cpp") + ":1:21: error: expected ';' before '}' token\n"
    "ninja: build stopped: subcommand failed.\n"
)
print(w.describe_build_error(RuntimeError(text), cand))
'''


def test_a_build_error_is_located_in_the_candidates_files(tmp_path):
    """The compiler's error lines once, their locations in model_new.py (a load_inline source
    found by its text) and kernels/, gcc's snippet renumbered, torch's header notes and ninja's
    command lines dropped."""
    (tmp_path / "cand").mkdir()
    (tmp_path / "build").mkdir()
    out = subprocess.run([sys.executable, "-c", BUILD_ERROR, str(ROOT / "skills"), str(tmp_path / "cand"), str(tmp_path / "build")],
                         capture_output=True, text=True, check=True).stdout
    lines = out.strip().splitlines()
    assert lines[0] == "RuntimeError: the build failed (2 error lines; locations are in model_new.py and kernels/)", out
    assert lines[1] == "model_new.py:5:12: error: 'y' was not declared in this scope", out
    assert lines[2] == "    5 |     return y + x;", out
    assert lines[4] == "kernels/k.cpp:1:21: error: expected ';' before '}' token", out
    assert "note:" not in out and "c++ -MMD" not in out and "ninja" not in out, out
    assert len(out) < 1000, out


@pytest.mark.parametrize("source,built", [
    ("import torch\nimport torch.nn as nn\nBUF = torch.zeros(4, device='cuda')\nclass ModelNew(nn.Module):\n    def forward(self, a, b):\n        return a + b\n", True),
    ("import torch\nclass ModelNew(\n", False),
])
def test_a_cuda_build_with_the_gpu_hidden(tmp_path, source, built):
    """The server builds CUDA candidates with no GPU visible: a build names the device without
    using it, an import that touches the GPU is finished by the evaluation's worker (which sees
    one), and a candidate's own error is still a compile failure."""
    (tmp_path / "model_new.py").write_text(source)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", CUDA_AGENT_TASK_SIZE="small")
    out = subprocess.run([sys.executable, str(ROOT / "skills" / "cuda_agent_worker.py"), "build", "--task", str(TASK), "--candidate", str(tmp_path),
                          "--device", "cuda"], capture_output=True, text=True, env=env, timeout=300)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["built"] is built, r
    if built:
        assert "needs the GPU" in r["deferred"], r
    else:
        assert r["rule"] == "compile" and "SyntaxError" in r["reason"], r


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2:].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


# What the judge prints when it waits at its gate (the server's JUDGE_AT_GATE).
GATE_LINE = '{"gate": "waiting"}'


def _gated_judge(tmp_path, ext_dir, marker):
    """A judge started with --gate on a correct candidate whose import leaves `marker`."""
    cand = tmp_path / "candidate"
    cand.mkdir(parents=True)
    (cand / "model_new.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\n" + HEADER + CANDIDATES["correct"])
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext_dir), CUDA_AGENT_TASK_SIZE="small")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    p = subprocess.Popen(
        [sys.executable, str(EVALUATE), "candidate", "--task", str(TASK), "--candidate", str(cand), "--device", "cpu",
         "--no-compile", "--budget-s", "0.5", "--gate"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    # The judge reaches its gate (blocked reading stdin) only once both workers are ready:
    # torch imported and the task loaded, so that none of it is left for the device lease.
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and p.poll() is None and not _reading_a_pipe(p.pid):
        time.sleep(0.1)
    assert _reading_a_pipe(p.pid), "the judge never waited at its gate"
    workers = _children(p.pid)
    assert len(workers) == 2, "the judge did not start both workers before the gate"
    for w in workers:
        assert "libtorch_cpu.so" in Path(f"/proc/{w}/maps").read_text(), "a worker was still importing torch at the gate"
    time.sleep(1)  # a gate that did not hold would import the candidate now
    return p


def _reading_a_pipe(pid: int) -> bool:
    """Whether `pid` sleeps in a read of a pipe (the judge's gate is its stdin; its workers'
    replies are awaited in select, never in a blocking read)."""
    try:
        return "pipe_read" in Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return False


def test_nothing_of_the_candidate_runs_before_the_gate(tmp_path, ext_dir):
    marker = tmp_path / "imported"
    p = _gated_judge(tmp_path, ext_dir, marker)
    try:
        assert p.poll() is None, p.communicate()
        assert not marker.exists(), "candidate code ran before the gate opened"
        out, err = p.communicate("go\n", timeout=600)
    finally:
        p.kill()
    lines = out.strip().splitlines()
    # The server takes the device lease when it reads this line, so it comes before anything.
    assert lines[0] == GATE_LINE, lines[:3]
    r = json.loads(lines[-1])
    assert r["correct"] is True, (r, err[-2000:])
    assert marker.exists()
    stages = r["details"]["stage_s"]
    assert {"prestart", "lease_wait", "start", "check", "time"} <= set(stages), stages


def test_a_closed_gate_ends_the_evaluation_without_running_the_candidate(tmp_path, ext_dir):
    marker = tmp_path / "imported"
    p = _gated_judge(tmp_path, ext_dir, marker)
    try:
        out, err = p.communicate("", timeout=120)  # end of file: the server gave it up
    finally:
        p.kill()
    assert p.returncode != 0
    assert "closed the gate" in err, err[-2000:]
    assert not marker.exists()
    # Only the line that told the server it waits at its gate: no verdict.
    assert out.strip() == GATE_LINE, out
