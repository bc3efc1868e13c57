"""Runs the selected red-team cases REDTEAM_JOBS at a time (pytest's tests then wait for their
own).

Each case is still its own evaluation in its own directory and process group; running several
at once overlaps their interpreter start-ups, builds and timing loops, which leave cores idle
when cases run one at a time.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor


def jobs() -> int:
    """Cases in flight at once: REDTEAM_JOBS, else one per CPU."""
    return max(1, int(os.environ.get("REDTEAM_JOBS") or os.cpu_count() or 1))


class Pool:
    """Runs the cases' evaluations `jobs()` at a time, in the order they were submitted (the
    order the tests run in), so each test waits only for its own."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(jobs(), thread_name_prefix="redteam")
        self._futures: dict[str, Future] = {}

    def submit(self, key: str, fn, *args) -> None:
        self._futures[key] = self._executor.submit(fn, *args)

    def result(self, key: str):
        return self._futures[key].result()

    def close(self) -> None:
        # What has not started is dropped (a run stopped early); what runs ends on its own
        # timeout, in its own process group.
        self._executor.shutdown(wait=True, cancel_futures=True)


def selected_params(session, test_name: str, param: str) -> list:
    """The values of `param` of the collected (not deselected) items of test `test_name`, in
    run order."""
    values = []
    for item in session.items:
        callspec = getattr(item, "callspec", None)
        if getattr(item, "originalname", None) == test_name and callspec is not None and param in callspec.params:
            values.append(callspec.params[param])
    return values
