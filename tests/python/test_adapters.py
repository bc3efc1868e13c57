"""The trainer adapters (TRL environment_factory, OpenEnv-style client, verl tool and agent
loop) against the real env-server binary. TRL and verl themselves are not installed here:
what is checked is the contract each framework relies on (for TRL, the tool schemas are built
with transformers' get_json_schema, as TRL builds them)."""

import asyncio
import json
import os
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
from cuda_agent_openenv import CudaAgentAction, CudaAgentOpenEnv, StepResult  # noqa: E402
from cuda_agent_trl import CudaAgentToolEnv, episode_reward, trl_environment  # noqa: E402
import cuda_agent_verl  # noqa: E402

KEY = "adapter-test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    binary = Path(os.environ.get("CUDA_AGENT_SERVER_BIN", ROOT / "target" / "debug" / "env-server"))
    base = Path(tempfile.mkdtemp(prefix="cuda-agent-adapters-"))
    base.chmod(0o711)
    port = free_port()
    log = open(base / "server.log", "w")
    proc = subprocess.Popen(
        [str(binary), "--bind", f"127.0.0.1:{port}", "--data-dir", str(base / "data"), "--python", sys.executable,
         "--device", "cpu", "--skip-compile"],
        stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, "CUDA_AGENT_API_KEY": KEY})
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


def server_tools(url: str) -> list[dict]:
    ep = CudaAgentEnv(url, api_key=KEY).reset(task="L1/1_ReLU")
    ep.close()
    return ep.tools


# TRL's Grep arguments are Python names; the server's are ripgrep's flags.
PY_NAMES = {"type": "file_type", "-i": "case_insensitive", "-C": "context"}


def test_trl_tools_are_the_servers_with_schemas_trl_can_build(server):
    from transformers.utils import get_json_schema

    cls = trl_environment(server, api_key=KEY)
    # What TRL offers as tools: every public method but reset.
    public = sorted(n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n)) and n != "reset")
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in server_tools(server)}
    assert public == sorted(tools)
    for name, params in tools.items():
        schema = get_json_schema(getattr(cls(), name))["function"]
        assert schema["name"] == name
        mine = set(schema["parameters"].get("properties", {}))
        required = {PY_NAMES.get(p, p) for p in params.get("required", [])}
        assert required <= mine, (name, required, mine)
        known = {PY_NAMES.get(p, p) for p in params.get("properties", {})}
        assert mine <= known, (name, mine - known)


def test_trl_episode_round_trip(server):
    cls = trl_environment(server, api_key=KEY, max_turns=20)
    env = cls()
    # TRL passes every dataset column; the ones that are not reset arguments are ignored.
    prompt = env.reset(task="L1/1_ReLU", prompt=[{"role": "user", "content": "go"}])
    assert "L1/1_ReLU" in prompt and env.episode_id
    assert "hi" in env.Bash(command="echo hi")
    env.Write(file_path="model_new.py", content="x = 1\n")
    assert "x = 1" in env.Read(file_path="model_new.py")
    assert "model_new.py" in env.Grep(pattern="x = ", output_mode="files_with_matches")
    with pytest.raises(ValueError, match="bad_arguments"):
        env.MultiEdit(file_path="model_new.py", edits=[{"bad": 1}])
    turn = CudaAgentEnv(server, api_key=KEY).state(env.episode_id)["turn"]
    assert turn == 4, "the refused call took no turn"
    out = env.Submit()
    assert env.done and env.reward == -1.0 and "episode ended" in out
    assert env.result["correct"] is False
    with pytest.raises(ValueError, match="ended"):
        env.Bash(command="true")
    assert episode_reward(env) == -1.0
    # An unfinished episode is submitted when the instance is reset for the next rollout ...
    assert "L1/1_ReLU" in env.reset(task="L1/1_ReLU")
    old = env.episode_id
    env.reset(split="level1", seed=3)
    assert CudaAgentEnv(server, api_key=KEY).state(old)["status"] == "terminated"
    # ... or when the reward function asks for its reward.
    assert not env.done
    assert episode_reward(env) == -1.0 and env.done and env.result["correct"] is False
    assert episode_reward(cls()) == 0.0, "no episode, no reward"


def test_trl_environment_rejects_unknown_defaults():
    with pytest.raises(TypeError):
        trl_environment("http://127.0.0.1:1", tsk="typo")
    assert issubclass(trl_environment("http://127.0.0.1:1"), CudaAgentToolEnv)


