"""The milestone reward's rule in the judge's module (cuda_agent_judge.beats, milestone), which
profile.py prints by, is the server's (env-server/src/reward.rs): the same margin and formula,
on medians, the noise band deciding nothing."""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT / "skills"))
import cuda_agent_judge as judge  # noqa: E402


def test_the_rule_is_the_servers():
    rust = (ROOT / "env-server" / "src" / "reward.rs").read_text()
    m = re.search(r"fn beats\(candidate_ms: f64, baseline_ms: f64\) -> bool \{\s*baseline_ms > 0\.0 && \(baseline_ms - candidate_ms\) / baseline_ms > ([0-9.]+)\s*\}", rust)
    assert m, "reward.rs's beats changed: change cuda_agent_judge.beats with it"
    assert float(m.group(1)) == judge.MILESTONE_MARGIN


@pytest.mark.parametrize("correct,cand,eager,comp,want", [
    (False, 1.0, 2.0, 2.0, -1),
    (True, None, 2.0, 2.0, 1),
    (True, 1.0, None, 2.0, 1),
    (True, 0.95, 1.0, 1.0, 3),  # exactly 5% below: (1 - 0.95) / 1 is 0.05000000000000004 in binary, as in Rust
    (True, 0.96, 1.0, 0.5, 1),
    (True, 1.0, 2.0, 0.5, 2),
    (True, 1.0, 2.0, None, 2),
    (True, 1.0, 2.0, 1.06, 3),
    (True, 1.0, 2.0, 1.05, 2),  # 1.05 ms is 4.8% above 1.0 ms: torch.compile not beaten
])
def test_milestones(correct, cand, eager, comp, want):
    assert judge.milestone(correct, cand, eager, comp) == want


def test_profile_says_reached_exactly_when_the_reward_counts_it():
    for i in range(1, 400):
        cand = 0.90 + i * 0.0005
        note = judge.milestone_note(cand, 1.0, None)
        assert ("milestone reached" in note) == judge.beats(cand, 1.0), cand


def test_a_band_across_the_threshold_is_said_to_be_at_risk():
    assert "may not reach it" in judge.milestone_note(0.9, 1.0, (1.0, 1.2))
    assert "may reach it" in judge.milestone_note(0.97, 1.0, (0.98, 1.08))
    assert "straddles" not in judge.milestone_note(0.8, 1.0, (1.15, 1.35))
