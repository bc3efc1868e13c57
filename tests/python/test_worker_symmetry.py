"""Both workers reach the timed rounds in the same state. Each contestant's time is measured in
its own worker process, so whatever one worker was asked to do before the rounds and the other
was not is a bias between them. The checked calls are traced (PyTorch's profiler and a dispatch
mode): on a GPU host, PyTorch's profiler sets up Kineto and CUPTI in its process, and what it
leaves behind has slowed later work (pytorch/pytorch#144455), so a trace on the candidate's side
alone could slow every later call of the candidate's worker and none of the reference's."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT / "skills"))
import cuda_agent_judge as judge  # noqa: E402

TASK = ROOT / "kernelbench" / "tasks" / "level1" / "2_Add.py"

# Computes with PyTorch: the trace of its first checked call refuses it, after the reference's
# own checked call for that input set has run.
CANDIDATE = "import torch.nn as nn\n\n\nclass ModelNew(nn.Module):\n    def forward(self, a, b):\n        return a + b\n"


def test_the_reference_check_is_traced_as_the_candidates_is(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_AGENT_TASK_SIZE", "small")
    cand = tmp_path / "cand"
    cand.mkdir()
    (cand / "model_new.py").write_text(CANDIDATE)
    (tmp_path / "work").mkdir()
    runs: list = []
    request = judge.WorkerLink.request

    def noting(self, msg, timeout):
        if msg.get("op") == "run" and msg.get("model") == "check":
            runs.append((self.name, bool(msg.get("trace"))))
        return request(self, msg, timeout)

    monkeypatch.setattr(judge.WorkerLink, "request", noting)
    opts = judge.Options(device="cpu", time=False, compile=False, seeds=[1], setup_timeout=120, call_timeout=60)
    result = judge.evaluate(TASK, cand, opts, workdir=tmp_path / "work")
    assert result["rule"] == "pytorch_compute", result
    assert ("candidate", True) in runs, runs
    assert ("reference", True) in runs, f"only the candidate's check was traced: {runs}"
    # Every checked call traced alike on both sides.
    assert {traced for _, traced in runs} == {True}, runs
