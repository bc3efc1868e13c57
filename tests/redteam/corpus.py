"""The red-team corpus: loading cases.toml, running one case through the final evaluation
(skills/evaluate.py, as env-server runs it) and deciding whether the judge held.

Shared by test_redteam.py (pytest) and table.py (the Markdown table for the docs).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# REDTEAM_EVALUATE points the corpus at another copy of the judge (an older one, say).
EVALUATE = Path(os.environ.get("REDTEAM_EVALUATE") or ROOT / "skills" / "evaluate.py")
DEFAULT_TIMEOUT_S = 900

# The candidate's evaluation runs under this small wrapper process, so that a case that kills
# its parent (kill_parent) kills the wrapper, never the test runner.
WRAPPER = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"


@dataclass
class Case:
    name: str
    task: str
    device: str
    expect: str | list[str]
    klass: str
    description: str
    honest_min_ms: float | None = None
    eager_max_ms: float | None = None
    timeout_s: int = DEFAULT_TIMEOUT_S
    # The judge's limit on one worker request (`--call-timeout`); None: the judge's default.
    call_timeout_s: float | None = None
    # An attack the judge is known not to stop yet, with why (the test is an expected failure
    # until it does).
    known_gap: str | None = None

    @property
    def adversarial(self) -> bool:
        return self.expect != "pass"

    @property
    def dir(self) -> Path:
        return HERE / "cases" / self.name


@dataclass
class Outcome:
    result: dict
    seconds: float
    stderr_tail: str = ""
    extra: dict = field(default_factory=dict)


def load_cases() -> list[Case]:
    with open(HERE / "cases.toml", "rb") as f:
        raw = tomllib.load(f)["case"]
    cases = []
    for c in raw:
        cases.append(Case(
            name=c["name"], task=c["task"], device=c["device"], expect=c["expect"], klass=c["class"],
            description=c["description"], honest_min_ms=c.get("honest_min_ms"), eager_max_ms=c.get("eager_max_ms"),
            timeout_s=int(c.get("timeout_s", DEFAULT_TIMEOUT_S)), known_gap=c.get("known_gap"),
            call_timeout_s=c.get("call_timeout_s"),
        ))
    return cases


def python() -> str:
    return os.environ.get("CUDA_AGENT_PYTHON") or sys.executable


def cuda_available() -> bool:
    probe = subprocess.run([python(), "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True, text=True)
    return probe.stdout.strip() == "True"


def last_json_object(text: str) -> dict | None:
    """The verdict as env-server reads it: the last stdout line that parses as a JSON object."""
    for line in reversed(text.splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def case_env(ext_dir: Path) -> dict:
    """The environment every case's evaluation runs in."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext_dir), CUDA_AGENT_TASK_SIZE="small", PYTHONUNBUFFERED="1")
    env["PATH"] = str(Path(python()).parent) + os.pathsep + env.get("PATH", "")
    return env


# What a case that reads its parent process (the judge: its command line, memory or pid) or
# hides what it calls (`_obfuscated`) spells: such a case gets a judge started afresh, exactly
# as env-server starts one, never a copy of the warm judge (JudgeZygote).
LOOKS_AT_ITS_PARENT = re.compile(r"getppid|/proc|cmdline|argv|psutil|os\.kill|PPid")


def needs_fresh_judge(case: Case) -> bool:
    if "obfuscated" in case.name:
        return True
    return any(LOOKS_AT_ITS_PARENT.search(p.read_text(errors="replace")) for p in case.dir.rglob("*") if p.is_file())


