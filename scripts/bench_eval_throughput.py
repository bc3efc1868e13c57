#!/usr/bin/env python3
"""Evaluation throughput through the server: N distinct candidates submitted together.

Starts a release env-server (its own data directory), submits N candidates to
`POST /v1/evaluate` with C in flight, and prints evaluations per hour, where each evaluation's
time went (build queue, build, device wait, check and time), the machine's core-seconds per
evaluation and the device-seconds per evaluation. Candidates are variants of the bundled
examples: each gets its own comment, so every one is a fresh build (no cache hits); then one
unchanged resubmission and one one-line change show a cache hit and a rebuild.

With --warm-builds each distinct example is built once first (not counted) and the N
evaluations resubmit those sources unchanged: every one is still judged in full (the server
keeps no verdicts), so this measures what the device side sustains once builds run ahead of the
lease, as they do in a steady stream of episodes. --data-dir keeps the server's data (its build
cache) between runs, so a second run (say --prestart off after on) builds nothing.

    scripts/bench_eval_throughput.py --device cpu --n 8 --concurrency 2
    scripts/bench_eval_throughput.py --device cuda --n 32 --concurrency 32
    scripts/bench_eval_throughput.py --device cuda --n 16 --concurrency 16 --warm-builds --data-dir /tmp/d
    scripts/bench_eval_throughput.py --device cpu --pch=none        # without precompiled headers
    scripts/bench_eval_throughput.py --device cpu --pch="-O3"       # one variant (the default: all)

Only the standard library: it runs wherever the server runs.
"""

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def candidates(device):
    """(task id, model_new.py source) pairs to vary."""
    if device == "cpu":
        with open(os.path.join(ROOT, "tests", "cpu_add_candidate_torch_headers.py")) as f:
            return [("L1/2_Add", f.read())]
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "skills", "examples", "cuda", "*.py"))):
        name = os.path.basename(path)[:-3]  # L1_1_ReLU
        level, rest = name.split("_", 1)
        with open(path) as f:
            out.append((f"{level}/{rest}", f.read()))
    return out


def variant(source, i, nonce):
    """The same program with a distinct inline source (so its extension is built afresh)."""
    tag = f"// variant {nonce}-{i}\n"
    for quote in ('r"""', "r'''"):
        if quote in source:
            return source.replace(quote, quote + tag, 1)
    return source + f"\n# variant {nonce}-{i}\n"


def cpu_seconds():
    """Core-seconds the whole machine has spent busy (user, nice, system), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    ticks = os.sysconf("SC_CLK_TCK")
    user, nice, system = (int(x) for x in fields[:3])
    return (user + nice + system) / ticks


def post(url, body, timeout):
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        # The server's JSON error says what failed; the status line alone does not.
        raise RuntimeError(f"POST {url}: HTTP {e.code}: {e.read().decode(errors='replace')[:2000]}") from e


def get(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def start_server(args, data):
    binary = args.server_bin or os.path.join(ROOT, "target", "release", "env-server")
    cmd = [binary, "--bind", f"127.0.0.1:{args.port}", "--data-dir", data, "--python",
           args.python, "--device", args.device]
    if args.skip_compile:
        cmd.append("--skip-compile")
    if args.prestart:
        cmd += ["--prestart", args.prestart]
    if args.max_builds:
        cmd += ["--max-builds", str(args.max_builds)]
    if args.pch is not None:
        cmd += ["--pch", args.pch]
    cmd += args.server_arg
    log = open(os.path.join(os.path.dirname(data), "server.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)  # its log is on stdout
    url = f"http://127.0.0.1:{args.port}"
    for _ in range(600):
        try:
            info = get(url + "/v1/info")
            return proc, url, info
        except Exception:
            if proc.poll() is not None:
                sys.exit(f"env-server exited; see {log.name}")
            time.sleep(0.2)
    sys.exit("env-server did not answer")


def wait_pch(data, info, limit_s):
    """Waits until every precompiled header variant the server announced exists."""
    wanted = (info.get("build") or {}).get("precompiled_headers") or []
    if not wanted:
        return 0.0
    t0 = time.time()
    while time.time() - t0 < limit_s:
        made = glob.glob(os.path.join(data, "pch", "*", "torch", "extension.h.gch", "*.gch"))
        if len(made) >= len(wanted):
            break
        time.sleep(2)
    return time.time() - t0


def observed(results):
    """The server's outside observation of each evaluation's workers (`(label, _, verdict)`
    triples), one line each: the verdict, the candidate's CPU time per call in the reference's
    hot code over the reference's, the library shares, what the rings lost, why nothing was
    judged and where each side's samples went."""
    print()
    print("outside observation (details.observed):")

    def f(x):
        return f"{x:.3f}" if isinstance(x, float) else str(x)

    for task, _, r in results:
        o = (r.get("details") or {}).get("observed") or {}
        top = ", ".join(f"{x['library']} {x['share']:.2f}" for x in (o.get("candidate_top") or [])[:3])
        rtop = ", ".join(f"{x['library']} {x['share']:.2f}" for x in (o.get("reference_top") or [])[:3])
        print(f"  {task}: correct={r.get('correct')} {(r.get('reason') or '')[:100]!r} available={o.get('available')} "
              f"samples {o.get('candidate_samples')}/{o.get('reference_samples')} "
              f"forwards {o.get('candidate_forwards')}/{o.get('reference_forwards')} "
              f"kernel_time_ratio={f(o.get('kernel_time_ratio'))} "
              f"torch share {f(o.get('candidate_torch_share'))}/{f(o.get('reference_torch_share'))} "
              f"lost={o.get('lost')} reason={(o.get('reason') or '')[:120]!r} "
              f"candidate top [{top}] reference top [{rtop}]")


