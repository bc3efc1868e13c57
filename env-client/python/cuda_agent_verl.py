"""verl integration of cuda-agent episodes: an agent loop that gives each trajectory its own
episode, and a tool class that runs the model's tool calls in it (needs `requests`; the agent
loop needs verl).

verl's ToolAgentLoop creates and releases a tool instance around every call, so a tool alone
cannot keep an episode for a trajectory. `CudaAgentLoop` (registered as `cuda_agent`) resets
an episode at the start of each trajectory, runs verl's own tool loop inside it (the episode id
travels in a context variable that the tool calls see), submits what is left if the model
stopped without Submit, and puts the final reward in the output's `reward_score`.

Configuration (the tool file lists the server's tools with their own schemas)::

    python env-client/python/cuda_agent_verl.py tool-config --server http://127.0.0.1:8080 > cuda_agent_tools.yaml

    # the trainer's overrides
    actor_rollout_ref.rollout.multi_turn.enable=True
    actor_rollout_ref.rollout.multi_turn.tool_config_path=cuda_agent_tools.yaml
    actor_rollout_ref.rollout.multi_turn.format=hermes
    actor_rollout_ref.rollout.agent.agent_loop_config_path=cuda_agent_loop.yaml

    # cuda_agent_loop.yaml
    - name: cuda_agent
      _target_: cuda_agent_verl.CudaAgentLoop

Each dataset row names its task in `extra_info.cuda_agent` (`{"task": "L1/19_ReLU"}`, or
`split`/`seed`, or `task_source`, plus `max_turns`) and sets `agent_name: cuda_agent`; the
episode's task prompt is appended to the row's prompt as a user message. The server URL and
key come from `CUDA_AGENT_URL` and `CUDA_AGENT_API_KEY` (or the tool config's `base_url`); the
URL may name a fleet (several URLs separated by commas, or `dns+http://NAME:PORT`; see
`cuda_agent_env`). A trajectory whose server goes away or drains ends at once: its outcome
has `lost: True` and reward 0.0 (leave it out of training).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import sys
from typing import Any

from cuda_agent_env import CudaAgentEnv, EnvError, is_server_gone

__all__ = ["CURRENT_EPISODE", "CudaAgentVerlTool", "tool_config", "episode_outcome"]

# The episode of the trajectory being rolled out (set by CudaAgentLoop around verl's loop).
CURRENT_EPISODE: contextvars.ContextVar[str | None] = contextvars.ContextVar("cuda_agent_episode", default=None)

# Final rewards of episodes that ended during a tool call, by episode id.
_OUTCOMES: dict[str, dict] = {}

try:  # verl's base class and response type, when verl is installed
    from verl.tools.base_tool import BaseTool as _Base
    from verl.tools.schemas import ToolResponse as _ToolResponse
except ImportError:  # the adapter's contract is usable (and tested) without verl
    _Base = object
    _ToolResponse = None


def _client(base_url: str | None = None) -> CudaAgentEnv:
    return CudaAgentEnv(base_url or os.environ.get("CUDA_AGENT_URL", "http://127.0.0.1:8080"),
                        api_key=os.environ.get("CUDA_AGENT_API_KEY"))


def episode_outcome(episode_id: str) -> dict | None:
    """`{"reward", "evaluation", "done"}` of an episode that ended during a tool call."""
    return _OUTCOMES.get(episode_id)


class CudaAgentVerlTool(_Base):
    """One of the server's tools as a verl tool: `execute` runs a step of the current
    trajectory's episode. A call the server refuses answers with the reason, no turn taken."""

    def __init__(self, config: dict, tool_schema: Any):
        self.config = config or {}
        self.tool_schema = tool_schema
        schema = tool_schema.model_dump() if hasattr(tool_schema, "model_dump") else tool_schema
        self.name = schema["function"]["name"]
        self.client = _client(self.config.get("base_url"))

    def get_openai_tool_schema(self):
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs):
        instance_id = instance_id or os.urandom(8).hex()
        # Newer verl expects (instance_id, ToolResponse); older, the id alone.
        return (instance_id, _ToolResponse()) if _ToolResponse is not None else instance_id

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        episode = kwargs.get("episode_id") or CURRENT_EPISODE.get()
        if episode is None:
            text, reward, metrics = "error: no cuda-agent episode for this trajectory (use the cuda_agent agent loop)", 0.0, {}
        else:
            text, reward, metrics = await asyncio.to_thread(self._step, episode, parameters)
        return (_ToolResponse(text=text) if _ToolResponse is not None else {"text": text}), reward, metrics

    def _step(self, episode: str, parameters: dict[str, Any]) -> tuple[str, float, dict]:
        if episode in _OUTCOMES:
            return f"error: the episode has ended (reward {_OUTCOMES[episode]['reward']})", 0.0, {}
        try:
            a = self.client.step(episode, self.name, parameters if parameters is not None else {})
        except Exception as e:
            if is_server_gone(e):
                _OUTCOMES[episode] = _lost(e)
                return "error: the episode's server went away; the episode is lost", 0.0, {"lost": 1}
            if isinstance(e, EnvError) and 400 <= e.status < 500:
                return f"error ({e.code}): {e.message}", 0.0, {"refused": 1}
            raise
        text = a["observation"]["text"]
        if a["done"]:
            _OUTCOMES[episode] = {"reward": a["reward"], "evaluation": a["info"].get("evaluation"), "done": True}
            text += f"\n[episode ended: reward {a['reward']}]"
        return text, 0.0, {"turn": a["info"]["turn"]}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        episode = kwargs.get("episode_id") or CURRENT_EPISODE.get()
        outcome = _OUTCOMES.get(episode or "")
        return outcome["reward"] if outcome else 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        return None


