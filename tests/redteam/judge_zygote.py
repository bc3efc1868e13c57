"""A warm judge for the red-team runner: imports the final evaluation's judge (and with it
torch) once, then forks a fresh judge process per case.

    python judge_zygote.py EVALUATE_PY

Requests on stdin, one JSON object a line: {"id", "argv", "cwd", "env", "stdout", "stderr"}.
For each it forks a child that starts a session of its own (the case's process group, as
`start_new_session` gave the judge before), takes /dev/null and the two files as its standard
streams, closes every other descriptor, moves to `cwd`, takes `env` as its environment and
runs EVALUATE_PY as `__main__` with `argv` (EVALUATE_PY's own path first). Replies on stdout:
{"id", "pid"} once the child runs, {"exit": pid, "status": code} once it ended (a signal: minus
its number, as subprocess reports it).

What a case costs is mostly processes importing torch: the judge and its two workers, about
1.4 core-seconds each on the 2-core CI machine. The workers stay fresh processes the judge
starts (they run the candidate's code); only the judge, which never imports candidate code,
comes from here, and each case's judge is a copy of this one as it was after the imports,
never of an earlier case's.
"""

from __future__ import annotations

import json
import os
import random
import runpy
import select
import sys
import traceback
from pathlib import Path


def child(evaluate: Path, req: dict) -> None:
    code = 1
    try:
        os.setsid()
        fds = [os.open(os.devnull, os.O_RDONLY)]
        for key in ("stdout", "stderr"):
            fds.append(os.open(req[key], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, 1 << 20)
        # Streams of its own: the zygote's could be mid-write in no thread that exists here.
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's stream until it exits
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        # A fresh interpreter seeds these from the OS: each judge its own stream, not the
        # zygote's (torch's default generator starts from a fixed seed in both).
        random.seed()
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed()
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = [str(evaluate), *req["argv"]]
        runpy.run_path(str(evaluate), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported on the case's stderr, then the exit status
        traceback.print_exc()
    finally:
        # The judge's own way out: its streams flushed, no interpreter teardown.
        sys.modules["cuda_agent_harness"].exit_now(code)


def main() -> None:
    evaluate = Path(sys.argv[1]).resolve()
    # As evaluate.py orders the path: its directory last (its profile.py must not shadow the
    # standard library's, which torch imports).
    here = str(evaluate.parent)
    sys.path[:] = [p for p in sys.path if p and str(Path(p).resolve()) != here] + [here]
    import cuda_agent_harness  # noqa: F401, PLC0415 - the imports every judge would pay
    import cuda_agent_judge  # noqa: F401, PLC0415

    out = sys.stdout
    running: set[int] = set()
    stdin_open = True

    def reply(msg: dict) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    buf = b""
    while stdin_open or running:
        ready, _, _ = select.select([0] if stdin_open else [], [], [], 0.05)
        if ready:
            chunk = os.read(0, 65536)
            if not chunk:
                stdin_open = False
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    child(evaluate, req)
                running.add(pid)
                reply({"id": req["id"], "pid": pid})
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            running.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            reply({"exit": pid, "status": code})


if __name__ == "__main__":
    main()
