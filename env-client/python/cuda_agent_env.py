"""Python client of the cuda-agent environment server (one module, needs `requests`).

    from cuda_agent_env import CudaAgentEnv
    env = CudaAgentEnv("http://127.0.0.1:8080")
    ep = env.reset(task="L1/1_ReLU")
    obs, reward, terminated, truncated, info = ep.step("Bash", {"command": "python verify.py"})

Every step carries a request_id, and a step that fails in transport is retried with the same
id, so it never runs twice on the server.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import requests

__all__ = ["CudaAgentEnv", "Episode", "EnvError"]


class EnvError(Exception):
    """An error answer from the server: HTTP status, error code and message."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"HTTP {status} {code}: {message}")
        self.status, self.code, self.message = status, code, message

    @property
    def retryable(self) -> bool:
        return self.status in (429, 502, 503, 504)


class CudaAgentEnv:
    """A connection to one server."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 900.0, retries: int = 3):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.retries = retries
        self.session = requests.Session()
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        resp = self.session.request(method, self.base_url + path, json=body, timeout=self.timeout)
        if resp.ok:
            return resp.json() if resp.headers.get("content-type", "").startswith("application/json") else resp.text
        try:
            err = resp.json()["error"]
            raise EnvError(resp.status_code, err["code"], err["message"])
        except (ValueError, KeyError, TypeError):
            raise EnvError(resp.status_code, "http_error", resp.text) from None

    def health(self) -> dict:
        return self._call("GET", "/v1/health")

    def info(self) -> dict:
        return self._call("GET", "/v1/info")

    def tasks(self) -> dict:
        return self._call("GET", "/v1/tasks")

    def metrics(self) -> str:
        return self._call("GET", "/metrics")

    def reset(self, task: str | None = None, split: str | None = None, seed: int | None = None,
              max_turns: int | None = None, time_budget_s: float | None = None,
              task_source: str | None = None) -> "Episode":
        """Starts an episode: a task by id, one sampled from `split` with `seed`, or your own
        (`task_source`: a Python file defining Model, get_inputs and get_init_inputs)."""
        body: dict[str, Any] = {k: v for k, v in {"task": task, "split": split, "seed": seed,
                                                  "task_source": task_source}.items() if v is not None}
        opts = {k: v for k, v in {"max_turns": max_turns, "time_budget_s": time_budget_s}.items() if v is not None}
        if opts:
            body["options"] = opts
        answer = self._call("POST", "/v1/episodes", body)
        return Episode(self, answer)

    def step(self, episode_id: str, tool: str, arguments: dict | str | None = None, request_id: str | None = None) -> dict:
        body = {"action": {"tool": tool, "arguments": arguments if arguments is not None else {}},
                "request_id": request_id or uuid.uuid4().hex}
        for attempt in range(self.retries + 1):
            try:
                return self._call("POST", f"/v1/episodes/{episode_id}/step", body)
            except (requests.ConnectionError, requests.Timeout):
                if attempt == self.retries:
                    raise
            except EnvError as e:
                if not e.retryable or attempt == self.retries:
                    raise
            time.sleep(0.2 * 2 ** attempt)
        raise AssertionError("unreachable")

    def state(self, episode_id: str) -> dict:
        return self._call("GET", f"/v1/episodes/{episode_id}")

    def trajectory(self, episode_id: str) -> dict:
        return self._call("GET", f"/v1/episodes/{episode_id}/trajectory")

    def close(self, episode_id: str) -> dict:
        return self._call("DELETE", f"/v1/episodes/{episode_id}")

    def evaluate(self, task: str | dict, solution: str | dict, **options) -> dict:
        """`task`: an id or {"source": ...}; `solution`: model_new.py text or {"files": {...}}."""
        body: dict[str, Any] = {"task": task, "solution": solution}
        if options:
            body["options"] = options
        return self._call("POST", "/v1/evaluate", body)


class Episode:
    """One episode, with a Gymnasium-style `step`."""

    def __init__(self, env: CudaAgentEnv, reset_answer: dict):
        self.env = env
        self.id: str = reset_answer["episode_id"]
        self.observation: dict = reset_answer["observation"]
        self.info: dict = reset_answer["info"]
        self.tools: list = self.info["tools"]
        self.done = False

    def step(self, tool: str, arguments: dict | str | None = None, request_id: str | None = None):
        """Returns (observation, reward, terminated, truncated, info)."""
        a = self.env.step(self.id, tool, arguments, request_id)
        self.done = a["done"]
        return a["observation"], a["reward"], a["terminated"], a["truncated"], a["info"]

    def state(self) -> dict:
        return self.env.state(self.id)

    def trajectory(self) -> list:
        return self.env.trajectory(self.id)["records"]

    def close(self) -> dict:
        return self.env.close(self.id)
