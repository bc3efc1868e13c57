"""A/A: the reference's own forward judged as the candidate. Its candidate is the task's
Model itself (ModelNew subclasses it) plus one no-op call into an extension so that it counts
as a custom-kernel candidate, evaluated with the reference's operators allowed (`--allow-ops`,
found from the trace's first refusal). It should measure 1.00x of eager, its 90% band holding
1.0: what it measures instead is the protocol's bias between the candidate's worker and the
reference's. Prints, per task and evaluation, both medians, the speedup over eager with its
band, and a summary per task.

    python scripts/bench_aa.py --device cpu                  # small task sizes, 3 evaluations each
    python scripts/bench_aa.py --device cuda --size full --evals 3
    python scripts/bench_aa.py --before /tmp/old/skills      # and an older judge, evaluations alternating

Runs the final evaluation's judge (skills/evaluate.py) the way the server runs it, minus the
sandbox: a fresh judge per evaluation, the candidate's worker started by the judge.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# One task of each kind the bundled tasks have.
TASKS = [
    ("elementwise", "level1/1_ReLU.py"),
    ("elementwise", "level1/2_Add.py"),
    ("reduction", "level1/16_LogSoftmax.py"),
    ("matmul", "level1/3_Matmul.py"),
    ("level-2 chain", "level2/2_Scale_Add_Tanh.py"),
    ("level-3 block", "level3/1_ResidualMLP.py"),
]

CANDIDATE_TAIL = '''

# ---- A/A: the reference's own forward as the candidate ----
from torch.utils.cpp_extension import load_inline as _aa_load_inline

_aa_ext = _aa_load_inline(name="aa_noop_ext", cpp_sources="void noop() {}", functions=["noop"], verbose=False)


class ModelNew(Model):
    def forward(self, *args):
        _aa_ext.noop()
        return super().forward(*args)
'''


def evaluate(skills: Path, task: Path, cand: Path, device: str, env: dict, allow: list, extra: list) -> dict:
    cmd = [sys.executable, str(skills / "evaluate.py"), "candidate", "--task", str(task), "--candidate", str(cand), "--device", device, *extra]
    if allow:
        cmd += ["--allow-ops", ",".join(allow)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in reversed(out.stdout.splitlines()):
        try:
            v = json.loads(line)
        except ValueError:
            continue
        if isinstance(v, dict) and "correct" in v:
            return v
    return {"correct": False, "rule": "no_verdict", "reason": out.stderr[-800:]}


def allowed_ops(skills: Path, task: Path, cand: Path, device: str, env: dict) -> list:
    """The reference's compute operators, from the trace's refusals (check only, no timing)."""
    allow: list = []
    for _ in range(8):
        r = evaluate(skills, task, cand, device, env, allow, ["--no-time", "--no-compile", "--seeds", "1"])
        if r.get("correct"):
            return allow
        reason = r.get("reason") or ""
        if r.get("rule") != "pytorch_compute" or "operators: " not in reason:
            raise SystemExit(f"{task.name}: the A/A candidate failed: {reason[:600]}")
        allow += [op.strip() for op in reason.split("operators: ", 1)[1].split("\n")[0].split(",") if op.strip()]
    raise SystemExit(f"{task.name}: no allow-list found")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--size", choices=["small", "full"], help="task size (default: small on CPU, full on CUDA)")
    p.add_argument("--evals", type=int, default=3, help="evaluations per task")
    p.add_argument("--tasks", nargs="*", help="task files relative to kernelbench/tasks (default: one of each kind)")
    p.add_argument("--compile", action="store_true", help="also time torch.compile (slow on CPU)")
    p.add_argument("--budget-s", type=float, default=2.0)
    p.add_argument("--skills", default=str(ROOT / "skills"), help="the judge's folder")
    p.add_argument("--before", help="an older judge's folder: each evaluation also runs there, the two alternating, for a before/after")
    p.add_argument("--json", help="also write every verdict here")
    args = p.parse_args()
    judges = [("after", Path(args.skills).resolve())]
    if args.before:
        judges.insert(0, ("before", Path(args.before).resolve()))
    size = args.size or ("full" if args.device == "cuda" else "small")
    tasks = [("", t) for t in args.tasks] if args.tasks else TASKS
    work = Path(tempfile.mkdtemp(prefix="bench-aa-"))
    env = dict(os.environ, CUDA_AGENT_TASK_SIZE=size, TORCH_EXTENSIONS_DIR=str(work / "torch_extensions"), PYTHONUNBUFFERED="1")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")  # ninja lives in the venv
    extra = ["--budget-s", str(args.budget_s)] + ([] if args.compile else ["--no-compile"])
    print(f"A/A on {args.device}, task size {size}, {args.evals} evaluations per task, judges: " + ", ".join(f"{n} {d}" for n, d in judges), flush=True)
    rows, summary, verdicts = [], [], []
    speedups: dict = {}
    for kind, rel in tasks:
        task = ROOT / "kernelbench" / "tasks" / rel
        cand = work / task.stem
        cand.mkdir()
        (cand / "model_new.py").write_text(task.read_text() + CANDIDATE_TAIL)
        allow = allowed_ops(judges[-1][1], task, cand, args.device, env)
        for i in range(args.evals):
            # Alternating which judge goes first: a drift of the machine's load is shared.
            for name, skills in (judges if i % 2 == 0 else judges[::-1]):
                t0 = time.perf_counter()
                r = evaluate(skills, task, cand, args.device, env, allow, extra)
                verdicts.append({"judge": name, "task": rel, "eval": i + 1, "wall_s": time.perf_counter() - t0, **r})
                if args.json:
                    Path(args.json).write_text(json.dumps(verdicts, indent=1))
                if not r.get("correct"):
                    rows.append([name, rel, str(i + 1), "-", "-", "-", "-", (r.get("reason") or "?")[:80].replace("|", "/")])
                else:
                    t, s = r["times_ms"], r["speedup"]["eager"]
                    lo, hi = r["noise_band"]["eager"]
                    speedups.setdefault((name, kind, rel), []).append(s)
                    compile_note = f", x compile {r['speedup']['compile']:.3f}" if "compile" in r["speedup"] else ""
                    rows.append([name, rel, str(i + 1), f"{t['eager']:.3f}", f"{t['candidate']:.3f}", f"{s:.3f}", f"{lo:.3f}-{hi:.3f}",
                                 ("holds 1.0" if lo <= 1.0 <= hi else "excludes 1.0") + compile_note])
                print("| " + " | ".join(rows[-1]) + " |", flush=True)
        for name, _ in judges:
            xs = speedups.get((name, kind, rel))
            if xs:
                summary.append([name, kind or "-", rel, f"{statistics.median(xs):.3f}", f"{min(xs):.3f}-{max(xs):.3f}", str(len(xs)), ",".join(allow) or "-"])
    print()
    print("| judge | task | eval | eager ms | candidate ms | x eager | 90% band | band |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()
    print("| judge | kind | task | median x eager | range | evaluations | operators allowed |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in summary:
        print("| " + " | ".join(row) + " |")
    print()
    for name, _ in judges:
        xs = [s for (n, _, _), v in speedups.items() if n == name for s in v]
        if xs:
            print(f"{name}: median x eager {statistics.median(xs):.3f}, mean {statistics.fmean(xs):.3f} over {len(xs)} evaluations")
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