def row(cols, widths):
    return "  ".join(str(c).rjust(w) for c, w in zip(cols, widths))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--n", type=int, default=32, help="distinct candidates")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--python", default=os.environ.get("CUDA_AGENT_PYTHON", sys.executable))
    ap.add_argument("--server-bin", default=None)
    ap.add_argument("--port", type=int, default=18282)
    ap.add_argument("--max-builds", type=int, default=0)
    ap.add_argument("--pch", default=None, help="the server's --pch (default: its own)")
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--prestart", choices=["on", "off"], help="the server's --prestart (default: its own, on with CUDA)")
    ap.add_argument("--keep", action="store_true", help="keep the data directory")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="one more argument for env-server (repeatable), e.g. --server-arg=--no-observe")
    ap.add_argument("--json", help="write every verdict (task, latency, reward, reason, details) here")
    ap.add_argument("--warm-builds", action="store_true",
                    help="build each example once first; the N evaluations are build-cache hits")
    ap.add_argument("--data-dir", help="the server's data directory, kept (its build cache is reused)")
    ap.add_argument("--no-warm-up", action="store_true",
                    help="with --warm-builds: the data directory's builds are already there")
    args = ap.parse_args()

    if args.data_dir:
        # The server's data directory must be traversable by the sandboxed uids beneath it.
        tmp = os.path.abspath(args.data_dir)
        os.makedirs(tmp, exist_ok=True)
        args.keep = True
    else:
        tmp = tempfile.mkdtemp(prefix="cuda-agent-throughput.")
    os.chmod(tmp, 0o711)
    data = os.path.join(tmp, "data")
    proc, url, info = start_server(args, data)
    try:
        pch_wait = wait_pch(data, info, 1800)
        pool = candidates(args.device)
        nonce = os.getpid()
        if args.warm_builds:
            jobs = [pool[i % len(pool)] for i in range(args.n)]
        else:
            jobs = [(pool[i % len(pool)][0], variant(pool[i % len(pool)][1], i, nonce))
                    for i in range(args.n)]
        print(f"server: device={info['device']} torch={info['torch']} "
              f"max_builds={info['capacity']['max_builds']} build={json.dumps(info.get('build'))}")
        if pch_wait:
            print(f"precompiled headers ready after {pch_wait:.0f} s (not counted below)")

        printing = threading.Lock()
        ends = []  # when each evaluation of the batch ended, seconds from its start, in order
        t_start = [time.time()]

        def one(job):
            task, src = job
            t = time.time()
            r = post(url + "/v1/evaluate", {"task": task, "solution": src}, timeout=3600)
            # Each evaluation as it ends: a run cut by a time limit still says what it saw.
            ph = (r.get("details") or {}).get("phases") or {}
            st = ((r.get("details") or {}).get("check") or {}).get("stage_s") or {}
            with printing:
                ends.append(time.time() - t_start[0])
                print(f"  [{ends[-1]:6.1f} s] #{len(ends)} {task}: correct={r.get('correct')} "
                      f"latency {time.time() - t:.1f} s, build {ph.get('build_s', 0):.1f}, "
                      f"lease wait {ph.get('lease_wait_s', 0):.1f}, lease held {ph.get('lease_held_s', 0):.1f} "
                      f"(to go {ph.get('lease_to_go_s', 0):.2f}, teardown {ph.get('teardown_s', 0):.2f}) "
                      f"(judge: " + ", ".join(f"{k} {v:.1f}" for k, v in st.items()) + ")", flush=True)
            return task, time.time() - t, r

        if args.warm_builds and not args.no_warm_up:
            t = time.time()
            with ThreadPoolExecutor(len(pool)) as ex:
                warm = list(ex.map(one, pool))
            built = sum(1 for _, _, r in warm if not r["details"].get("build_cache_hit"))
            print(f"warm-up: {len(pool)} sources, {built} built, {time.time() - t:.0f} s (not counted)")
        if args.warm_builds:
            print(f"{args.n} evaluations of {len(pool)} built sources (build-cache hits), "
                  f"{args.concurrency} in flight")
        else:
            print(f"{args.n} distinct candidates over {len(pool)} task(s), {args.concurrency} in flight")

        def starved():
            return sum(d.get("starved_s", 0.0) for d in get(url + "/v1/info").get("device_slots", []))

        starved0 = starved()
        cpu0, t0 = cpu_seconds(), time.time()
        t_start[0] = t0
        ends.clear()
        with ThreadPoolExecutor(args.concurrency) as ex:
            results = list(ex.map(one, jobs))
        wall, cores = time.time() - t0, cpu_seconds() - cpu0

        phases = [r["details"].get("phases", {}) for _, _, r in results]
        def col(key):
            vals = [p.get(key, 0.0) for p in phases]
            return statistics.mean(vals), max(vals)
        correct = sum(1 for _, _, r in results if r.get("correct"))
        lat = sorted(latency for _, latency, _ in results)
        print()
        widths = [28, 10, 10]
        print(row(["", "mean", "max"], widths))
        print(row(["latency per evaluation (s)", f"{statistics.mean(lat):.1f}", f"{lat[-1]:.1f}"], widths))
        for key in ["setup_s", "build_queue_s", "build_s", "lease_wait_s", "judge_s", "lease_held_s",
                    "lease_to_go_s", "teardown_s"]:
            m, x = col(key)
            print(row([key, f"{m:.2f}", f"{x:.2f}"], widths))
        # The judge's own stages: its start and the wait at its gate (before the lease, with
        # prestart), then inside the lease.
        stages = [((r["details"].get("check") or {}).get("stage_s") or {}) for _, _, r in results]
        for key in ["prestart", "lease_wait", "start", "check", "second_shape", "time", "finish"]:
            vals = [s.get(key, 0.0) for s in stages]
            if any(vals):
                print(row([f"  judge {key}_s", f"{statistics.mean(vals):.2f}", f"{max(vals):.2f}"], widths))
        # Of the time stage: torch.compile's first call (its compilation, or its cache's load).
        first = [((r["details"].get("check") or {}).get("compile_first_call_s") or 0.0) for _, _, r in results]
        if any(first):
            print(row(["    of which compile's 1st call", f"{statistics.mean(first):.2f}", f"{max(first):.2f}"], widths))
        # The lease as the server held it (older servers report only judge_s).
        device_s = sum(p.get("lease_held_s") or p.get("judge_s", 0.0) for p in phases)
        print()
        print(row(["evaluations", args.n], [28, 10]))
        print(row(["correct", correct], [28, 10]))
        print(row(["wall (s)", f"{wall:.1f}"], [28, 10]))
        print(row(["evaluations per hour", f"{args.n / wall * 3600:.0f}"], [28, 10]))
        # A batch starts with every stage empty: nothing ends before the first build and judge
        # start are done. From the first result on, the rate is what a steady stream of
        # episodes gets (the builds keep running ahead of the lease, as they do in training).
        if len(ends) > 1 and ends[-1] > ends[0]:
            print(row(["first result after (s)", f"{ends[0]:.1f}"], [28, 10]))
            print(row(["  per hour from then on", f"{(len(ends) - 1) / (ends[-1] - ends[0]) * 3600:.0f}"], [28, 10]))
        print(row(["core-s per evaluation", f"{cores / args.n:.1f}"], [28, 10]))  # the whole machine
        print(row(["device-s per evaluation", f"{device_s / args.n:.1f}"], [28, 10]))
        # The device's share of the wall, and its free time while an evaluation of it waited
        # for its place or started its judge (prestart): what a deeper --prestart-depth gives.
        print(row(["device busy (% of wall)", f"{100 * device_s / wall / len(info['device_slots']):.0f}"], [28, 10]))
        print(row(["device free, work waiting (s)", f"{starved() - starved0:.1f}"], [28, 10]))

        observed(results)
        if args.json:
            with open(args.json, "w") as f:
                json.dump([{"task": t, "latency_s": latency, **r} for t, latency, r in results], f, indent=1)

        bad = [(t, r.get("reason")) for t, _, r in results if not r.get("correct")]
        for t, reason in bad[:5]:
            print(f"not correct: {t}: {(reason or '')[:300]}")
        if args.warm_builds:
            return
        # The agent's loop: the same sources again (a cache hit), then a one-line change.
        task, src = jobs[0]
        _, hit_s, hit = one((task, src))
        changed = variant(pool[0][1], "changed", nonce)
        _, re_s, re = one((task, changed))
        print()
        print(row(["resubmitted unchanged: total (s)", f"{hit_s:.1f}"], [34, 8]))
        print(row(["  of which build (s)", f"{hit['details'].get('phases', {}).get('build_s', 0):.2f}"], [34, 8]))
        print(row(["one-line change: total (s)", f"{re_s:.1f}"], [34, 8]))
        print(row(["  of which build (s)", f"{re['details'].get('phases', {}).get('build_s', 0):.2f}"], [34, 8]))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