def test_openenv_client_reset_step_state(server):
    with CudaAgentOpenEnv(server, api_key=KEY) as env:
        assert env.state().episode_id is None
        r = env.reset(task="L1/1_ReLU", max_turns=10, episode_id="ignored")
        assert isinstance(r, StepResult) and not r.done and r.reward is None
        assert "L1/1_ReLU" in r.observation.text
        assert r.observation.metadata["limits"]["max_turns"] == 10
        names = [t["function"]["name"] for t in r.observation.metadata["tools"]]
        assert "Bash" in names and "Submit" in names
        r = env.step(CudaAgentAction("Bash", {"command": "echo hello"}))
        assert r.observation.text.startswith("hello") and r.reward == 0 and not r.done
        assert r.observation.metadata["turn"] == 1
        with pytest.raises(EnvError) as e:
            env.step(CudaAgentAction("NoSuchTool"))
        assert e.value.status == 400
        s = env.state()
        assert s.step_count == 1 and s.status == "running" and s.task == "L1/1_ReLU"
        r = env.step(CudaAgentAction("Submit"))
        assert r.done and r.reward == -1.0 and r.observation.done
        assert r.observation.metadata["evaluation"]["correct"] is False
        assert [x["kind"] for x in env.trajectory()] == ["reset", "step", "step", "final"]
        # A second reset starts afresh (the finished episode stays readable) ...
        finished = env.state().episode_id
        env.reset(task="L1/1_ReLU")
        running = env.state().episode_id
        assert CudaAgentEnv(server, api_key=KEY).state(finished)["status"] == "terminated"
    # ... and leaving the block closes the running one: gone for the API.
    with pytest.raises(EnvError) as e:
        CudaAgentEnv(server, api_key=KEY).state(running)
    assert e.value.status == 404


def test_verl_tool_config_and_tool_in_an_episode(server, monkeypatch):
    monkeypatch.setenv("CUDA_AGENT_API_KEY", KEY)
    cfg = cuda_agent_verl.tool_config(server)
    names = [t["tool_schema"]["function"]["name"] for t in cfg["tools"]]
    assert names == [t["function"]["name"] for t in server_tools(server)]
    assert all(t["class_name"] == "cuda_agent_verl.CudaAgentVerlTool" for t in cfg["tools"])
    # The command-line form prints the same file (JSON, which YAML reads).
    out = subprocess.run([sys.executable, str(ROOT / "env-client" / "python" / "cuda_agent_verl.py"),
                          "tool-config", "--server", server], capture_output=True, text=True,
                         env={**os.environ, "CUDA_AGENT_API_KEY": KEY}, check=True)
    assert json.loads(out.stdout) == cfg

    tools = {t["tool_schema"]["function"]["name"]: cuda_agent_verl.CudaAgentVerlTool(t["config"], t["tool_schema"])
             for t in cfg["tools"]}
    client = CudaAgentEnv(server, api_key=KEY)
    episode = client.reset(task="L1/1_ReLU")

    async def trajectory():
        token = cuda_agent_verl.CURRENT_EPISODE.set(episode.id)
        try:
            answers = []
            for name, params in [("Bash", {"command": "echo from-verl"}), ("Write", {"content": 1}),
                                 ("Submit", {})]:
                created = await tools[name].create()
                instance = created[0] if isinstance(created, tuple) else created
                answers.append(await tools[name].execute(instance, params))
                await tools[name].release(instance)
            return answers, await tools["Submit"].calc_reward("x")
        finally:
            cuda_agent_verl.CURRENT_EPISODE.reset(token)

    answers, reward = asyncio.run(trajectory())
    text = [a[0]["text"] if isinstance(a[0], dict) else a[0].text for a in answers]
    assert "from-verl" in text[0]
    assert text[1].startswith("error (bad_arguments)"), text[1]
    assert "episode ended" in text[2] and reward == -1.0
    outcome = cuda_agent_verl.finish_episode(client, episode.id)
    assert outcome["reward"] == -1.0 and outcome["evaluation"]["correct"] is False
    # Without an episode (outside the agent loop) a call says so instead of failing.
    lone = asyncio.run(tools["Bash"].execute("i", {"command": "true"}))
    assert "no cuda-agent episode" in (lone[0]["text"] if isinstance(lone[0], dict) else lone[0].text)
