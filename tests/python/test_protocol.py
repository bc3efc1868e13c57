"""The worker's replies as the judge reads them: one typed parser (cuda_agent_judge.parse_reply)
for every op, its table the same as docs/EVALUATION.md's and as the ops the worker answers,
and no reply a candidate can shape (its process owns the candidate worker's channel) ending
anywhere but in a verdict: a field of the wrong type is `protocol` (-1), never `harness_error`."""

import ast
import copy
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT / "skills"))
import cuda_agent_harness as h  # noqa: E402
import cuda_agent_judge as judge  # noqa: E402

HOSTILE_WORKER = Path(__file__).resolve().parent / "hostile_worker.py"


# -- the table, the worker and the docs agree -------------------------------------------------


def worker_ops() -> set:
    """The ops cuda_agent_worker.py answers: `op == "..."` in Worker.handle and in serve."""
    tree = ast.parse((ROOT / "skills" / "cuda_agent_worker.py").read_text())
    ops = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name in ("handle", "serve"):
            for node in ast.walk(fn):
                if isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.Eq) and isinstance(node.comparators[0], ast.Constant):
                    left = node.left
                    if (isinstance(left, ast.Name) and left.id == "op") or (isinstance(left, ast.Call) and ast.unparse(left) == "msg.get('op')"):
                        ops.add(node.comparators[0].value)
    return ops


def judge_ops() -> set:
    """The ops the judge sends: `{"op": "..."}` in cuda_agent_judge.py."""
    tree = ast.parse((ROOT / "skills" / "cuda_agent_judge.py").read_text())
    return {v.value for d in ast.walk(tree) if isinstance(d, ast.Dict)
            for k, v in zip(d.keys, d.values) if isinstance(k, ast.Constant) and k.value == "op" and isinstance(v, ast.Constant)}


def documented() -> dict:
    """op -> the reply fields docs/EVALUATION.md lists for it."""
    text = (ROOT / "docs" / "EVALUATION.md").read_text()
    section = text.split("### The worker's messages", 1)[1].split("\n#", 1)[0]
    table = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            table[cells[0].strip("`")] = set(re.findall(r"`(\w+)`", cells[2]))
    return table


def test_the_worker_the_judge_the_table_and_the_docs_name_the_same_ops():
    ops = set(judge.REPLY_FIELDS) | {"exit"}  # exit has no reply
    assert worker_ops() == ops
    assert judge_ops() <= ops
    assert set(documented()) == ops


def test_the_docs_list_every_reply_field_the_judge_reads():
    docs = documented()
    for op, fields in judge.REPLY_FIELDS.items():
        # The reply's own fields, and what is inside them (an output's fields) besides.
        assert set(fields) <= docs[op] and (fields or not docs[op]), op


# -- every field of every reply, every wrong type ---------------------------------------------

VALID = {
    "ready": {},
    "hello": {"pid": 12, "build_s": 0.5, "extensions": ["rt_ext"], "steps_s": {"import": 0.25}},
    "model": {"weights": {"loaded": 2, "reference_not_loaded": ["w"], "candidate_own": []}},
    "slot": {},
    "load": {},
    "inputs": {},
    "drop": {},
    "stats": {"peak_rss_bytes": 1 << 20, "peak_cuda_reserved_bytes": 0},
    "run": {"outputs": [{"kind": "tensor", "device": "cpu", "shape": [4], "dtype": "float32", "offset": 0, "nbytes": 16, "file_bytes": 256},
                        {"kind": "value", "value": 3}],
            "trace": {"forbidden": [], "extension_calls": 1, "profiler_unavailable": "no"}},
}
VALID_CUDA_RUN = {"outputs": [{"kind": "tensor", "device": "cuda", "shape": [2, 2], "stride": [2, 1], "dtype": "float32",
                               "ipc": {"handle": "ab" * 64, "alloc_bytes": 1024, "offset": 0}}]}


def deep(n: int):
    v: list = []
    for _ in range(n):
        v = [v]
    return v