class JudgeZygote:
    """A warm judge process (judge_zygote.py) that forks a fresh judge per case: the torch
    import the judge pays in every case is paid once. Used by one runner's threads at once."""

    def __init__(self, env: dict) -> None:
        import threading

        self._env = env
        self._proc = subprocess.Popen([python(), str(HERE / "judge_zygote.py"), str(EVALUATE)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=env, text=True, bufsize=1)
        self._cond = threading.Condition()
        self._pids: dict[int, int] = {}
        self._exits: dict[int, int] = {}
        self._next = 0
        self._dead = False
        threading.Thread(target=self._read, name="judge-zygote", daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            msg = json.loads(line)
            with self._cond:
                if "pid" in msg:
                    self._pids[msg["id"]] = msg["pid"]
                else:
                    self._exits[msg["exit"]] = msg["status"]
                self._cond.notify_all()
        with self._cond:
            self._dead = True
            self._cond.notify_all()

    def start(self, argv: list[str], cwd: Path, stdout: Path, stderr: Path) -> int:
        assert self._proc.stdin is not None
        with self._cond:
            rid = self._next
            self._next += 1
            self._proc.stdin.write(json.dumps({"id": rid, "argv": argv, "cwd": str(cwd), "env": self._env,
                                               "stdout": str(stdout), "stderr": str(stderr)}) + "\n")
            self._proc.stdin.flush()
            if not self._cond.wait_for(lambda: rid in self._pids or self._dead, timeout=120) or self._dead:
                raise RuntimeError("the judge zygote did not start a judge")
            return self._pids.pop(rid)

    def wait(self, pid: int, timeout: float) -> int | None:
        """The judge's exit status, or None if it runs past `timeout`."""
        with self._cond:
            if not self._cond.wait_for(lambda: pid in self._exits or self._dead, timeout=timeout) or pid not in self._exits:
                return None
            return self._exits.pop(pid)

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()


def run_case(case: Case, work: Path, ext_dir: Path, seeds: list[int] | None = None, zygote: JudgeZygote | None = None) -> Outcome:
    """Copies the case into `work`/candidate and runs the final evaluation on it; its judge
    forked from `zygote` where given, unless the case needs a fresh one."""
    import time

    cand = work / "candidate"
    if cand.exists():
        shutil.rmtree(cand)
    shutil.copytree(case.dir, cand)
    cwd = work / "cwd"
    cwd.mkdir(exist_ok=True)
    seeds = seeds or random.SystemRandom().sample(range(1, 1 << 30), 5)
    env = case_env(ext_dir)
    args = ["candidate", "--task", str(ROOT / case.task),
            "--candidate", str(cand), "--device", case.device, "--seeds", ",".join(map(str, seeds))]
    if case.call_timeout_s is not None:
        args += ["--call-timeout", str(case.call_timeout_s)]
    if os.environ.get("REDTEAM_NO_COMPILE"):
        args.append("--no-compile")  # no torch.compile baseline: faster, the verdict is the same
    if os.environ.get("CUDA_AGENT_TIMING_BUDGET_S"):
        # The judge's timing budget, as env-server passes it (`--timing-budget-s`, which reads
        # the same variable): the suite's runner shortens the loop, about half a case's time;
        # the judge still times its minimum of rounds.
        args += ["--budget-s", os.environ["CUDA_AGENT_TIMING_BUDGET_S"]]
    if zygote is not None and not needs_fresh_judge(case):
        return _run_forked(case, zygote, args, work, cwd)
    cmd = [python(), "-c", WRAPPER, python(), str(EVALUATE), *args]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=case.timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return Outcome({"correct": None, "rule": "runner_timeout", "reason": f"no verdict within {case.timeout_s} s"},
                       time.monotonic() - start, err[-2000:])
    finally:
        # Whatever the candidate left behind in its process group (children, sleepers) goes too.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    seconds = time.monotonic() - start
    verdict = last_json_object(out)
    if verdict is None:
        verdict = {"correct": None, "rule": "no_verdict", "reason": f"exit status {proc.returncode}, no JSON line on stdout"}
    return Outcome(verdict, seconds, err[-2000:])


def _run_forked(case: Case, zygote: JudgeZygote, args: list[str], work: Path, cwd: Path) -> Outcome:
    """run_case's evaluation with a judge forked from the zygote, in a process group of its
    own, killed with whatever is left in it, as run_case does with a judge it starts."""
    import time

    out_path, err_path = work / "judge.stdout", work / "judge.stderr"
    start = time.monotonic()
    pid = zygote.start(args, cwd, out_path, err_path)
    try:
        status = zygote.wait(pid, case.timeout_s)
        if status is None:
            os.killpg(pid, signal.SIGKILL)
            zygote.wait(pid, 60)
    finally:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    seconds = time.monotonic() - start
    out = out_path.read_text(errors="replace") if out_path.exists() else ""
    err = err_path.read_text(errors="replace") if err_path.exists() else ""
    if status is None:
        return Outcome({"correct": None, "rule": "runner_timeout", "reason": f"no verdict within {case.timeout_s} s"},
                       seconds, err[-2000:])
    verdict = last_json_object(out)
    if verdict is None:
        verdict = {"correct": None, "rule": "no_verdict", "reason": f"exit status {status}, no JSON line on stdout"}
    return Outcome(verdict, seconds, err[-2000:])


def start_server(binary: str, *extra: str) -> tuple[subprocess.Popen, str, Path]:
    """Starts an env-server binary on the CPU on a free port with a fresh data directory
    (searchable by the sandboxes' uids); returns the process, its URL and the directory, for
    the caller to kill and remove."""
    import socket
    import tempfile
    import time

    base = Path(tempfile.mkdtemp(prefix="cuda-agent-redteam-server-"))
    base.chmod(0o711)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(base / "server.log", "w")
    proc = subprocess.Popen([binary, "--bind", f"127.0.0.1:{port}", "--data-dir", str(base / "data"), "--python", python(), "--device", "cpu", "--skip-compile", *extra],
                            stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"http://127.0.0.1:{port}", base
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not start: {(base / 'server.log').read_text()[-2000:]}")


def run_case_server(case: Case, url: str) -> Outcome:
    """Runs the case through a running env-server's POST /v1/evaluate: the production path
    (sandbox, separate uids for judge and worker, FIFOs), task and files sent inline."""
    import time
    import urllib.error
    import urllib.request

    files = {}
    for p in sorted(case.dir.rglob("*")):
        if p.is_file():
            files[str(p.relative_to(case.dir))] = p.read_text()
    body = {"task": {"source": (ROOT / case.task).read_text()}, "solution": {"files": files}, "options": {"device": case.device}}
    req = urllib.request.Request(url.rstrip("/") + "/v1/evaluate", data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    start = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=case.timeout_s + 900) as resp:
            answer = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return Outcome({"correct": None, "rule": "server_error", "reason": f"HTTP {e.code}: {e.read()[:2000]!r}"}, time.monotonic() - start)
    except (OSError, ValueError) as e:
        return Outcome({"correct": None, "rule": "server_error", "reason": f"{type(e).__name__}: {e}"}, time.monotonic() - start)
    result = dict(answer)
    if not answer.get("correct"):
        result["rule"] = str(answer.get("reason") or "").split(":", 1)[0] or None
    return Outcome(result, time.monotonic() - start)


def _ms(value) -> float | None:
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, dict):
        for k in ("median_ms", "median", "ms"):
            if isinstance(value.get(k), (int, float)):
                return float(value[k])
    return None


def times(result: dict) -> dict:
    """Candidate/eager/compile times in ms from either verdict format (old: candidate.median_ms;
    new: times_ms.{candidate,eager,compile})."""
    t = {}
    tm = result.get("times_ms") or {}
    for k in ("candidate", "eager", "compile"):
        v = _ms(tm.get(k)) if isinstance(tm, dict) else None
        if v is None and k == "candidate":
            v = _ms(result.get("candidate"))
        if v is not None:
            t[k] = v
    return t


def judge(case: Case, result: dict) -> tuple[bool, str]:
    """(held, why): whether the evaluation's verdict is one the case accepts."""
    correct = result.get("correct")
    rule = result.get("rule")
    t = times(result)
    if not case.adversarial:
        if correct is True:
            return True, "passed"
        return False, f"a correct candidate failed: {rule}: {result.get('reason', '')[:300]}"
    if correct is True:
        honest = case.honest_min_ms is not None or case.eager_max_ms is not None
        if honest:
            cand_ok = case.honest_min_ms is None or (t.get("candidate") is not None and t["candidate"] >= case.honest_min_ms)
            eager_ok = case.eager_max_ms is None or t.get("eager") is None or t["eager"] <= case.eager_max_ms
            if cand_ok and eager_ok:
                return True, f"paid nothing: honest times {t}"
        return False, f"PAID: correct with times {t}"
    if rule in case.expect:
        return True, f"failed with {rule}"
    return False, f"failed with {rule}, not one of {case.expect}: {result.get('reason', '')[:300]}"


def got_text(result: dict) -> str:
    if result.get("correct") is True:
        t = times(result)
        parts = [f"{k} {v:.3g} ms" for k, v in t.items()]
        return "correct (" + ", ".join(parts) + ")" if parts else "correct"
    return str(result.get("rule"))
