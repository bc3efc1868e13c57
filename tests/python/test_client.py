"""The Python client against the real env-server binary."""

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "env-client" / "python"))
from cuda_agent_env import CudaAgentEnv, EnvError  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    binary = Path(os.environ.get("CUDA_AGENT_SERVER_BIN", ROOT / "target" / "debug" / "env-server"))
    # Sandboxed tool processes run under their own uids: the data dir's parents must be
    # searchable by them (pytest's own tmp dirs are private).
    base = Path(tempfile.mkdtemp(prefix="cuda-agent-pytest-"))
    base.chmod(0o711)
    data = base / "data"
    port = free_port()
    log = open(base / "server.log", "w")
    proc = subprocess.Popen(
        [str(binary), "--bind", f"127.0.0.1:{port}", "--data-dir", str(data), "--python", sys.executable,
         "--device", "cpu", "--skip-compile", "--api-key", "py-test-key"],
        stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}"
    proc.kill()
    proc.wait()
    shutil.rmtree(base, ignore_errors=True)


def test_auth_and_discovery(server):
    with pytest.raises(EnvError) as e:
        CudaAgentEnv(server).tasks()
    assert e.value.status == 401 and e.value.code == "unauthorized"
    env = CudaAgentEnv(server, api_key="py-test-key")
    assert env.health()["status"] == "ok"
    assert env.info()["sandbox"]["confined"] is True
    # The outside observation of the workers on the CPU: on, or why not (never silently off).
    observer = env.info()["observer"]
    assert observer["on"] is True or observer["reason"], observer
    ids = [t["id"] for t in env.tasks()["tasks"]]
    assert "L1/1_ReLU" in ids
    assert "cuda_agent_resets_total" in env.metrics()


def test_episode_round_trip(server):
    env = CudaAgentEnv(server, api_key="py-test-key")
    ep = env.reset(task="L1/1_ReLU", max_turns=10)
    assert [t["function"]["name"] for t in ep.tools][:2] == ["Bash", "Glob"]
    obs, reward, terminated, truncated, info = ep.step("Bash", {"command": "echo hi"}, request_id="fixed")
    # The command's output, then the budget line every kernel-task observation ends with (the
    # CPU default tool time: 900 s).
    assert re.fullmatch(r"hi\n\[9 of 10 tool calls left; \d+ s of 900 s tool time left\]", obs["text"]), obs["text"]
    assert reward == 0 and not terminated and not truncated
    again = env.step(ep.id, "Bash", {"command": "echo hi"}, request_id="fixed")
    assert again["info"]["replayed"] is True
    obs, *_ = ep.step("TodoWrite", {"todos": [{"content": "Profile", "status": "pending", "activeForm": "Profiling"}]})
    assert ep.state()["todos"][0]["content"] == "Profile"
    with pytest.raises(EnvError) as e:
        ep.step("NoSuchTool", {})
    assert e.value.status == 400 and e.value.code == "unknown_tool"
    obs, reward, terminated, truncated, info = ep.step("Submit", {})
    assert terminated and reward == -1.0  # model_new.py is still empty
    assert "missing_solution" in info["evaluation"]["reason"]
    kinds = [r["kind"] for r in ep.trajectory()]
    assert kinds == ["reset", "step", "step", "step", "final"]