HOSTILE = [None, True, False, 0, -1, 1 << 70, 1.5, float("nan"), float("inf"), "", "x", "\ud800", [], [None], ["x"], [1.5], [-1], {}, {"a": 1}, deep(5000)]


def paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths(v, prefix + (i,))


def replaced(reply: dict, path: tuple, value) -> dict:
    out = copy.deepcopy(reply)
    target = out
    for k in path[:-1]:
        target = target[k]
    target[path[-1]] = value
    return out


def consume(op: str, parsed: dict, device_type: str, tmp_path: Path) -> None:
    """What the judge does with a parsed reply: outputs read (CPU), details written as JSON."""
    if op == "run" and device_type == "cpu":
        j = judge.Judge.__new__(judge.Judge)
        j.device, j.reference_output_bytes = torch.device("cpu"), 16
        link = judge.WorkerLink("candidate", None, os.getpid(), tmp_path, None)
        j.ref, j.cand = None, link
        (tmp_path / "out-check.bin").write_bytes(bytes(256))
        j.outputs(link, "check", parsed)
        for r in link.opened:
            r.close()
    rest = {k: v for k, v in parsed.items() if k != "outputs"}
    json.dumps(rest, allow_nan=False).encode("utf-8")


def cases():
    for op, reply in VALID.items():
        for p in paths(reply):
            if p:
                yield op, "cpu", reply, p
    for p in paths(VALID_CUDA_RUN):
        if p:
            yield "run", "cuda", VALID_CUDA_RUN, p


@pytest.mark.parametrize("op,device_type,reply,path", list(cases()), ids=lambda v: "/".join(map(str, v)) if isinstance(v, tuple) else str(v)[:12])
def test_a_wrong_type_in_any_field_is_a_protocol_break_or_harmless(tmp_path, op, device_type, reply, path):
    for value in HOSTILE:
        msg = dict(replaced(reply, path, value), seq=7, ok=True)
        try:
            parsed = judge.parse_reply(op, msg, 7, "candidate", device_type)
            consume(op, parsed, device_type, tmp_path)
        except h.RuleBreak as e:
            assert e.rule in ("protocol", "wrong_output"), (path, value, e.rule, str(e))


def test_valid_replies_parse_to_their_types(tmp_path):
    for op, reply in VALID.items():
        parsed = judge.parse_reply(op, dict(reply, seq=1, ok=True), 1, "candidate", "cpu")
        consume(op, parsed, "cpu", tmp_path)
    parsed = judge.parse_reply("run", dict(VALID_CUDA_RUN, seq=1, ok=True), 1, "candidate", "cuda")
    assert parsed["outputs"][0].shape == (2, 2) and parsed["outputs"][0].ipc.alloc_bytes == 1024


@pytest.mark.parametrize("reply", [
    [], "x", None, {"ok": True}, {"seq": "7", "ok": True}, {"seq": True, "ok": True}, {"seq": 8, "ok": True},
    {"seq": 7}, {"seq": 7, "ok": "yes"}, {"seq": 7, "ok": 1}, {"seq": 7, "ok": False}, {"seq": 7, "ok": False, "rule": 5},
    {"seq": 7, "ok": False, "rule": "harness_error", "message": "x"}, {"seq": 7, "ok": False, "rule": "runtime_error", "message": 5},
    {"seq": 7, "ok": False, "rule": "runtime_error", "message": "x", "traceback": ["t"]}, {"seq": 7, "ok": True, "outputs": None},
])
def test_a_malformed_envelope_is_a_protocol_break(reply):
    with pytest.raises(h.RuleBreak) as e:
        judge.parse_reply("run", reply, 7, "candidate", "cpu")
    assert e.value.rule == "protocol", str(e.value)


def test_a_failure_report_keeps_its_rule_and_a_text_the_verdict_can_carry():
    with pytest.raises(h.RuleBreak) as e:
        judge.parse_reply("run", {"seq": 3, "ok": False, "rule": "runtime_error", "message": "bad \ud800 byte"}, 3, "candidate", "cpu")
    assert e.value.rule == "runtime_error"
    str(e.value).encode("utf-8")


