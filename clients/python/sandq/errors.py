"""Exceptions. A job that ended other than `succeeded` is a `JobError` subclass named after its
status, carrying the result and the protocol's `reason`.

`wait`/`run` raise `JobRejected`, `JobExpired` and `JobInternalError` (the program never ran, or
sandq failed) by default; the statuses of a program that ran (`failed`, `timed_out`,
`oom_killed`) and `cancelled` come back as results: `result.raise_for_status()` raises them too.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from .types import JobResult


class SandqError(Exception):
    """Base class of every sandq exception."""


class SubmitError(SandqError):
    """The broker did not confirm the job, or returned it: it is not queued (retry with the same job id)."""


class WaitTimeout(SandqError, TimeoutError):
    """The job had no terminal result within the time the caller waited (it may still finish)."""


class JobNotFound(SandqError, KeyError):
    """No result under this job id: never submitted, or its result expired."""


class JobError(SandqError):
    """A job ended with `status` (not `succeeded`); `reason` is the protocol's reason, when any."""
    status = ""

    def __init__(self, result: "JobResult"):
        self.result = result
        self.job_id = result.job_id
        self.reason: Optional[str] = result.reason
        detail = result.reason or (f"exit code {result.exit_code}" if result.exit_code is not None else result.signal) or ""
        super().__init__(f"job {result.job_id} {result.status}" + (f": {detail}" if detail else ""))


class JobFailed(JobError):
    status = "failed"


class JobTimedOut(JobError):
    status = "timed_out"


class JobOOMKilled(JobError):
    status = "oom_killed"


class JobRejected(JobError):
    status = "rejected"


class JobCancelled(JobError):
    status = "cancelled"


class JobExpired(JobError):
    status = "expired"


class JobInternalError(JobError):
    status = "internal_error"


_BY_STATUS = {c.status: c for c in (JobFailed, JobTimedOut, JobOOMKilled, JobRejected, JobCancelled, JobExpired, JobInternalError)}

# Statuses that `wait` raises unless told not to: the job never ran its program to an end.
RAISED_BY_WAIT = frozenset({"rejected", "expired", "internal_error"})


def error_for(result: "JobResult") -> JobError:
    return _BY_STATUS.get(result.status, JobError)(result)
