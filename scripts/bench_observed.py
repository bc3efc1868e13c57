#!/usr/bin/env python3
"""The server's outside observation of the workers' CPU on the red-team corpus: for each case,
the verdict and where the candidate's and the eager reference's forwards spent their samples
(share in libtorch_cpu.so, share in the reference's own kernel pages, the thresholds). With
`--overhead`, the same legitimate cases on a second server with `--no-observe`, to show what
sampling costs the timed medians.

    scripts/bench_observed.py [--server target/release/env-server] [--overhead] [CASE ...]

Cases are corpus names, or `variant:NAME` for the honest Add candidate with allowed PyTorch
operators added (zeros_extra, clone_input, two_clones, transposed_contig). Needs root (the
server's perf events); prints a table."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "redteam"))
from corpus import load_cases, run_case_server, start_server  # noqa: E402

DEFAULT_CASES = [
    "tamper_worker_obfuscated", "tamper_trace_method_obfuscated", "disable_dispatch_modes_obfuscated", "aten_cpu_direct_obfuscated",
    "dilute_hidden_compute",
    "legit_add_load_inline", "legit_openmp_add", "legit_matmul_parallel_for", "legit_integer_output", "legit_several_ext_calls",
    "variant:zeros_extra", "variant:clone_input", "variant:two_clones", "variant:transposed_contig",
]
VARIANTS = {
    "zeros_extra": "        z = torch.zeros_like(a)\n        return ext.vadd(a, b)",
    "clone_input": "        return ext.vadd(a.clone(), b)",
    "two_clones": "        return ext.vadd(a.clone(), b.clone())",
    "transposed_contig": "        return ext.vadd(a.t().contiguous().t().contiguous(), b)",
}
HONEST_FORWARD = "        return ext.vadd(a.contiguous(), b.contiguous())"


def case_for(name: str, cases: dict, scratch: Path):
    if not name.startswith("variant:"):
        return cases[name]
    v = name.split(":", 1)[1]
    base = cases["legit_add_load_inline"]
    d = scratch / v
    shutil.copytree(base.dir, d)
    src = (d / "model_new.py").read_text()
    assert HONEST_FORWARD in src
    (d / "model_new.py").write_text(src.replace(HONEST_FORWARD, VARIANTS[v]))
    return types.SimpleNamespace(name=name, task=base.task, device=base.device, dir=d, timeout_s=base.timeout_s)


def pct(x) -> str:
    return f"{100 * x:5.1f}" if isinstance(x, (int, float)) else "    -"


def ratio(x) -> str:
    return f"{x:.2f}" if isinstance(x, (int, float)) else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", default=DEFAULT_CASES)
    ap.add_argument("--server", default=os.environ.get("CUDA_AGENT_SERVER_BIN", str(ROOT / "target" / "release" / "env-server")))
    ap.add_argument("--overhead", action="store_true", help="also time the legitimate cases with --no-observe")
    args = ap.parse_args()
    cases = {c.name: c for c in load_cases()}
    scratch = Path(tempfile.mkdtemp(prefix="cuda-agent-variants-"))
    proc, url, base = start_server(args.server)
    print("| case | verdict | samples (cand/ref) | libtorch_cpu % (cand/ref/threshold) | reference kernel pages % (cand/ref) | time there per call, cand/ref (threshold) | note |")
    print("|---|---|---|---|---|---|---|")
    medians = {}
    try:
        for name in args.cases:
            r = run_case_server(case_for(name, cases, scratch), url).result
            o = (r.get("details") or {}).get("observed") or {}
            verdict = "paid" if r.get("correct") else f"-1 {r.get('rule')}"
            t = r.get("times_ms") or {}
            medians[name] = (t.get("candidate"), t.get("eager"))
            print(f"| {name} | {verdict} | {o.get('candidate_samples', '-')}/{o.get('reference_samples', '-')} | "
                  f"{pct(o.get('candidate_torch_share'))}/{pct(o.get('reference_torch_share'))}/{pct(o.get('library_threshold'))} | "
                  f"{pct(o.get('candidate_kernel_share'))}/{pct(o.get('reference_kernel_share'))} | "
                  f"{ratio(o.get('kernel_time_ratio'))} ({ratio(o.get('kernel_time_threshold'))}) | {o.get('reason') or ''} |", flush=True)
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(base, ignore_errors=True)
    if not args.overhead:
        return
    proc, url, base = start_server(args.server, "--no-observe")
    print("\n| case | candidate ms observed / not | eager ms observed / not |")
    print("|---|---|---|")
    try:
        for name in args.cases:
            if not medians.get(name) or medians[name][0] is None:
                continue
            r = run_case_server(case_for(name, cases, scratch / "off"), url).result
            t = r.get("times_ms") or {}
            (c1, e1), c2, e2 = medians[name], t.get("candidate"), t.get("eager")
            fmt = lambda x: f"{x:.3f}" if isinstance(x, (int, float)) else "-"  # noqa: E731
            print(f"| {name} | {fmt(c1)} / {fmt(c2)} | {fmt(e1)} / {fmt(e2)} |", flush=True)
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