def test_the_verdict_line_is_always_json_the_server_reads():
    line = judge.verdict_json({"correct": False, "reason": "x \ud800", "details": {"build_s": float("nan"), "n": [float("inf"), 1.0]}})
    back = json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in the verdict"))
    line.encode("utf-8")
    assert back["details"]["build_s"] is None and back["details"]["n"] == [None, 1.0]


def test_a_message_nested_too_deep_is_garbage_not_a_crash():
    r, w = os.pipe()
    try:
        data = b"[" * 200_000 + b"]" * 200_000
        with pytest.raises(ValueError):
            os.write(w, len(data).to_bytes(4, "big"))
            import threading

            threading.Thread(target=lambda: os.write(w, data), daemon=True).start()
            h.Channel(r, w).recv(timeout=10)
    finally:
        os.close(r)
        os.close(w)


# -- end to end: a candidate worker that shapes its replies -----------------------------------

TASK = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, a, b):
        return a + b


def get_inputs():
    return [torch.randn(1000), torch.randn(1000)]


def get_init_inputs():
    return []
'''

CANDIDATE = "import torch.nn as nn\n\n\nclass ModelNew(nn.Module):\n    def forward(self, a, b):\n        return a + b\n"

REWRITES = [
    {"op": "run", "path": ["outputs", 0, "shape"], "value": ["many", "rows"]},
    {"op": "run", "path": ["outputs", 0, "shape"], "value": [1000.0]},
    {"op": "run", "path": ["outputs", 0, "dtype"], "value": 5},
    {"op": "run", "path": ["outputs", 0, "offset"], "value": "0"},
    {"op": "run", "path": ["outputs", 0, "nbytes"], "value": 1 << 40},
    {"op": "run", "path": ["outputs"], "value": {"0": 1}},
    {"op": "run", "path": ["trace"], "value": "clean"},
    {"op": "run", "path": ["ok"], "value": "yes"},
    {"op": "run", "path": ["seq"], "value": "1"},
    {"op": "run", "field": "outputs", "raw": "[" * 20_000 + "]" * 20_000},
    {"op": "hello", "field": "build_s", "raw": "NaN"},
    {"op": "hello", "path": ["extensions"], "value": [1, 2]},
    {"op": "model", "path": ["weights"], "value": "all"},
    {"op": "stats", "path": ["peak_rss_bytes"], "value": "lots"},
]


def evaluate_with(tmp_path: Path, monkeypatch, rewrite: dict) -> dict:
    (tmp_path / "task.py").write_text(TASK)
    cand = tmp_path / "cand"
    cand.mkdir()
    (cand / "model_new.py").write_text(CANDIDATE)
    monkeypatch.setattr(judge, "WORKER", HOSTILE_WORKER)
    monkeypatch.setenv("HOSTILE_REPLY", json.dumps(rewrite))
    opts = judge.Options(device="cpu", time=False, compile=False, seeds=[1, 2], setup_timeout=120, call_timeout=60)
    return judge.evaluate(tmp_path / "task.py", cand, opts, workdir=tmp_path / "work")


def test_the_hostile_worker_passes_when_it_rewrites_nothing(tmp_path, monkeypatch):
    (tmp_path / "work").mkdir()
    result = evaluate_with(tmp_path, monkeypatch, {})
    assert result["correct"] is True, result


@pytest.mark.parametrize("rewrite", REWRITES, ids=lambda r: f"{r['op']}:{'/'.join(map(str, r.get('path') or [r['field']]))}")
def test_no_reply_a_candidate_can_shape_reaches_harness_error(tmp_path, monkeypatch, rewrite):
    (tmp_path / "work").mkdir()
    result = evaluate_with(tmp_path, monkeypatch, rewrite)
    assert result["correct"] is False and result["rule"] == "protocol", result
    judge.verdict_json(result).encode("utf-8")
