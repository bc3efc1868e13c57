"""The server's outside observation of the workers' CPU, against the corpus's candidates that
hide PyTorch compute from their own process's trace (paid by the judge alone, which believes
that trace) and the legitimate CPU candidates most at risk from it (several extension calls,
OpenMP, ATen's parallel_for, a strided output the worker copies, an integer output).

Runs through a real server binary (`CUDA_AGENT_SERVER_BIN`, as scripts/test.sh sets it), since
the observation is the server's: it samples the workers' threads with the kernel's perf events,
which needs root. Where the kernel refuses, the server says so in `details.observed` and these
tests are skipped with that reason. The cases go to the server REDTEAM_JOBS at a time (it builds
them at once and times one at a time per device)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from corpus import judge, load_cases, run_case_server, start_server
from pool import Pool, selected_params

CASES = {c.name: c for c in load_cases()}
# (disable_dispatch_modes_obfuscated left this list when the worker's trace took the profiler's
# operator callbacks, which the dispatch modes do not switch off: the trace fails it now.)
HIDDEN = ["tamper_worker_obfuscated", "tamper_trace_method_obfuscated", "aten_cpu_direct_obfuscated", "dilute_hidden_compute", "flood_observer_rings"]
LEGIT = ["legit_several_ext_calls", "legit_openmp_add", "legit_matmul_parallel_for", "legit_transposed_view_output", "legit_integer_output"]

pytestmark = pytest.mark.redteam


@pytest.fixture(scope="module")
def server():
    binary = os.environ.get("CUDA_AGENT_SERVER_BIN")
    if not binary or not Path(binary).is_file():
        pytest.skip("no server binary (CUDA_AGENT_SERVER_BIN): scripts/test.sh sets it")
    # Its builds run at background priority beside the cases being timed (and, on a shared
    # machine, beside anything else): the subject here is the observation, not the build
    # limit, so a slow build must not end a case as `time_limit`.
    proc, url, base = start_server(binary, "--eval-timeout-s", "900")
    yield url
    proc.kill()
    proc.wait()
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def outcomes(request, server):
    """The selected cases' verdicts from the server, requested as the module begins."""
    pool = Pool()
    for test_name in ("test_hidden_pytorch_compute_is_observed", "test_legitimate_candidates_stay_clear"):
        for name in selected_params(request.session, test_name, "name"):
            pool.submit(name, run_case_server, CASES[name], server)
    yield pool
    pool.close()


def observed(result: dict) -> dict:
    obs = (result.get("details") or {}).get("observed")
    if result.get("correct") is None:
        pytest.fail(f"the server failed: {result}")
    return obs or {}


@pytest.mark.parametrize("name", HIDDEN)
def test_hidden_pytorch_compute_is_observed(outcomes, name):
    result = outcomes.result(name).result
    obs = observed(result)
    if result.get("correct") and not obs.get("available"):
        pytest.skip(f"the server could not observe: {obs.get('reason')}")
    assert result.get("correct") is False and result.get("rule") == "pytorch_compute", f"paid: {obs}"
    reason = result.get("reason", "")
    assert "observed from outside" in reason or "lost" in reason, reason


@pytest.mark.parametrize("name", LEGIT)
def test_legitimate_candidates_stay_clear(outcomes, name):
    result = outcomes.result(name).result
    held, why = judge(CASES[name], result)
    assert held, f"{name}: {why}\n{result}"
    obs = observed(result)
    if obs.get("available") and obs.get("kernel_time_threshold") is not None:
        # With room to spare: an honest forward's time is its own extension's.
        assert obs["kernel_time_ratio"] < obs["kernel_time_threshold"] / 2, obs
        assert obs["candidate_torch_share"] < obs["library_threshold"] / 2, obs
