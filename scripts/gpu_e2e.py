"""On a GPU machine: the env-server binary on CUDA, end to end, with no dependency but the
standard library. One episode whose agent writes a CUDA candidate, runs nvcc, verify.py and
profile.py inside the sandbox and submits; then /v1/evaluate of every example candidate in
skills/examples/cuda/. Prints what it sees and a table.

    python3 scripts/gpu_e2e.py [--server target/release/env-server] [--no-episode]
                               [--candidates L1_1_ReLU,L1_2_Add] [--parallel 4]
"""

import argparse
import concurrent.futures
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def call(url, method="GET", body=None, timeout=1200):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"http_error": e.code, "body": e.read().decode()}


def episode(url):
    """One episode on L1/2_Add: the agent writes the example candidate, runs nvcc, verify.py and
    profile.py in the sandbox, and submits."""
    cand = (ROOT / "skills/examples/cuda/L1_2_Add.py").read_text()
    ep = call(url + "/v1/episodes", "POST", {"task": "L1/2_Add"})
    eid = ep["episode_id"]
    steps = [
        ("Write", {"file_path": "model_new.py", "content": cand}),
        ("Bash", {"command": "nvidia-smi -L; nvcc --version | tail -2; id -u", "timeout": 60000}),
        ("Bash", {"command": "python verify.py", "timeout": 600000}),
        ("Bash", {"command": "python profile.py --compare eager compile", "timeout": 600000}),
        ("Submit", {}),
    ]
    for tool, a in steps:
        t = time.time()
        r = call(url + f"/v1/episodes/{eid}/step", "POST", {"action": {"tool": tool, "arguments": a}})
        obs = r.get("observation", r)
        print(f"--- {tool} ({time.time() - t:.1f} s) ---\n{obs.get('text', obs) if isinstance(obs, dict) else obs}")
        if r.get("done"):
            print("final:", json.dumps(r["info"].get("evaluation"), indent=1)[:3000])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--server", default=str(ROOT / "target/release/env-server"))
    p.add_argument("--no-episode", action="store_true", help="only the /v1/evaluate table")
    p.add_argument("--candidates", help="comma-separated example names (file stems); default all")
    p.add_argument("--parallel", type=int, default=4, help="evaluations in flight (the server builds them side by side and times one at a time)")
    p.add_argument("--log", help="write the server's log here (default: a temporary file, removed)")
    p.add_argument("--json", help="write every evaluation's full answer here")
    args = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="cuda-agent-gpu-"))
    base.chmod(0o711)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = Path(args.log) if args.log else base / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([args.server, "--bind", f"127.0.0.1:{port}", "--data-dir", str(base / "data"),
                             "--python", sys.executable, "--device", "cuda"], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if proc.poll() is not None:
                    print(open(log_path).read())
                    raise SystemExit("server exited")
                time.sleep(0.1)
        info = call(url + "/v1/info")
        print("info:", json.dumps({k: info.get(k) for k in ("device", "gpus", "torch", "task_size", "sandbox")}))
        if not args.no_episode:
            episode(url)
        files = sorted((ROOT / "skills/examples/cuda").glob("*.py"))
        if args.candidates:
            wanted = set(args.candidates.split(","))
            files = [f for f in files if f.stem in wanted]

        def evaluate(f):
            level, rest = f.stem.split("_", 1)
            task = f"L{level[1:]}/{rest}"
            t = time.time()
            return task, call(url + "/v1/evaluate", "POST", {"task": task, "solution": f.read_text()}), time.time() - t

        def fmt(x):
            return "-" if x is None else f"{x:.4f}"

        print("| candidate | reward | eager ms | compile ms | candidate ms | vs eager | vs compile | seconds |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        answers = {}
        with concurrent.futures.ThreadPoolExecutor(max(1, args.parallel)) as pool:
            for task, r, took in pool.map(evaluate, files):
                answers[task] = {"seconds": took, **r}
                if args.json:
                    Path(args.json).write_text(json.dumps(answers, indent=1))
                if "reward" not in r:
                    print(f"| {task} | error {r} |")
                    continue
                tm, sp = r["times_ms"], r["speedup"]
                print(f"| {task} | {r['reward']} | {fmt(tm['eager'])} | {fmt(tm['compile'])} | {fmt(tm['candidate'])} | "
                      f"{fmt(sp['eager'])} | {fmt(sp['compile'])} | {took:.0f} |" + (f" {r['reason']}" if r.get("reason") else ""), flush=True)
        print("\n".join(line for line in urllib.request.urlopen(url + "/metrics").read().decode().splitlines() if "device" in line or "reward" in line))
    finally:
        proc.kill()
        proc.wait()
        if os.environ.get("KEEP") is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
