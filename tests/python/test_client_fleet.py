"""The Python client over a fleet of three real env-server processes: resets spread over them,
an episode stays on its server, one server killed and one drained mid-run: their episodes are
lost (is_server_gone), new resets and evaluations move to the survivor with the same
request_id, and a retry with that key is never a second episode or a second evaluation."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "env-client" / "python"))
import cuda_agent_env  # noqa: E402
from cuda_agent_env import CudaAgentEnv, EnvError, is_server_gone  # noqa: E402

WORDS = ["red", "blue", "green", "amber", "violet", "cyan", "olive", "pearl"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(url: str, name: str) -> float:
    text = requests.get(url + "/metrics", timeout=30).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


@pytest.fixture()
def fleet():
    binary = Path(os.environ.get("CUDA_AGENT_SERVER_BIN", ROOT / "target" / "debug" / "env-server"))
    # Sandboxed tool processes run under their own uids: the data dirs' parents must be
    # searchable by them.
    base = Path(tempfile.mkdtemp(prefix="cuda-agent-fleet-"))
    base.chmod(0o711)
    procs, urls = [], []
    for name in "abc":
        port = free_port()
        log = open(base / f"{name}.log", "w")
        procs.append(subprocess.Popen(
            [str(binary), "--bind", f"127.0.0.1:{port}", "--data-dir", str(base / name), "--python",
             sys.executable, "--device", "cpu", "--skip-compile", "--drain-grace-s", "100"],
            stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, "CUDA_AGENT_PCH": "none"}))
        urls.append(f"http://127.0.0.1:{port}")
    for url in urls:
        deadline = time.time() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=0.2).close()
                break
            except OSError:
                assert time.time() < deadline, f"{url} did not come up"
                time.sleep(0.1)
    yield procs, urls
    for p in procs:
        p.kill()
        p.wait()
    shutil.rmtree(base, ignore_errors=True)


def play(ep, word: str) -> float:
    ep.step("Write", {"file_path": "answer.txt", "content": word})
    _, reward, terminated, _, _ = ep.step("Submit", {})
    assert terminated
    return reward


def test_a_fleet_moves_new_work_off_a_killed_and_a_draining_server(fleet):
    procs, (a, b, c) = fleet
    env = CudaAgentEnv(",".join([a, b, c]), timeout=120, retries=2)

    # A keyed reset retried on its server is the same episode.
    one = CudaAgentEnv(a, timeout=120)
    first = one.reset(task="tiny/0_red", request_id="py-fleet-reset")
    again = one.reset(task="tiny/0_red", request_id="py-fleet-reset")
    assert first.id == again.id and again.info.get("replayed") is True
    assert metric(a, "cuda_agent_resets_total") == 1

    # Six episodes, two on each server.
    eps = [env.reset(task=f"tiny/{i}_{WORDS[i]}") for i in range(6)]
    assert sorted(e.server for e in eps) == sorted([a, a, b, b, c, c])
    for e in eps:
        e.step("Bash", {"command": "echo before"})

    # Another client in the process finds an episode by asking the servers.
    on_b = [e for e in eps if e.server == b]
    del cuda_agent_env._HOMES[on_b[1].id]
    assert CudaAgentEnv([a, b, c]).state(on_b[1].id)["turn"] == 1

    # A long step holds b's drain open; then b drains and c is killed.
    held: dict = {}
    worker = threading.Thread(target=lambda: held.update(
        answer=env.step(on_b[0].id, "Bash", {"command": "sleep 8; echo held"})))
    worker.start()
    while metric(b, "cuda_agent_requests_in_flight") < 2:
        time.sleep(0.05)
    time.sleep(0.5)
    procs[1].send_signal(signal.SIGTERM)
    while requests.get(b + "/v1/ready", timeout=30).ok:
        time.sleep(0.05)
    procs[2].kill()
    procs[2].wait()

    # b's and c's episodes are lost, with the reason; a's get their verdicts.
    for e in eps:
        if e is on_b[0]:
            continue
        if e.server == a:
            assert play(e, WORDS[eps.index(e)]) == 1.0
            continue
        with pytest.raises((EnvError, requests.ConnectionError)) as lost:
            e.step("Bash", {"command": "echo after"})
        assert is_server_gone(lost.value), lost.value

    # New work lands on the survivor.
    for i in range(3):
        ep = env.reset(task=f"tiny/{i}_{WORDS[i]}")
        assert ep.server == a
        assert play(ep, WORDS[i]) == 1.0

    # An evaluation moves to a; the same key again is answered, not judged twice.
    before = metric(a, "cuda_agent_evaluations_total")
    verdict = env.evaluate("tiny/1_blue", "blue", request_id="py-fleet-eval")
    assert verdict["reward"] == 1.0
    assert env.evaluate("tiny/1_blue", "blue", request_id="py-fleet-eval") == verdict
    assert metric(a, "cuda_agent_evaluations_total") == before + 1

    worker.join(timeout=120)
    assert "held" in held["answer"]["observation"]["text"], "the step admitted before the drain is answered"
    assert procs[1].wait(timeout=120) == 0, "a drained server exits 0"


def test_the_adapters_state_an_episode_lost_with_its_server(fleet):
    from cuda_agent_trl import episode_reward, trl_environment
    from cuda_agent_verl import CudaAgentVerlTool, finish_episode

    procs, (a, b, c) = fleet
    urls = ",".join([a, b, c])
    trl = trl_environment(urls)()
    trl.reset(task="tiny/0_red")
    trl.Bash(command="echo before")
    home = CudaAgentEnv(urls)._home(trl.episode_id)
    # A verl trajectory's episode on the same server.
    env = CudaAgentEnv(urls)
    verl_episode = next(e for e in (env.reset(task="tiny/1_blue") for _ in range(3)) if e.server == home)
    procs[[a, b, c].index(home)].kill()

    with pytest.raises(ValueError, match="lost"):
        trl.Bash(command="echo after")
    assert trl.lost and trl.done
    assert episode_reward(trl) == 0.0

    tool = CudaAgentVerlTool({"base_url": urls}, {"function": {"name": "Bash"}})
    text, _, metrics = tool._step(verl_episode.id, {"command": "echo after"})
    assert "lost" in text and metrics == {"lost": 1}
    assert finish_episode(env, verl_episode.id)["lost"] is True