def tool_config(base_url: str) -> dict:
    """verl's tool file for the server's tools, with the schemas the server reports."""
    client = _client(base_url)
    probe = client.reset(split="tiny") if "tiny" in client.tasks().get("splits", []) else client.reset()
    try:
        schemas = probe.tools
    finally:
        probe.close()
    return {"tools": [{"class_name": "cuda_agent_verl.CudaAgentVerlTool",
                       "config": {"type": "native", "base_url": base_url},
                       "tool_schema": s} for s in schemas]}


def _lost(e: BaseException) -> dict:
    return {"reward": 0.0, "evaluation": None, "done": True, "lost": True, "note": str(e)}


def finish_episode(client: CudaAgentEnv, episode: str) -> dict:
    """The episode's outcome, submitting it first if the trajectory ended without Submit."""
    outcome = _OUTCOMES.pop(episode, None)
    if outcome is None:
        try:
            a = client.step(episode, "Submit", {})
            outcome = {"reward": a["reward"], "evaluation": a["info"].get("evaluation"), "done": True}
        except Exception as e:
            if not is_server_gone(e) and not isinstance(e, EnvError):
                raise
            outcome = _lost(e) if is_server_gone(e) else _ended(client, episode, e)
    return outcome


def _ended(client: CudaAgentEnv, episode: str, e: EnvError) -> dict:
    """An episode a limit ended meanwhile: its state has the result."""
    try:
        s = client.state(episode)
    except Exception as gone:
        if is_server_gone(gone):
            return _lost(gone)
        raise
    result = s.get("result") or {}
    return {"reward": result.get("reward", -1.0), "evaluation": result or None, "done": True, "note": f"{e.code}"}


try:
    from verl.experimental.agent_loop.agent_loop import register as _register
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop as _ToolAgentLoop
except ImportError:
    _ToolAgentLoop = None

if _ToolAgentLoop is not None:

    @_register("cuda_agent")
    class CudaAgentLoop(_ToolAgentLoop):
        """verl's tool loop, one cuda-agent episode per trajectory, the final reward as the
        trajectory's score."""

        async def run(self, sampling_params: dict[str, Any], **kwargs):
            client = _client()
            spec = dict((kwargs.get("extra_info") or {}).get("cuda_agent") or {})
            episode = await asyncio.to_thread(client.reset, **spec)
            kwargs["raw_prompt"] = list(kwargs.get("raw_prompt") or []) + [
                {"role": "user", "content": episode.observation["text"]}]
            token = CURRENT_EPISODE.set(episode.id)
            try:
                output = await super().run(sampling_params, **kwargs)
            finally:
                CURRENT_EPISODE.reset(token)
            outcome = await asyncio.to_thread(finish_episode, client, episode.id)
            output.reward_score = outcome["reward"]
            output.extra_fields["cuda_agent"] = {"episode_id": episode.id, **outcome}
            return output


def main(argv: list[str]) -> int:
    if len(argv) >= 1 and argv[0] == "tool-config":
        server = argv[argv.index("--server") + 1] if "--server" in argv else os.environ.get(
            "CUDA_AGENT_URL", "http://127.0.0.1:8080")
        # JSON is YAML: verl reads this file as it is.
        print(json.dumps(tool_config(server), indent=2))
        return 0
    print("usage: cuda_agent_verl.py tool-config [--server URL]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
