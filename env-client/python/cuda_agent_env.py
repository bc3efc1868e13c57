"""Python client of the cuda-agent environment server (one module, needs `requests`).

    from cuda_agent_env import CudaAgentEnv
    env = CudaAgentEnv("http://127.0.0.1:8080")
    ep = env.reset(task="L1/1_ReLU")
    obs, reward, terminated, truncated, info = ep.step("Bash", {"command": "python verify.py"})

Every step carries a request_id, and a step that fails in transport is retried with the same
id, so it never runs twice on the server.

A fleet: give several URLs (a list, or one string separated by commas) or
`dns+http://NAME:PORT` for every address a name resolves to (a Kubernetes headless Service;
resolved again every `resolve_every` seconds). A reset or an evaluation goes to the servers in
turn and moves on, with the same request_id, from one that is gone (connection refused),
draining (503 `draining`) or full; an episode stays on its server, and a step that finds its
server gone or draining raises an error for which `is_server_gone(e)` is true: the episode is
lost, not failed.
"""

from __future__ import annotations

import collections
import socket
import threading
import time
import uuid
from typing import Any

import requests
import urllib3

__all__ = ["CudaAgentEnv", "Episode", "EnvError", "is_server_gone"]

DNS_SCHEME = "dns+http://"

# Episode id -> the base URL of its server, for every client in the process (ids are unique),
# so a client made elsewhere (an adapter's tool) finds an episode another one started.
_HOMES: "collections.OrderedDict[str, str]" = collections.OrderedDict()
_HOMES_MAX = 65536
_HOMES_LOCK = threading.Lock()


def _remember(episode_id: str, base: str) -> None:
    with _HOMES_LOCK:
        _HOMES[episode_id] = base
        while len(_HOMES) > _HOMES_MAX:
            _HOMES.popitem(last=False)


def _refused(e: Exception) -> bool:
    """The connection was refused (nothing reached the server), as against one cut mid-request."""
    reason = getattr(e.args[0], "reason", None) if e.args else None
    return isinstance(reason, urllib3.exceptions.NewConnectionError) or isinstance(
        e.args[0] if e.args else None, urllib3.exceptions.NewConnectionError)


def is_server_gone(e: BaseException) -> bool:
    """Whether an error means the server went away or is draining: an episode on it is lost."""
    if isinstance(e, EnvError):
        return e.draining
    if isinstance(e, requests.ConnectTimeout):
        return True  # an address that no longer answers (a pod that is gone)
    return isinstance(e, requests.ConnectionError) and not isinstance(e, requests.Timeout)


