"""SKILL.md, the page every agent reads whole, states what the judge enforces: every rule a
verdict can name, every class of construct the static check refuses, the judge's own numbers
(input sets, tolerances, off-distribution factor, timing rounds) and the reward's rule word for
word. The detail may live in SKILL_REFERENCE.md; nothing the judge enforces may live only there.
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKILLS = ROOT / "skills"
sys.path.append(str(SKILLS))
import cuda_agent_harness as h  # noqa: E402
import cuda_agent_judge as judge  # noqa: E402
import torch  # noqa: E402

SKILL = (SKILLS / "SKILL.md").read_text()
REFERENCE = (SKILLS / "SKILL_REFERENCE.md").read_text()
# Rules the harness itself fails with, never the candidate's doing.
NOT_THE_CANDIDATES = {"harness_error", "reference_not_loaded"}


def flat(text: str) -> str:
    """The page with line breaks and indentation folded, as a reader reads a sentence."""
    return re.sub(r"\s+", " ", text)


def rules_the_judge_names() -> set[str]:
    names = set(judge.WORKER_RULES)
    for f in ("cuda_agent_judge.py", "cuda_agent_worker.py", "cuda_agent_harness.py"):
        names |= set(re.findall(r'RuleBreak\("([a-z_]+)"', (SKILLS / f).read_text()))
    # The server's own verdicts on a candidate (env-server/src/evaluation/volume.rs).
    names |= {"disk_quota", "inode_quota"}
    return names - NOT_THE_CANDIDATES


def test_every_rule_a_verdict_can_name_is_on_the_first_page():
    names = rules_the_judge_names()
    assert {"wrong_output", "late_work", "forbidden_source", "impossible_time"} <= names
    missing = sorted(n for n in names if f"`{n}`" not in SKILL)
    assert not missing, f"SKILL.md does not name {missing}"


# How SKILL.md's rule 7 says each class of STATIC_RULES, in its own words.
STATIC_WORDS = {
    "compile": "`torch.compile`",
    "dispatch": "dispatcher hooks",
    "frames": "stack frames",
    "gc": "garbage collector's objects",
    "memory": "another process's memory",
    "modules": "the evaluation's modules",
    "rebind": "rebinding",
    "patch": "patching of library functions",
    "numpy": "computing through numpy",
    "aten": "calling ATen around the dispatcher",
    "precision": "changing precision settings",
    "exec": "code built at run time",
}


def test_every_class_the_static_check_refuses_is_on_the_first_page():
    assert set(STATIC_WORDS) == set(judge.STATIC_RULES), "a new STATIC_RULES class: say it in SKILL.md's rule 7 and here"
    page = flat(SKILL)
    missing = sorted(k for k, words in STATIC_WORDS.items() if words not in page)
    assert not missing, missing


def test_the_reward_rule_is_the_judges_word_for_word():
    assert judge.milestone_rule() in SKILL
    assert "1.053" in judge.milestone_rule()


def sci(x: float) -> str:
    """1e-4 as the page writes it (Python writes 0.0001 or 1e-04)."""
    return f"{x:.0e}".replace("e-0", "e-")


def test_the_conditions_are_the_judges_numbers():
    page = flat(SKILL)
    names = {torch.float32: "float32", torch.float64: "float64"}
    for dtype, name in names.items():
        atol, rtol = h.TOLERANCE[dtype]
        assert atol == rtol
        assert f"{sci(atol)} for {name}" in page, name
    assert h.TOLERANCE[torch.float16] == h.TOLERANCE[torch.bfloat16]
    assert f"{sci(h.TOLERANCE[torch.float16][0])} for float16 and bfloat16" in page
    opts = judge.Options()
    assert f"**{len(opts.seeds)} input sets**" in page
    assert f"{judge.OFF_DISTRIBUTION_TOLERANCE:g} times the tolerance" in page
    assert f"{opts.warmup_rounds} warm-up rounds then {opts.min_rounds}-{opts.max_rounds} rounds" in page
    assert f"about {opts.budget_s:g} s each" in page
    for words in ("torch.no_grad()", ".eval()", "get_inputs_alt()", "90th percentile", "TF32 is off",
                  "with torch.device(device)", "dtype and shape", "off the distribution"):
        assert words in page, words


def test_the_reference_keeps_the_detail_and_both_devices():
    for words in ("## On a CPU", "## On a GPU", "PYBIND11_MODULE", "_compile_kernel", "OMP_WAIT_POLICY=PASSIVE",
                  "max_rel_error", "three times its timeout", "PYTHONFAULTHANDLER", "--budget-s 5"):
        assert words in flat(REFERENCE), words
    for marker in ("<!-- device: cpu -->", "<!-- device: cuda -->"):
        assert SKILL.count(marker) == 1 and REFERENCE.count(marker) == 1, marker
