"""Runs the red-team corpus and prints a Markdown table: case | class | expected | got | verdict.

    python tests/redteam/table.py                 # every case this machine can run
    python tests/redteam/table.py -k cache_ late  # cases whose names contain any of the words
    python tests/redteam/table.py --json out.json # also keep the raw verdicts
    python tests/redteam/table.py --server http://127.0.0.1:8099   # through a running env-server
    python tests/redteam/table.py --server URL --jobs 8  # 8 cases in flight (the server builds them at once)

Uses $CUDA_AGENT_PYTHON (else this interpreter) to run skills/evaluate.py, one case at a
time, with one TORCH_EXTENSIONS_DIR for the whole run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import cuda_available, got_text, judge, load_cases, run_case, run_case_server  # noqa: E402


def expected_text(case) -> str:
    return "pass" if not case.adversarial else " / ".join(case.expect)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-k", nargs="*", default=[], help="run only cases whose names contain one of these")
    p.add_argument("--names", nargs="*", default=[], help="run only these cases (exact names)")
    p.add_argument("--json", help="write the raw verdicts here")
    p.add_argument("--ext-dir", help="TORCH_EXTENSIONS_DIR to use (default: a fresh temporary one)")
    p.add_argument("--server", help="evaluate through this env-server's POST /v1/evaluate instead of the CLI")
    p.add_argument("--jobs", type=int, default=1, help="with --server: cases in flight at once (builds run in parallel; the server still times one at a time per device)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline (faster; verdicts are the same)")
    p.add_argument("--evaluate", help="the evaluate.py to run (default: this checkout's skills/evaluate.py)")
    args = p.parse_args()
    if args.no_compile:
        import os

        os.environ["REDTEAM_NO_COMPILE"] = "1"
    if args.evaluate:
        import corpus
        corpus.EVALUATE = Path(args.evaluate).resolve()
    cases = [c for c in load_cases() if (not args.k or any(k in c.name for k in args.k)) and (not args.names or c.name in args.names)]
    if args.names:  # in the order given
        cases.sort(key=lambda c: args.names.index(c.name))
    gpu = cuda_available()
    rows, raw = [], {}
    with tempfile.TemporaryDirectory(prefix="redteam-") as tmp:
        ext_dir = Path(args.ext_dir) if args.ext_dir else Path(tmp) / "torch_extensions"
        ext_dir.mkdir(parents=True, exist_ok=True)
        runnable = []
        for case in cases:
            if case.device == "cuda" and not gpu:
                rows.append((case.name, case.klass, expected_text(case), "(no GPU)", "skipped"))
            else:
                runnable.append(case)

        def run(case):
            if args.server:
                return run_case_server(case, args.server)
            work = Path(tmp) / case.name
            work.mkdir()
            return run_case(case, work, ext_dir)

        def record(case, outcome):
            expected = expected_text(case)
            held, why = judge(case, outcome.result)
            raw[case.name] = {"result": outcome.result, "seconds": outcome.seconds, "held": held, "why": why}
            verdict = "held" if held else ("**PAID**" if outcome.result.get("correct") is True and case.adversarial else "**wrong**")
            rows.append((case.name, case.klass, expected, got_text(outcome.result), verdict))
            print(f"{case.name}: {verdict} ({why}) [{outcome.seconds:.0f} s]", file=sys.stderr, flush=True)
            if args.json:  # kept current after every case, so an interrupted run keeps what it did
                Path(args.json).write_text(json.dumps(raw, indent=1))

        if args.server and args.jobs > 1:
            from concurrent.futures import ThreadPoolExecutor, as_completed

            with ThreadPoolExecutor(args.jobs) as ex:
                futures = {ex.submit(run, case): case for case in runnable}
                for f in as_completed(futures):
                    record(futures[f], f.result())
            order = {c.name: i for i, c in enumerate(cases)}
            rows.sort(key=lambda r: order[r[0]])
        else:
            for case in runnable:
                record(case, run(case))
    print("| case | class | expected | got | verdict |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    held = sum(1 for r in rows if r[4] == "held")
    ran = sum(1 for r in rows if r[4] != "skipped")
    print(f"\n{held} of {ran} cases held ({len(rows) - ran} skipped).")
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
