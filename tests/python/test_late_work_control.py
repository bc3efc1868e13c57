"""The late-work control: the reference worker's own process, idle between its calls, says what
an idle worker costs on this machine. Its torch.compile starts a pool of compile processes
(1.8 s of CPU landed in one timing window on an H100 host): they are not counted, and whatever
the control says, it cannot open the allowance to the CPU of a candidate that finishes its
calls from a host thread (7.9 ms on that host)."""

import subprocess
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2] / "skills"))
import cuda_agent_judge as judge  # noqa: E402

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
PARENT = f"import subprocess, sys, time\nsubprocess.run([sys.executable, '-c', {BURN!r}])\ntime.sleep(30)\n"


def test_the_control_counts_its_own_process_and_a_candidate_counts_its_children():
    p = subprocess.Popen([sys.executable, "-c", PARENT])
    try:
        own = judge.ProcessCpu(p.pid, descendants=False)
        tree = judge.ProcessCpu(p.pid)
        before_own, before_tree = own.total()[0], tree.total()[0]
        # The child burns 0.3 s while both are read; the parent sleeps.
        deadline = time.time() + 20
        while time.time() < deadline and tree.total()[0] - before_tree < 0.25e9:
            time.sleep(0.02)
        assert tree.total()[0] - before_tree >= 0.25e9, "the child's CPU was not seen in the tree"
        assert own.total()[0] - before_own < 0.05e9, "the control counted a process it started"
    finally:
        p.kill()
        p.wait()


def test_no_control_opens_the_allowance_to_late_host_work():
    # A control as large as the compile pool's start-up made it on the H100 host.
    assert judge.late_work_allowance_ms(30.0, 1826.0) == 1.0 + 0.15 + judge.LATE_WORK_CONTROL_CAP_MS
    assert judge.late_work_allowance_ms(30.0, 1826.0) < 7.9
    # The honest H100 runs: candidates used up to 2.2 ms against controls of 1.2-1.8 ms.
    assert judge.late_work_allowance_ms(100.0, 1.2) > 2.2
    assert judge.late_work_allowance_ms(100.0, 1.82) > 2.2
