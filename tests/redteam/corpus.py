"""The red-team corpus: loading cases.toml, running one case through the final evaluation
(skills/evaluate.py, as env-server runs it) and deciding whether the judge held.

Shared by test_redteam.py (pytest) and table.py (the Markdown table for the docs).
"""

from __future__ import annotations

import json
import os
import random
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


def run_case(case: Case, work: Path, ext_dir: Path, seeds: list[int] | None = None) -> Outcome:
    """Copies the case into `work`/candidate and runs the final evaluation on it."""
    import time

    cand = work / "candidate"
    if cand.exists():
        shutil.rmtree(cand)
    shutil.copytree(case.dir, cand)
    cwd = work / "cwd"
    cwd.mkdir(exist_ok=True)
    seeds = seeds or random.SystemRandom().sample(range(1, 1 << 30), 5)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext_dir), CUDA_AGENT_TASK_SIZE="small", PYTHONUNBUFFERED="1")
    env["PATH"] = str(Path(python()).parent) + os.pathsep + env.get("PATH", "")
    cmd = [python(), "-c", WRAPPER, python(), str(EVALUATE), "candidate", "--task", str(ROOT / case.task),
           "--candidate", str(cand), "--device", case.device, "--seeds", ",".join(map(str, seeds))]
    if case.call_timeout_s is not None:
        cmd += ["--call-timeout", str(case.call_timeout_s)]
    if os.environ.get("REDTEAM_NO_COMPILE"):
        cmd.append("--no-compile")  # no torch.compile baseline: faster, the verdict is the same
    if os.environ.get("CUDA_AGENT_TIMING_BUDGET_S"):
        # The judge's timing budget, as env-server passes it (`--timing-budget-s`, which reads
        # the same variable): the suite's runner shortens the loop, about half a case's time;
        # the judge still times its minimum of rounds.
        cmd += ["--budget-s", os.environ["CUDA_AGENT_TIMING_BUDGET_S"]]
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
