"""Both workers reach the timed rounds in the same state. Each contestant's time is measured in
its own worker process, so whatever one worker was asked to do before the rounds and the other
was not is a bias between them. The checked calls are traced (PyTorch's profiler and a dispatch
mode): on a GPU host, PyTorch's profiler leaves CUPTI set up in its process after it ends
(pytorch/pytorch#144455), so a trace on the candidate's side alone would slow every later call
of the candidate's worker and none of the reference's."""

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2] / "skills"))
import cuda_agent_judge as judge  # noqa: E402

TASK = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, a, b):
        return a + b


def get_inputs():
    return [torch.randn(1000), torch.randn(1000)]


def get_init_inputs():
    return []
'''

# Computes with PyTorch: the trace of its first checked call refuses it, after the reference's
# own checked call for that input set has run.
CANDIDATE = "import torch.nn as nn\n\n\nclass ModelNew(nn.Module):\n    def forward(self, a, b):\n        return a + b\n"


def test_the_reference_check_is_traced_as_the_candidates_is(tmp_path, monkeypatch):
    (tmp_path / "task.py").write_text(TASK)
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
    result = judge.evaluate(tmp_path / "task.py", cand, opts, workdir=tmp_path / "work")
    assert result["rule"] == "pytorch_compute", result
    assert ("candidate", True) in runs, runs
    assert ("reference", True) in runs, f"only the candidate's check was traced: {runs}"
    # Every checked call traced alike on both sides.
    assert {traced for _, traced in runs} == {True}, runs
