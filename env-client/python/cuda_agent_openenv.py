"""An OpenEnv-style client of cuda-agent episodes (needs `requests`, not `openenv`).

The shapes follow OpenEnv's client: `reset(**kwargs)` and `step(action)` return a
`StepResult(observation, reward, done)`, `state()` returns the episode's state with
`episode_id` and `step_count`, `close()` ends it; the observation carries `done`, `reward` and
`metadata` as OpenEnv's `Observation` does::

    from cuda_agent_openenv import CudaAgentAction, CudaAgentOpenEnv

    with CudaAgentOpenEnv("http://127.0.0.1:8080") as env:
        result = env.reset(task="L1/19_ReLU")
        print(result.observation.text)                   # the task prompt
        result = env.step(CudaAgentAction("Bash", {"command": "python verify.py"}))
        result = env.step(CudaAgentAction("Submit"))
        print(result.reward, result.done, result.observation.metadata["evaluation"])

`metadata` of the reset holds the episode id, the task, the OpenAI tool schemas and the
limits; of a step, the turn, tool time, truncation reason and (at the end) the evaluation. A
call the server refuses (an unknown tool, bad arguments) raises `EnvError` and takes no turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Optional, TypeVar

from cuda_agent_env import CudaAgentEnv, EnvError

__all__ = ["CudaAgentAction", "CudaAgentObservation", "CudaAgentState", "StepResult", "CudaAgentOpenEnv", "EnvError"]

ObsT = TypeVar("ObsT")


@dataclass
class StepResult(Generic[ObsT]):
    """The result of a reset or a step, as OpenEnv's client returns it."""

    observation: ObsT
    reward: Optional[float] = None
    done: bool = False


@dataclass
class CudaAgentAction:
    """One tool call: the tool's name and its arguments."""

    tool: str
    arguments: dict = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)


@dataclass
class CudaAgentObservation:
    """What the agent sees: the task prompt after a reset, the tool's output after a step."""

    text: str
    tool: Optional[str] = None
    is_error: bool = False
    data: Any = None
    done: bool = False
    reward: Optional[float] = None
    metadata: dict = field(default_factory=dict)


@dataclass
class CudaAgentState:
    """The episode's state."""

    episode_id: Optional[str] = None
    step_count: int = 0
    task: Optional[str] = None
    status: Optional[str] = None
    tool_time_s: float = 0.0
    todos: list = field(default_factory=list)
    result: Optional[dict] = None


class CudaAgentOpenEnv:
    """One episode at a time over the server's HTTP API."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 900.0):
        self.client = CudaAgentEnv(base_url, api_key=api_key, timeout=timeout)
        self._episode = None

    def reset(self, task: str | None = None, split: str | None = None, seed: int | None = None,
              task_source: str | None = None, max_turns: int | None = None,
              time_budget_s: float | None = None, **_ignored) -> StepResult[CudaAgentObservation]:
        """Starts an episode (closing a running one). Unknown keyword arguments (OpenEnv's
        `episode_id`, say) are ignored: the server names episodes."""
        self._close_running()
        self._episode = self.client.reset(task=task, split=split, seed=seed, task_source=task_source,
                                          max_turns=max_turns, time_budget_s=time_budget_s)
        ep = self._episode
        obs = CudaAgentObservation(
            text=ep.observation["text"], data=ep.observation.get("data"),
            metadata={"episode_id": ep.id, "task": ep.info["task"], "tools": ep.tools,
                      "limits": ep.info["limits"], "device": ep.info.get("device")})
        return StepResult(observation=obs, reward=None, done=False)

    def step(self, action: CudaAgentAction) -> StepResult[CudaAgentObservation]:
        """Runs one tool call."""
        if self._episode is None:
            raise RuntimeError("reset() first")
        a = self.client.step(self._episode.id, action.tool, action.arguments)
        o, info = a["observation"], a["info"]
        obs = CudaAgentObservation(
            text=o["text"], tool=o.get("tool"), is_error=o.get("is_error", False), data=o.get("data"),
            done=a["done"], reward=a["reward"],
            metadata={"turn": info["turn"], "tool_time_s": info["tool_time_s"],
                      "terminated": a["terminated"], "truncated": a["truncated"],
                      "truncation_reason": info.get("truncation_reason"),
                      "evaluation": info.get("evaluation"), "replayed": info.get("replayed", False)})
        return StepResult(observation=obs, reward=a["reward"], done=a["done"])

    def state(self) -> CudaAgentState:
        """The current episode's state (an empty state before the first reset)."""
        if self._episode is None:
            return CudaAgentState()
        s = self.client.state(self._episode.id)
        return CudaAgentState(episode_id=s["episode_id"], step_count=s["turn"], task=s["task"]["id"],
                              status=s["status"], tool_time_s=s["tool_time_s"], todos=s["todos"],
                              result=s.get("result"))

    def trajectory(self) -> list:
        """Every record of the episode's durable log."""
        return [] if self._episode is None else self._episode.trajectory()

    def _close_running(self) -> None:
        if self._episode is not None:
            try:
                if self.client.state(self._episode.id)["status"] == "running":
                    self._episode.close()
            except EnvError:
                pass

    def close(self) -> None:
        """Closes a running episode (a finished one stays readable on the server)."""
        self._close_running()
        self._episode = None

    def __enter__(self) -> "CudaAgentOpenEnv":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
