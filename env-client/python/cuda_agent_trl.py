"""A TRL `environment_factory` environment for cuda-agent episodes (needs `requests`).

TRL's GRPOTrainer makes one instance per rollout (the class, called with no arguments),
calls `reset(**row)` with the dataset row's columns, exposes every other public method as a
function tool (its schema from the signature and the docstring), and hands the instances to
the reward function afterwards::

    from cuda_agent_trl import episode_reward, trl_environment

    CudaAgent = trl_environment("http://127.0.0.1:8080", max_turns=50)

    def reward(environments, **kwargs):
        return [episode_reward(env) for env in environments]

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Optimize the task."}]] * 64,
                                 "task": ["L1/19_ReLU"] * 64})
    GRPOTrainer(model=..., train_dataset=dataset, reward_funcs=reward,
                environment_factory=CudaAgent).train()

A dataset column `task` (an id), `split` and `seed`, or `task_source` (your own module) picks
the episode's task; `max_turns` and `time_budget_s` columns set its limits. The tools are the
server's (Bash, Glob, Read, Write, Edit, MultiEdit, Grep, TodoWrite, Submit); a call the
server refuses, or one after the episode ended, raises ValueError, which TRL shows the model
as the tool's answer. After `Submit` (or a limit) `reward` holds the milestone reward and
`result` the evaluation. `episode_reward(env)` is the reward to train on: it first submits an
episode whose rollout ended without Submit (the workspace is judged as it is); such an
episode is also submitted when the instance is reset again or dropped. The only public
methods are `reset` and the tools (TRL would offer any other as a tool).

The server may be a fleet: several URLs separated by commas, or `dns+http://NAME:PORT` for
every address of a headless Service (`cuda_agent_env`'s docstring). An episode whose server
goes away or drains ends at once: the next tool call answers that it is lost, `lost` is
True and `reward` stays 0.0 (leave it out of training).
"""

from __future__ import annotations

import os
from typing import Any

from cuda_agent_env import CudaAgentEnv, EnvError, is_server_gone

__all__ = ["CudaAgentToolEnv", "episode_reward", "trl_environment"]

_RESET_KEYS = ("task", "split", "seed", "task_source", "max_turns", "time_budget_s")


