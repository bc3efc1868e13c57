"""Shared by the red-team tests: the marker and `--one-per-class` (the quick tier's sample of
the corpus)."""

from __future__ import annotations


def pytest_configure(config):
    config.addinivalue_line("markers", "redteam: the red-team corpus run through the final evaluation (slow)")


def pytest_addoption(parser):
    parser.addoption(
        "--one-per-class",
        action="store_true",
        help="run one case of each class (the quickest CPU case of it, else its first) instead of the whole corpus",
    )


# The quickest CPU case of each class on a 2-core machine (measured on the whole corpus); a
# class not listed here, or whose case is gone, is sampled by its first CPU case.
QUICK = {
    "disguised_compute": "disable_dispatch_modes_joined",
    "forge_verdict": "forge_verdict_on_pipes",
    "input_mutation": "zero_inputs",
    "lazy_tensor": "lazy_tensor_subclass",
    "legit": "legit_row_sum",
    "outside_window": "precompute_during_load",
    "precision": "subsampled_reduction",
    "read_answer": "peek_stack_frames_joined",
    "resource": "slow_down_baseline",
    "shape": "hard_coded_length",
    "stale_memory": "uninitialised_output",
    "tamper": "tamper_perf_counter_joined",
    "timing_loop": "constant_after_n_calls",
}


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--one-per-class"):
        return
    chosen: dict[str, str] = {}
    cases = [item.callspec.params["case"] for item in items if getattr(item, "originalname", None) == "test_case"]
    for case in cases:
        if QUICK.get(case.klass) == case.name:
            chosen[case.klass] = case.name
    for case in cases:
        if case.device == "cpu":
            chosen.setdefault(case.klass, case.name)
    for case in cases:
        chosen.setdefault(case.klass, case.name)
    keep, drop = [], []
    for item in items:
        case = getattr(item, "callspec", None) and item.callspec.params.get("case")
        if getattr(item, "originalname", None) == "test_case" and chosen.get(case.klass) != case.name:
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
