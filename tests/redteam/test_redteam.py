"""The red-team corpus against the final evaluation (skills/evaluate.py), one test per case.

Adversarial cases must fail with one of the rules cases.toml lists for them (or, where the case
says so, be judged correct only at an honest time); legitimate ones must pass. CUDA cases are
skipped without a GPU. Cases run one at a time and share one TORCH_EXTENSIONS_DIR, so the
shared extension is built once.

    python -m pytest tests/redteam            # the whole corpus (about 10-20 minutes on 2 cores)
    python -m pytest tests/redteam -k legit   # only the legitimate candidates
    REDTEAM_SERVER=http://127.0.0.1:8099 python -m pytest tests/redteam   # through env-server
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from corpus import HERE, cuda_available, judge, load_cases, run_case, run_case_server

pytestmark = pytest.mark.redteam

CASES = load_cases()


@pytest.fixture(scope="session")
def ext_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("torch_extensions")


@pytest.fixture(scope="session")
def has_cuda():
    return cuda_available()


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
def test_case(case, tmp_path, ext_dir, has_cuda, request):
    if case.device == "cuda" and not has_cuda:
        pytest.skip("no GPU")
    if case.known_gap:
        # Still run: the day the judge stops it, the report shows it as passing unexpectedly.
        request.applymarker(pytest.mark.xfail(reason=f"known gap: {case.known_gap}", strict=False))
    server = os.environ.get("REDTEAM_SERVER")
    outcome = run_case_server(case, server) if server else run_case(case, tmp_path, ext_dir)
    held, why = judge(case, outcome.result)
    assert held, f"{case.name} ({case.klass}): {why}\nverdict: {outcome.result}\nstderr: {outcome.stderr_tail}"
