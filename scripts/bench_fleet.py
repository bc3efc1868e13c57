#!/usr/bin/env python3
"""Evaluations per hour through the Python client's fleet, against the number of servers.

Starts 1, 2, ... `--servers` real env-server processes on loopback (CPU evaluation), and for
each fleet size sends `--kernel` evaluations of L1/2_Add (a real judge, worker and reference
with torch; `--skip-compile`) and `--tiny` evaluations of a tiny task (judged in Rust: the
client's and the HTTP path's own cost) from `--clients` threads through one
`CudaAgentEnv(urls)`, each with its own request_id. Prints a table.

On one machine the servers share its CPU: the kernel column shows that the client spreads the
work and adds no bottleneck, not how a fleet of machines scales.

    scripts/bench_fleet.py --servers 3 --kernel 8 --tiny 2000
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "env-client" / "python"))
from cuda_agent_env import CudaAgentEnv  # noqa: E402

CANDIDATE = "import torch\n\n\nclass ModelNew(torch.nn.Module):\n    def forward(self, a, b):  # {n}\n        return a + b\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(binary: Path, base: Path, name: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(base / f"{name}.log", "w")
    proc = subprocess.Popen(
        [str(binary), "--bind", f"127.0.0.1:{port}", "--data-dir", str(base / name), "--python", sys.executable,
         "--device", "cpu", "--skip-compile"],
        stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, "CUDA_AGENT_PCH": "none"})
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{name} did not come up; see {base / name}.log")


def run(urls: list[str], jobs: list[tuple[str, str]], clients: int) -> tuple[float, int]:
    """Sends every (task, solution) through one fleet client per thread; returns (seconds, failures)."""
    def one(job: tuple[str, str]) -> bool:
        env = CudaAgentEnv(urls, timeout=600)
        verdict = env.evaluate(job[0], job[1])
        return "reward" in verdict

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(clients) as pool:
        ok = list(pool.map(one, jobs))
    return time.perf_counter() - t0, ok.count(False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", type=int, default=3, help="largest fleet (1..N are measured)")
    ap.add_argument("--kernel", type=int, default=8, help="L1/2_Add evaluations per fleet size (0: none)")
    ap.add_argument("--tiny", type=int, default=2000, help="tiny-task evaluations per fleet size (0: none)")
    ap.add_argument("--clients", type=int, default=0, help="threads sending at once (default: 2 per server)")
    ap.add_argument("--server-bin", type=Path,
                    default=Path(os.environ.get("CUDA_AGENT_SERVER_BIN", ROOT / "target" / "release" / "env-server")))
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="cuda-agent-bench-fleet-"))
    base.chmod(0o711)  # sandboxed uids must reach the data dirs
    procs: list[subprocess.Popen] = []
    try:
        urls = []
        for i in range(args.servers):
            proc, url = start(args.server_bin, base, f"s{i}")
            procs.append(proc)
            urls.append(url)
        # One warm-up evaluation per server: torch's first import is not the fleet's cost.
        for url in urls:
            CudaAgentEnv(url, timeout=600).evaluate("L1/2_Add", CANDIDATE.format(n="warm-up"))
        rows = []
        n = 0
        for k in range(1, args.servers + 1):
            fleet = urls[:k]
            clients = args.clients or 2 * k
            row = [k, clients]
            for count, task in ((args.kernel, "L1/2_Add"), (args.tiny, "tiny/0_red")):
                if count == 0:
                    row += ["-", "-"]
                    continue
                jobs = []
                for _ in range(count):
                    n += 1  # distinct sources: nothing is reused between evaluations
                    jobs.append((task, CANDIDATE.format(n=n) if task.startswith("L1") else "red"))
                secs, failed = run(fleet, jobs, clients)
                row += [f"{count / secs * 3600:,.0f}", f"{secs:.1f}"]
                if failed:
                    row[-1] += f" ({failed} failed)"
            rows.append(row)
        head = ["servers", "clients", "kernel evals/h", "kernel s", "tiny evals/h", "tiny s"]
        print(f"| {' | '.join(head)} |")
        print(f"|{'|'.join(' --- ' for _ in head)}|")
        for r in rows:
            print(f"| {' | '.join(str(x) for x in r)} |")
        print(f"({args.kernel} L1/2_Add evaluations and {args.tiny} tiny-task evaluations per fleet size; "
              f"{os.cpu_count()} CPUs shared by every server)")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
