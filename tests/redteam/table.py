"""Runs the red-team corpus and prints a Markdown table: case | class | expected | got | verdict.

    python tests/redteam/table.py                 # every case this machine can run
    python tests/redteam/table.py -k cache_ late  # cases whose names contain any of the words
    python tests/redteam/table.py --json out.json # also keep the raw verdicts
    python tests/redteam/table.py --server http://127.0.0.1:8099   # through a running env-server

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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-k", nargs="*", default=[], help="run only cases whose names contain one of these")
    p.add_argument("--names", nargs="*", default=[], help="run only these cases (exact names)")
    p.add_argument("--json", help="write the raw verdicts here")
    p.add_argument("--ext-dir", help="TORCH_EXTENSIONS_DIR to use (default: a fresh temporary one)")
    p.add_argument("--server", help="evaluate through this env-server's POST /v1/evaluate instead of the CLI")
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
        for case in cases:
            expected = "pass" if not case.adversarial else " / ".join(case.expect)
            if case.device == "cuda" and not gpu:
                rows.append((case.name, case.klass, expected, "(no GPU)", "skipped"))
                continue
            work = Path(tmp) / case.name
            work.mkdir()
            outcome = run_case_server(case, args.server) if args.server else run_case(case, work, ext_dir)
            held, why = judge(case, outcome.result)
            raw[case.name] = {"result": outcome.result, "seconds": outcome.seconds, "held": held, "why": why}
            verdict = "held" if held else ("**PAID**" if outcome.result.get("correct") is True and case.adversarial else "**wrong**")
            rows.append((case.name, case.klass, expected, got_text(outcome.result), verdict))
            print(f"{case.name}: {verdict} ({why}) [{outcome.seconds:.0f} s]", file=sys.stderr, flush=True)
            if args.json:  # kept current after every case, so an interrupted run keeps what it did
                Path(args.json).write_text(json.dumps(raw, indent=1))
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
