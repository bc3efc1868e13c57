"""The red-team corpus against the final evaluation (skills/evaluate.py), one test per case.

Adversarial cases must fail with one of the rules cases.toml lists for them (or, where the case
says so, be judged correct only at an honest time); legitimate ones must pass. CUDA cases are
skipped without a GPU. Cases run REDTEAM_JOBS at a time (default: one per CPU), each in its own
directory and process group, and share one TORCH_EXTENSIONS_DIR, so the shared extension is
built once (torch's build lock makes the others wait for it). Their judges are forked from a
warm one (README.md says which are not).

    python -m pytest tests/redteam            # the whole corpus
    python -m pytest tests/redteam -k legit   # only the legitimate candidates
    python -m pytest tests/redteam/test_redteam.py --one-per-class   # one case of each class
    REDTEAM_JOBS=1 python -m pytest tests/redteam   # one case at a time
    REDTEAM_ZYGOTE=0 python -m pytest tests/redteam   # every judge started afresh
    REDTEAM_EXT_DIR=DIR python -m pytest tests/redteam   # keep the extensions' builds in DIR
    REDTEAM_SERVER=http://127.0.0.1:8099 python -m pytest tests/redteam   # through env-server
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from corpus import HERE, JudgeZygote, case_env, cuda_available, judge, load_cases, run_case, run_case_server
from pool import Pool, selected_params

pytestmark = pytest.mark.redteam

CASES = load_cases()

# The cases' own wall times in seconds (`case_seconds`), two at a time on the 2-core CI
# machine, for those over 9 s: the order the runner starts them in.
LONGEST = {
    "hang_in_forward": 22, "aten_cpu_direct_obfuscated": 31, "lazy_tensor_subclass_obfuscated": 26,
    "legit_kernels_helper_module": 22, "dilute_hidden_compute": 20, "hidden_compute_in_cpp_thread": 19,
    "cache_by_object_identity": 19, "cache_by_sampled_hash": 19, "legit_kernels_dir": 18,
    "flood_observer_rings": 18, "tamper_trace_method_obfuscated": 17, "legit_slow_correct": 14,
    "call_interval_detector": 14, "tamper_perf_counter_obfuscated": 13, "cache_by_data_ptr": 13,
    "tamper_main_rebind_obfuscated": 12, "infinity_saturated": 11, "legit_exp_overflow": 10,
    "cpu_burner_thread": 10, "constant_after_n_calls": 10, "legit_thread_pool_joined": 10,
    "legit_model_style_main_guard": 9, "process_spawn_storm": 9, "hard_coded_length": 9,
}


@pytest.fixture(scope="session")
def ext_dir(tmp_path_factory):
    # REDTEAM_EXT_DIR keeps the builds from one run to the next (scripts/test.sh --quick, where
    # building the shared extension is most of the run); torch rebuilds what changed.
    kept = os.environ.get("REDTEAM_EXT_DIR")
    if not kept:
        return tmp_path_factory.mktemp("torch_extensions")
    path = Path(kept)
    path.mkdir(parents=True, exist_ok=True)
    # A run stopped mid-build leaves torch's build lock behind, and torch would wait for it
    # forever.
    for lock in path.glob("*/lock"):
        lock.unlink(missing_ok=True)
    return path


@pytest.fixture(scope="session")
def has_cuda():
    return cuda_available()


@pytest.fixture(scope="session")
def outcomes(request, ext_dir, has_cuda, tmp_path_factory):
    """Every selected case's evaluation, queued at the first case's test and run REDTEAM_JOBS
    at a time, the longest first (LONGEST); each test waits for its own."""
    server = os.environ.get("REDTEAM_SERVER")
    # One warm judge the cases' judges are forked from (corpus.JudgeZygote; REDTEAM_ZYGOTE=0:
    # each judge started afresh, as for the cases that look at their parent anyway).
    zygote = None if server or os.environ.get("REDTEAM_ZYGOTE") == "0" else JudgeZygote(case_env(ext_dir))

    def run(case, work):
        return run_case_server(case, server) if server else run_case(case, work, ext_dir, zygote=zygote)

    pool = Pool()
    # The longest cases first (a stable sort: the rest in test order), so that none of them
    # ends the phase alone with the other slots idle.
    cases = sorted(selected_params(request.session, "test_case", "case"), key=lambda c: -LONGEST.get(c.name, 0))
    for case in cases:
        if case.device == "cpu" or has_cuda:
            pool.submit(case.name, run, case, tmp_path_factory.mktemp(case.name))
    yield pool
    pool.close()
    if zygote is not None:
        zygote.close()


def test_the_corpus_is_complete_and_consistent():
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))
    assert {p.name for p in (HERE / "cases").iterdir() if p.is_dir()} == set(names)
    adversarial = [c for c in CASES if c.adversarial]
    legit = [c for c in CASES if not c.adversarial]
    assert len(adversarial) >= 34 and len(legit) >= 10
    assert len([c for c in CASES if c.device == "cuda"]) >= 8
    for c in CASES:
        assert c.device in ("cpu", "cuda")
        assert (HERE.parents[1] / c.task).is_file(), c.task
        assert (c.dir / "model_new.py").is_file()
        assert c.expect == "pass" or (isinstance(c.expect, list) and c.expect), c.name
        assert (c.klass == "legit") == (c.expect == "pass"), c.name


def test_every_case_embeds_the_shared_extension_verbatim():
    """One build serves the corpus only if every embedded copy is the same text."""
    check = subprocess.run([sys.executable, str(HERE / "sync_shared.py"), "--check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case(case, outcomes, has_cuda, request):
    if case.device == "cuda" and not has_cuda:
        pytest.skip("no GPU")
    if case.known_gap:
        # Still run: the day the judge stops it, the report shows it as passing unexpectedly.
        request.applymarker(pytest.mark.xfail(reason=f"known gap: {case.known_gap}", strict=False))
    outcome = outcomes.result(case.name)
    # The case's own wall time (the test's duration includes waiting for its turn); in
    # --junitxml reports.
    request.node.user_properties.append(("case_seconds", round(outcome.seconds, 1)))
    held, why = judge(case, outcome.result)
    assert held, f"{case.name} ({case.klass}): {why}\nverdict: {outcome.result}\nstderr: {outcome.stderr_tail}"
