"""`wait`'s loop and `run`'s time budget, either mode, either client (the transport does each
wait its way: `Transport.result`)."""
from __future__ import annotations

import time
from typing import Optional

from .errors import RAISED_BY_WAIT, JobNotFound, WaitTimeout, error_for
from .types import JobResult


class Waiting:
    """One `wait` for a job: how long the next wait may be (`left`), and what a result means
    (`done`: the terminal result, None to wait again, or the exception)."""

    def __init__(self, job_id: str, timeout: Optional[float], block_s: float, unknown: str, raise_on_error: bool):
        self.job_id, self.timeout, self.block_s = job_id, timeout, block_s
        self.unknown, self.raise_on_error = unknown, raise_on_error
        self.deadline = None if timeout is None else time.monotonic() + timeout

    def left(self) -> float:
        """Seconds the next wait may take: `block_s`, less near the deadline (0 past it)."""
        if self.deadline is None:
            return self.block_s
        return max(0.0, min(self.block_s, self.deadline - time.monotonic()))

    def done(self, result: Optional[JobResult]) -> Optional[JobResult]:
        """The terminal result; None when it is not yet and time is left. Raises `JobNotFound`
        (no result), the status's `JobError` (`RAISED_BY_WAIT`, unless told not to),
        `WaitTimeout` past the deadline."""
        if result is None:
            raise JobNotFound(f"job {self.job_id} is unknown ({self.unknown})")
        if result.terminal:
            if self.raise_on_error and result.status in RAISED_BY_WAIT:
                raise error_for(result)
            return result
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise WaitTimeout(f"job {self.job_id} is still {result.status} after {self.timeout} s")
        return None


def remaining(timeout: Optional[float], started: float) -> Optional[float]:
    """What is left of `timeout` (None: no limit) since `started` (time.monotonic())."""
    return None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