class EnvError(Exception):
    """An error answer from the server: HTTP status, error code and message."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"HTTP {status} {code}: {message}")
        self.status, self.code, self.message = status, code, message

    @property
    def retryable(self) -> bool:
        return self.status in (429, 502, 503, 504)

    @property
    def draining(self) -> bool:
        """The server drains or stopped: it takes no new work, and retrying there is futile."""
        return self.status == 503 and self.code in ("draining", "drained")

    @property
    def full(self) -> bool:
        """The server has no room for the work now; another one may."""
        return self.status == 429 or (self.status == 503 and self.code in (
            "at_capacity", "host_busy", "busy", "too_many_connections"))


class CudaAgentEnv:
    """A connection to one server, or to a fleet (see the module's docstring)."""

    def __init__(self, base_url: str | list[str], api_key: str | None = None, timeout: float = 900.0,
                 retries: int = 3, resolve_every: float = 30.0, down_for: float = 10.0,
                 connect_timeout: float = 10.0):
        urls = base_url.split(",") if isinstance(base_url, str) else list(base_url)
        self.sources = [u.strip().rstrip("/") for u in urls if u.strip()]
        if not self.sources:
            raise ValueError("no server URL")
        for u in self.sources:
            if not u.startswith(("http://", "https://", DNS_SCHEME)):
                raise ValueError(f"bad server URL {u!r}: expected http://, https:// or {DNS_SCHEME}")
        self.base_url = self.sources[0]
        self.timeout = timeout
        self.retries = retries
        self.resolve_every = resolve_every
        self.down_for = down_for
        self.connect_timeout = connect_timeout
        self._servers: list[str] = [u for u in self.sources if not u.startswith(DNS_SCHEME)]
        self._resolved_at: float | None = None
        self._down: dict[str, float] = {}
        self._next = 0
        self._lock = threading.Lock()
        self.session = requests.Session()
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"

    # The fleet.

    def servers(self) -> list[str]:
        """The servers' base URLs now (names resolved again when due)."""
        names = [u for u in self.sources if u.startswith(DNS_SCHEME)]
        now = time.monotonic()
        if names and (self._resolved_at is None or now - self._resolved_at >= self.resolve_every):
            found: list[str] = []
            failure: Exception | None = None
            for u in names:
                host, _, port = u[len(DNS_SCHEME):].rpartition(":")
                try:
                    infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
                except (OSError, ValueError) as e:
                    failure = e
                    continue
                for family, _, _, _, addr in infos:
                    ip = f"[{addr[0]}]" if family == socket.AF_INET6 else addr[0]
                    found.append(f"http://{ip}:{addr[1]}")
            plain = [u for u in self.sources if not u.startswith(DNS_SCHEME)]
            with self._lock:
                if found:
                    self._servers = plain + sorted(set(found))
                elif failure is not None and len(self._servers) == len(plain):
                    raise EnvError(0, "resolve_failed", f"resolving {names}: {failure}")
                self._resolved_at = now
        return list(self._servers)

    def _pick(self, tried: set[str]) -> str | None:
        servers = [s for s in self.servers() if s not in tried]
        now = time.monotonic()
        up = [s for s in servers if self._down.get(s, 0.0) <= now] or servers
        if not up:
            return None
        with self._lock:
            self._next += 1
            return up[self._next % len(up)]

    def _failover(self, method: str, path: str, body: Any) -> tuple[str, Any]:
        """Sends new work to the servers in turn, as the module's docstring says."""
        tried: set[str] = set()
        again: str | None = None
        asked = 0
        last: Exception | None = None
        while True:
            base = again or self._pick(tried)
            again = None
            if base is None:
                raise last or EnvError(0, "no_server", "no server to send the request to")
            try:
                return base, self._call(method, path, body, base=base)
            except requests.ConnectTimeout as e:
                last = e  # nothing was sent: an address that no longer answers
                self._down[base] = time.monotonic() + self.down_for
            except requests.Timeout:
                raise
            except requests.ConnectionError as e:
                last = e
                if not _refused(e) and asked < self.retries:
                    # It may have started the work: ask it again, under the same key.
                    asked += 1
                    again = base
                    time.sleep(0.1 * 2 ** asked)
                    continue
                self._down[base] = time.monotonic() + self.down_for
            except EnvError as e:
                last = e
                if e.draining:
                    self._down[base] = time.monotonic() + self.down_for
                elif not e.full:
                    raise
            tried.add(base)

    def _home(self, episode_id: str) -> str:
        """The server an episode lives on: the one that started it, else the one that knows it."""
        with _HOMES_LOCK:
            home = _HOMES.get(episode_id)
        if home is not None:
            return home
        servers = self.servers()
        if len(servers) == 1:
            return servers[0]
        unreachable: Exception | None = None
        for base in servers:
            try:
                self._call("GET", f"/v1/episodes/{episode_id}", base=base)
            except EnvError as e:
                if e.draining:
                    unreachable = e
                continue
            except requests.RequestException as e:
                unreachable = e
                continue
            _remember(episode_id, base)
            return base
        if unreachable is not None:
            # No server that answered knows it: it lived on one that did not.
            raise unreachable
        return servers[0]

    def _call(self, method: str, path: str, body: Any = None, base: str | None = None) -> Any:
        base = base or self._any_server()
        # A short connect timeout: an address whose pod is gone may drop packets, not refuse.
        timeout = (min(self.connect_timeout, self.timeout), self.timeout)
        resp = self.session.request(method, base + path, json=body, timeout=timeout)
        if resp.ok:
            return resp.json() if resp.headers.get("content-type", "").startswith("application/json") else resp.text
        try:
            err = resp.json()["error"]
            raise EnvError(resp.status_code, err["code"], err["message"])
        except (ValueError, KeyError, TypeError):
            raise EnvError(resp.status_code, "http_error", resp.text) from None

    def _any_server(self) -> str:
        servers = self.servers()
        now = time.monotonic()
        return next((s for s in servers if self._down.get(s, 0.0) <= now), servers[0])

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
              task_source: str | None = None, request_id: str | None = None) -> "Episode":
        """Starts an episode: a task by id, one sampled from `split` with `seed`, or your own
        (`task_source`: a Python file defining Model, get_inputs and get_init_inputs), on some
        server of the fleet (`Episode.server`)."""
        body: dict[str, Any] = {k: v for k, v in {"task": task, "split": split, "seed": seed,
                                                  "task_source": task_source}.items() if v is not None}
        opts = {k: v for k, v in {"max_turns": max_turns, "time_budget_s": time_budget_s}.items() if v is not None}
        if opts:
            body["options"] = opts
        # One key for every server tried: one that got the reset answers a retry with the
        # same episode instead of starting a second.
        body["request_id"] = request_id or uuid.uuid4().hex
        base, answer = self._failover("POST", "/v1/episodes", body)
        _remember(answer["episode_id"], base)
        return Episode(self, answer)

    def step(self, episode_id: str, tool: str, arguments: dict | str | None = None, request_id: str | None = None) -> dict:
        body = {"action": {"tool": tool, "arguments": arguments if arguments is not None else {}},
                "request_id": request_id or uuid.uuid4().hex}
        base = self._home(episode_id)
        for attempt in range(self.retries + 1):
            try:
                return self._call("POST", f"/v1/episodes/{episode_id}/step", body, base=base)
            except (requests.ConnectionError, requests.Timeout):
                if attempt == self.retries:
                    raise
            except EnvError as e:
                # A draining server takes no new step: the episode is lost (is_server_gone).
                if not e.retryable or e.draining or attempt == self.retries:
                    raise
            time.sleep(0.2 * 2 ** attempt)
        raise AssertionError("unreachable")

    def state(self, episode_id: str) -> dict:
        return self._call("GET", f"/v1/episodes/{episode_id}", base=self._home(episode_id))

    def trajectory(self, episode_id: str) -> dict:
        return self._call("GET", f"/v1/episodes/{episode_id}/trajectory", base=self._home(episode_id))

    def close(self, episode_id: str) -> dict:
        return self._call("DELETE", f"/v1/episodes/{episode_id}", base=self._home(episode_id))

    def evaluate(self, task: str | dict, solution: str | dict, request_id: str | None = None, **options) -> dict:
        """`task`: an id or {"source": ...}; `solution`: model_new.py text or {"files": {...}}.
        Sent with an idempotency key (`request_id`, made when absent), so a retry on this or
        another server never pays for a second evaluation."""
        body: dict[str, Any] = {"task": task, "solution": solution,
                                "options": {**options, "request_id": request_id or uuid.uuid4().hex}}
        return self._failover("POST", "/v1/evaluate", body)[1]


class Episode:
    """One episode, with a Gymnasium-style `step`."""

    def __init__(self, env: CudaAgentEnv, reset_answer: dict):
        self.env = env
        self.id: str = reset_answer["episode_id"]
        self.server: str = env._home(self.id)
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