class CudaAgentToolEnv:
    """One episode per rollout. Configure the server with `trl_environment` (or the class
    attributes `base_url`, `api_key`, `reset_defaults`)."""

    base_url: str = os.environ.get("CUDA_AGENT_URL", "http://127.0.0.1:8080")
    api_key: str | None = os.environ.get("CUDA_AGENT_API_KEY")
    reset_defaults: dict = {}

    def __init__(self):
        self._client = CudaAgentEnv(self.base_url, api_key=self.api_key)
        self._episode = None
        self.reward = 0.0
        self.done = False
        self.result: dict | None = None
        self.episode_id: str | None = None
        self.lost = False

    def reset(self, **kwargs) -> str:
        """Starts a new episode (the previous one, if unfinished, is submitted as it is)."""
        self._finish()
        args = {**self.reset_defaults, **{k: kwargs[k] for k in _RESET_KEYS if kwargs.get(k) is not None}}
        self._episode = self._client.reset(**args)
        self.episode_id = self._episode.id
        self.reward, self.done, self.result, self.lost = 0.0, False, None, False
        return self._episode.observation["text"]

    def _finish(self) -> None:
        # An unfinished episode still gets its final evaluation (the reward of a rollout that
        # ran out of tokens), and its workspace is freed.
        if self._episode is not None and not self.done:
            try:
                self._step("Submit", {})
            except (EnvError, ValueError):
                pass

    def _step(self, tool: str, arguments: dict[str, Any]) -> str:
        if self._episode is None:
            raise ValueError("no episode: reset first")
        if self.done:
            raise ValueError(f"The episode has ended (reward {self.reward}); no more tool calls.")
        args = {k: v for k, v in arguments.items() if v is not None}
        try:
            obs, reward, terminated, truncated, info = self._episode.step(tool, args)
        except Exception as e:
            if is_server_gone(e):
                self.done, self.lost = True, True
                raise ValueError("The episode's server went away; the episode is lost.") from None
            if isinstance(e, EnvError) and 400 <= e.status < 500:
                raise ValueError(f"{e.code}: {e.message}") from None
            raise
        text = obs["text"]
        if terminated or truncated:
            self.done, self.reward, self.result = True, reward, info.get("evaluation")
            text += f"\n[episode ended: reward {reward}]"
        return text

    # The tools, one method each, named as the server names them.

    def Bash(self, command: str, timeout: int | None = None, description: str | None = None) -> str:
        """
        Run a bash command in the workspace (the working directory persists between calls).

        Args:
            command: The command to run.
            timeout: Timeout in milliseconds (default 120000, at most 600000).
            description: A short description of what the command does, in 5-10 words.

        Returns:
            The command's output and exit code.
        """
        return self._step("Bash", {"command": command, "timeout": timeout, "description": description})

    def Glob(self, pattern: str, path: str | None = None) -> str:
        """
        List the workspace files that match a glob pattern.

        Args:
            pattern: The glob pattern, such as `**/*.cu` or `kernels/*.cpp`.
            path: Directory to search in (default: the workspace root).

        Returns:
            The matching paths.
        """
        return self._step("Glob", {"pattern": pattern, "path": path})

    def Read(self, file_path: str, offset: int | None = None, limit: int | None = None) -> str:
        """
        Read a file of the workspace, with line numbers.

        Args:
            file_path: The file to read.
            offset: The first line to read (1-based).
            limit: How many lines to read.

        Returns:
            The file's lines.
        """
        return self._step("Read", {"file_path": file_path, "offset": offset, "limit": limit})

    def Write(self, file_path: str, content: str) -> str:
        """
        Write a file of the workspace (created or replaced).

        Args:
            file_path: The file to write.
            content: Its whole content.

        Returns:
            What was written.
        """
        return self._step("Write", {"file_path": file_path, "content": content})

    def Edit(self, file_path: str, old_string: str, new_string: str, replace_all: bool = False) -> str:
        """
        Replace an exact string in a file of the workspace.

        Args:
            file_path: The file to edit.
            old_string: The exact text to replace (empty to create a file that does not exist yet).
            new_string: The text to put in its place.
            replace_all: Replace every occurrence instead of requiring exactly one.

        Returns:
            What was replaced.
        """
        return self._step("Edit", {"file_path": file_path, "old_string": old_string,
                                   "new_string": new_string, "replace_all": replace_all})

    def MultiEdit(self, file_path: str, edits: list[dict]) -> str:
        """
        Apply several exact-string replacements to one file, in order, all or none.

        Args:
            file_path: The file to edit.
            edits: The replacements: objects with old_string, new_string and optionally replace_all.

        Returns:
            What was replaced.
        """
        return self._step("MultiEdit", {"file_path": file_path, "edits": edits})

    def Grep(self, pattern: str, path: str | None = None, glob: str | None = None, file_type: str | None = None,
             output_mode: str | None = None, case_insensitive: bool | None = None,
             context: int | None = None, head_limit: int | None = None) -> str:
        """
        Search the workspace's files with a regular expression (ripgrep's syntax).

        Args:
            pattern: The regular expression to search for.
            path: File or directory to search in (default: the workspace root).
            glob: Only search files whose name matches this glob, such as `*.cpp`.
            file_type: Only search files of this type: py, cpp, cuda, md, txt, json, sh.
            output_mode: content (matching lines), files_with_matches (the default) or count.
            case_insensitive: Case-insensitive search.
            context: Lines of context before and after each match (content mode).
            head_limit: Show only the first N lines or entries of the output.

        Returns:
            The matches.
        """
        return self._step("Grep", {"pattern": pattern, "path": path, "glob": glob, "type": file_type,
                                   "output_mode": output_mode, "-i": case_insensitive, "-C": context,
                                   "head_limit": head_limit})

    def TodoWrite(self, todos: list[dict]) -> str:
        """
        Replace the episode's todo list.

        Args:
            todos: The items: objects with content, status (pending, in_progress or completed) and activeForm.

        Returns:
            The list as it now stands.
        """
        return self._step("TodoWrite", {"todos": todos})

    def Submit(self) -> str:
        """
        Submit model_new.py for the final evaluation; this ends the episode.

        Returns:
            The evaluation and the reward.
        """
        return self._step("Submit", {})

    def __del__(self):
        try:
            self._finish()
        except Exception:  # noqa: BLE001 - the interpreter may be shutting down
            pass


def episode_reward(env: CudaAgentToolEnv) -> float:
    """The final reward of `env`'s episode, submitting it first if the rollout ended without
    Submit (0.0 before any reset)."""
    env._finish()
    return env.reward


def trl_environment(base_url: str, api_key: str | None = None, **reset_defaults) -> type:
    """A `CudaAgentToolEnv` class bound to a server, for `environment_factory=`; keyword
    arguments (task, split, seed, task_source, max_turns, time_budget_s) are defaults that
    dataset columns override."""
    unknown = set(reset_defaults) - set(_RESET_KEYS)
    if unknown:
        raise TypeError(f"unknown reset arguments: {sorted(unknown)}")
    return type("CudaAgentToolEnv", (CudaAgentToolEnv,),
                {"base_url": base_url, "api_key": api_key, "reset_defaults": dict(reset_defaults)})
