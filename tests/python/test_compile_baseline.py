"""The reference worker's torch.compile on CPU: inductor's vector-ISA probes (each a fresh
Python importing torch) run once per machine, their passes kept beside inductor's cache, and a
later process that answers them from the record gets the same ISA list and the same outputs as
one that ran them. A record never stands for a probe it was not made for."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, sys
sys.path.append(sys.argv[1])
import torch
import cuda_agent_worker as w
from torch._inductor import cpu_vec_isa
did = w.settle_cpu_vec_isa()
valid = sorted(str(i) for i in cpu_vec_isa.valid_vec_isa_list())
picked = str(cpu_vec_isa.pick_vec_isa())
f = torch.compile(lambda a, b: torch.relu(a) * b + 1.0)
a, b = torch.randn(4099), torch.randn(4099)
with torch.no_grad():
    same = torch.equal(f(a, b), torch.relu(a) * b + 1.0)
print(json.dumps({"did": did, "valid": valid, "picked": picked, "same": bool(same), **w.VEC_ISA_PROBES}))
"""


def run(cache: Path) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), TORCHINDUCTOR_COMPILE_THREADS="1")
    env.pop("TORCHINDUCTOR_VEC_ISA_OK", None)
    out = subprocess.run([sys.executable, "-c", PROBE, str(ROOT / "skills")], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cold(tmp_path_factory) -> tuple[dict, Path]:
    """One process on an empty cache (the probes run, the compile is made), for both tests:
    the same first run each would make; each goes on with a copy of what it left."""
    cache = tmp_path_factory.mktemp("inductor-cache")
    return run(cache), cache


def first_run(cold, tmp_path) -> tuple[dict, Path]:
    first, cache = cold
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy, symlinks=True)
    return first, copy


def test_the_isa_probes_run_once_and_later_processes_get_the_same_answer(cold, tmp_path):
    first, cache = first_run(cold, tmp_path)
    if first["did"] == "not x86":
        return  # inductor's own check runs there, untouched
    assert first["did"] == "probes remembered", first
    assert first["ran"] >= 1 and first["remembered"] == 0, first
    records = list((cache / "cuda-agent-vec-isa").glob("*.passed"))
    assert 1 <= len(records) <= first["ran"]
    second = run(cache)
    # Every probe that passed is answered from its record; only failed ones run again.
    assert second["remembered"] == len(records), second
    assert second["ran"] == first["ran"] - len(records), (first, second)
    assert (second["valid"], second["picked"]) == (first["valid"], first["picked"]), (first, second)
    assert second["same"] and first["same"]


def test_a_record_is_not_believed_for_another_machine(cold, tmp_path):
    first, cache = first_run(cold, tmp_path)
    if first["did"] == "not x86":
        return
    records = sorted((cache / "cuda-agent-vec-isa").glob("*.passed"))
    # Records made under other keys (another torch, compiler or probe): none of them answers.
    for r in records:
        r.rename(r.with_name("0" + r.name[1:]) if not r.name.startswith("0") else r.with_name("1" + r.name[1:]))
    second = run(cache)
    assert second["remembered"] == 0 and second["ran"] == first["ran"], second
    assert second["valid"] == first["valid"] and second["same"]
