#!/usr/bin/env python3
"""`cargo test`, with its test binaries run side by side instead of one after another.

    scripts/cargo_test_parallel.py [--at-once N] [CARGO TEST ARGS] [-- TEST BINARY ARGS]

Builds the tests once (`cargo test --no-run`), then runs the binaries N at a time (default 3):
most of them wait on servers, sandboxes and Python judges, so one at a time leaves the cores
half idle. Each binary runs as cargo runs it (in its package's directory, with
CARGO_MANIFEST_DIR and CARGO_PKG_NAME set), its output kept in its own log under
target/test-logs/cargo/ and printed whole when it ends. Every binary runs even after one fails
(cargo stops at the first); the failures are listed at the end and the exit status is 1. The
doc tests run through `cargo test --doc`, one job among the others, unless targets were
selected.

Which binaries may run beside which, and at what priority: ALONE, JUDGE and FOREGROUND below.
Judging binaries take each free turn first; the rest start longest first, by the last run's
times (kept beside the logs).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

# Labels are "<package> <source path in the package>", as the summary prints them.
#
# Run with nothing beside them. observe.rs counts the profiler's samples of programs that spin
# for a fixed time (over 500, a quarter of them in one program), which a loaded machine thins
# out. redteam_http.rs holds a server's connection slots for its 300 ms header timeout while
# it sends 50 more connections that must all be refused: a starved test outlasts the timeout
# (it failed at background priority beside a judging binary).
#
# The two CPU-wait tests pin busy loops at normal priority to one CPU for seconds on purpose
# (a starved command is what they measure): beside a judging binary they would starve its
# timed calls.
ALONE = {
    "agent-tools tests/cpu_wait.rs",
    "env-server tests/cpu_wait.rs",
    "env-server tests/observe.rs",
    "env-server tests/redteam_http.rs",
}
# Judge real candidates with the Python judge and assert their verdicts: timed calls, CPU used
# between calls (late_work), and builds at background priority within the build limit. One at a
# time, at normal priority, as before: they are the phase's longest chain.
JUDGE = {
    "e2e-tests episode.rs",
    "e2e-tests observations.rs",
    "e2e-tests replay.rs",
    "e2e-tests runner.rs",
    "env-server tests/build.rs",
    "env-server tests/eval_volume.rs",
    "env-server tests/prestart.rs",
}
# At normal priority too, beside anything but ALONE: they check the nice value their sandboxes'
# commands start with, or wait on bounds a starved process could miss (a drained server's exit,
# a fleet client's timeout, a proposed task's 100 ms runtime window, the sandboxed proposals'
# time limits).
FOREGROUND = {
    "agent-tools tests/redteam_sandbox.rs",
    "agent-tools tests/sandbox.rs",
    "env-server tests/drain.rs",
    "env-client tests/fleet.rs",
    "kernelbench tests/synth_llm.rs",
    "kernelbench tests/synth_redteam.rs",
}
# Every other binary (doc tests included) runs at the candidates' build priority (nice 10 in a
# session of its own, so in an autogroup of its own at nice 10): beside a judging binary, its
# candidates' builds then get an equal share against them, not a tenth, and its timed calls
# come first.
#
# Seconds each long binary took on a 2-core machine (three at a time): the order of a first
# run, such as CI's fresh clone, where no times of a last run are kept.
TYPICAL_S = {
    "env-server tests/build.rs": 250,
    "env-server tests/eval_volume.rs": 150,
    "e2e-tests learning.rs": 245,
    "e2e-tests episode.rs": 235,
    "env-server tests/redteam_http.rs": 207,
    "env-server tests/api.rs": 139,
    "env-server tests/lifecycle.rs": 98,
    "env-server tests/prestart.rs": 68,
    "env-server tests/drain.rs": 56,
    "kernelbench tests/synth_redteam.rs": 100,
    "e2e-tests observations.rs": 50,
    "env-client tests/fleet.rs": 44,
    "e2e-tests runner.rs": 35,
    "e2e-tests docs.rs": 26,
    "kernelbench tests/synth.rs": 22,
    "e2e-tests replay.rs": 21,
    "trainer tests/parity.rs": 21,
    "kernelbench tests/synth_llm.rs": 19,
}

# The nice value of the candidates' builds (agent-tools' BACKGROUND_NICE).
BACKGROUND_NICE = 10


def background(label: str) -> bool:
    return label not in ALONE and label not in JUDGE and label not in FOREGROUND


def lower_priority() -> None:
    """In the child before exec: a session (and so an autogroup) of its own, at nice 10."""
    os.setsid()
    try:
        os.setpriority(os.PRIO_PROCESS, 0, max(BACKGROUND_NICE, os.getpriority(os.PRIO_PROCESS, 0)))
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(BACKGROUND_NICE))
    except OSError:
        pass  # a kernel without autogroups: the nice value alone


# Cargo options that select targets: `--doc` cannot be combined with them.
TARGET_SELECTION = {"--lib", "--bins", "--bin", "--tests", "--test", "--examples", "--example",
                    "--benches", "--bench", "--all-targets", "--doc"}


def split_args(argv: list[str]) -> tuple[int, list[str], list[str]]:
    jobs = 3
    if "--" in argv:
        i = argv.index("--")
        cargo, binary = argv[:i], argv[i + 1:]
    else:
        cargo, binary = argv, []
    rest = []
    it = iter(cargo)
    for a in it:
        # (cargo's own --jobs is the build's.)
        if a == "--at-once":
            jobs = int(next(it))
        elif a.startswith("--at-once="):
            jobs = int(a.split("=", 1)[1])
        else:
            rest.append(a)
    return max(1, jobs), rest, binary


def build(cargo_args: list[str], packages: dict[str, str]) -> list[dict]:
    """The test binaries of `cargo test CARGO_ARGS`, in cargo's order."""
    out = subprocess.run(
        ["cargo", "test", "--no-run", "--message-format=json-render-diagnostics", *cargo_args],
        stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        sys.exit(out.returncode)
    tests, seen = [], set()
    for line in out.stdout.splitlines():
        if not line.startswith("{"):
            continue
        msg = json.loads(line)
        if msg.get("reason") != "compiler-artifact" or not msg["profile"]["test"] or not msg.get("executable"):
            continue
        if msg["executable"] in seen:
            continue
        seen.add(msg["executable"])
        manifest_dir = Path(msg["manifest_path"]).parent
        src = Path(msg["target"]["src_path"])
        package = packages[msg["manifest_path"]]
        try:
            rel = src.relative_to(manifest_dir)
        except ValueError:
            rel = src
        tests.append({
            "label": f"{package} {rel}",
            "exe": msg["executable"],
            "dir": str(manifest_dir),
            "package": package,
            "crate": msg["target"]["name"].replace("-", "_"),
        })
    return tests


def main() -> int:
    jobs, cargo_args, binary_args = split_args(sys.argv[1:])
    start = time.monotonic()
    metadata = json.loads(subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--no-deps", "--locked"],
        stdout=subprocess.PIPE, text=True, check=True).stdout)
    target = Path(metadata["target_directory"])
    tests = build(cargo_args, {p["manifest_path"]: p["name"] for p in metadata["packages"]})
    logs = target / "test-logs" / "cargo"
    logs.mkdir(parents=True, exist_ok=True)
    times_file = logs / "times.json"
    try:
        last = json.loads(times_file.read_text())
    except (OSError, ValueError):
        last = {}

    jobs_list = [dict(t, argv=[t["exe"], *binary_args]) for t in tests]
    if not any(a in TARGET_SELECTION or a.split("=", 1)[0] in TARGET_SELECTION for a in cargo_args):
        jobs_list.append({"label": "doc tests", "dir": os.getcwd(), "package": None,
                          "argv": ["cargo", "test", "--doc", *cargo_args, "--", *binary_args]})
    # Longest first by the last run's times (or TYPICAL_S; short ones are not listed there); the
    # judging ones, one at a time, are the longest chain, so each free turn goes to them first.
    order = {j["label"]: i for i, j in enumerate(jobs_list)}
    jobs_list.sort(key=lambda j: (j["label"] not in ALONE, j["label"] not in JUDGE,
                                  -last.get(j["label"], TYPICAL_S.get(j["label"], 0)), order[j["label"]]))
    queue = jobs_list
    running: dict[str, tuple] = {}
    results: list[tuple[str, int, float, str]] = []
    print(f"cargo_test_parallel: {len(queue)} test binaries, {jobs} at a time; logs in {logs}", flush=True)

    def launch(j: dict) -> None:
        env = dict(os.environ)
        if j["package"]:
            env.update(CARGO_MANIFEST_DIR=j["dir"], CARGO_PKG_NAME=j["package"], CARGO_CRATE_NAME=j["crate"])
            # As cargo does: the deps directory on the library path, for any dylib a test links.
            deps = os.path.dirname(j["exe"])
            env["LD_LIBRARY_PATH"] = deps + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
        log_path = logs / (re.sub(r"[^A-Za-z0-9_.-]+", "_", j["label"]) + ".log")
        log = open(log_path, "w")
        back = background(j["label"])
        p = subprocess.Popen(j["argv"], cwd=j["dir"], env=env, stdin=subprocess.DEVNULL,
                             stdout=log, stderr=subprocess.STDOUT, preexec_fn=lower_priority if back else None)
        running[j["label"]] = (p, j, time.monotonic(), log, back)

    def finish(label: str) -> None:
        p, j, t0, log, _ = running.pop(label)
        log.close()
        took = time.monotonic() - t0
        status = "ok" if p.returncode == 0 else f"FAILED (exit status {p.returncode})"
        text = Path(log.name).read_text(errors="replace")
        print(f"\n==== {label}: {status}, {took:.0f} s ({' '.join(j['argv'][:1])})", flush=True)
        sys.stdout.write(text if text.endswith("\n") or not text else text + "\n")
        sys.stdout.flush()
        results.append((label, p.returncode, took, log.name))

    def startable(j: dict) -> bool:
        if any(lbl in ALONE for lbl in running):
            return False
        if j["label"] in ALONE:
            return not running
        return j["label"] not in JUDGE or not any(lbl in JUDGE for lbl in running)

    def stop_all(*_):
        # The background ones are in sessions of their own, out of reach of the terminal's ^C.
        for p, _, _, _, back in running.values():
            try:
                os.killpg(p.pid, signal.SIGKILL) if back else p.kill()
            except OSError:
                pass
        sys.exit(130)

    signal.signal(signal.SIGTERM, stop_all)
    signal.signal(signal.SIGINT, stop_all)
    while queue or running:
        while len(running) < jobs:
            nxt = next((j for j in queue if startable(j)), None)
            # The ones that must run alone wait at the head of the queue for the others to end.
            if nxt is None or (queue[0]["label"] in ALONE and nxt is not queue[0]):
                break
            queue.remove(nxt)
            launch(nxt)
        time.sleep(0.2)
        for label in [lbl for lbl, (p, *_) in running.items() if p.poll() is not None]:
            finish(label)

    # Times for the next run's order; a filtered run updates only what it ran.
    last.update({label: round(took, 1) for label, _, took, _ in results})
    times_file.write_text(json.dumps(last, indent=1, sort_keys=True) + "\n")

    totals = {"passed": 0, "failed": 0, "ignored": 0}
    for _, code, _, log_name in results:
        counts = [m.groups() for m in re.finditer(r"^test result: \w+\. (\d+) passed; (\d+) failed; (\d+) ignored",
                                                  Path(log_name).read_text(errors="replace"), re.M)]
        totals["passed"] += sum(int(c[0]) for c in counts)
        totals["ignored"] += sum(int(c[2]) for c in counts)
        # A binary that failed without a failed test to show (a crash, a bad argument) is one.
        totals["failed"] += max(sum(int(c[1]) for c in counts), 1 if code != 0 else 0)
    failed = [r for r in results if r[1] != 0]
    print(f"\ncargo_test_parallel: {time.monotonic() - start:.0f} s in all; the longest:")
    for label, code, took, _ in sorted(results, key=lambda r: -r[2])[:10]:
        print(f"  {took:6.0f} s  {label}{'' if code == 0 else '  FAILED'}")
    for label, code, _, log_name in failed:
        print(f"FAILED: {label} (exit status {code}), log {log_name}")
    # One closing line for the whole phase.
    print(f"total: {totals['passed']} passed, {totals['failed']} failed, {totals['ignored']} skipped", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
