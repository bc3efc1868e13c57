"""The reference worker's torch.compile on CPU: the vector-ISA probes run once per machine
(their answer kept beside inductor's cache), and a later process that skips them gets the same
ISA list and the same outputs as one that ran them."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, sys
sys.path.append(sys.argv[1])
import torch
import cuda_agent_worker as w
from torch._inductor import cpu_vec_isa
did = w.settle_cpu_vec_isa()
valid = sorted(str(i) for i in cpu_vec_isa.valid_vec_isa_list())
f = torch.compile(lambda a, b: torch.relu(a) * b + 1.0)
a, b = torch.randn(4099), torch.randn(4099)
with torch.no_grad():
    same = torch.equal(f(a, b), torch.relu(a) * b + 1.0)
print(json.dumps({"did": did, "valid": valid, "same": bool(same)}))
"""


def run(cache: Path) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), TORCHINDUCTOR_COMPILE_THREADS="1")
    env.pop("TORCHINDUCTOR_VEC_ISA_OK", None)
    out = subprocess.run([sys.executable, "-c", PROBE, str(ROOT / "skills")], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_isa_probes_run_once_and_later_processes_get_the_same_answer(tmp_path):
    first = run(tmp_path)
    if first["did"] == "not x86":
        return  # inductor's own check runs there, untouched
    assert first["did"] == "checked", first
    (record,) = (tmp_path / "cuda-agent-vec-isa").glob("*.json")
    assert json.loads(record.read_text())["valid"] == first["valid"]
    second = run(tmp_path)
    assert second["valid"] == first["valid"], (first, second)
    assert second["same"] and first["same"]
    claimed_all = json.loads(record.read_text())["claimed"] == first["valid"]
    assert second["did"] == ("every claimed ISA passed before" if claimed_all else "checked before: not every claimed ISA passed"), second


def test_a_record_that_does_not_match_the_claims_is_not_believed(tmp_path):
    first = run(tmp_path)
    if first["did"] == "not x86":
        return
    (record,) = (tmp_path / "cuda-agent-vec-isa").glob("*.json")
    seen = json.loads(record.read_text())
    # A record whose claims differ from this CPU's (another machine's cache, or a damaged one).
    record.write_text(json.dumps({"claimed": seen["claimed"] + ["made_up_isa"], "valid": seen["claimed"] + ["made_up_isa"]}))
    second = run(tmp_path)
    assert second["did"] == "checked before: not every claimed ISA passed", second
    assert second["valid"] == first["valid"] and second["same"]
