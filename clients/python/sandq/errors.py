"""Exceptions. A job that ended other than `succeeded` is a `JobError` subclass named after its
status, carrying the result and the protocol's `reason`.

`wait`/`run` raise `JobRejected`, `JobExpired` and `JobInternalError` (the program never ran, or
sandq failed) by default; the statuses of a program that ran (`failed`, `timed_out`,
`oom_killed`) and `cancelled` come back as results: `result.raise_for_status()` raises them too.

Over HTTP (`Client(url=...)`), an error answer of sandq-gateway (an RFC 9457 problem document,
docs/gateway.md "Errors") is raised as the class of its stable `type`, with the document in
`.problem`: `unauthorized` -> `Unauthorized`; `forbidden-by-quota` -> `ForbiddenByQuota`;
`quota-exceeded` -> `QuotaExceeded` (`.retry_after`); `not-found` -> `NotFound` (`JobNotFound`
for a job); `conflict` -> `Conflict`; `unavailable` (and a gateway that cannot be reached) ->
`Unavailable` (`.retry_after`; a submission's is a `SubmitError`); `invalid-request`,
`unsupported-media-type`, `body-too-large`, `body-timeout`, `method-not-allowed` ->
`InvalidRequest`; any other -> `GatewayError`. The classes name what happened, whichever mode
raised them (`JobNotFound` in direct mode too); only `problem` says it came from the gateway.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol


@dataclass(frozen=True)
class Problem:
    """A problem document of sandq-gateway (RFC 9457): `type` is a stable URN
    (`urn:sandq:problem:<slug>`), `status` the HTTP status, `detail` what was wrong with this
    request, `retry_after` the seconds to wait before trying again (429, 503; from the body or
    the `Retry-After` header), `raw` the document as it came (an answer that was not a problem
    document gets `type` `about:blank` and its first bytes in `detail`)."""
    type: str
    status: int
    title: str = ""
    detail: str = ""
    retry_after: Optional[float] = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def slug(self) -> str:
        """The type's last part (`quota-exceeded`)."""
        return self.type.rsplit(":", 1)[-1]


class SandqError(Exception):
    """Base class of every sandq exception. `problem` is the gateway's problem document when
    the error came from one (HTTP mode), else None."""
    problem: Optional[Problem] = None

    def __init__(self, *args: object, problem: Optional[Problem] = None):
        super().__init__(*args)
        if problem is not None:
            self.problem = problem


class SubmitError(SandqError):
    """The broker did not confirm the job, or returned it (over HTTP: the gateway answered
    `unavailable`, or could not be reached, after the client's retries): it may not be queued
    (retry with the same job id: a job id names one job, so a retry never makes a second)."""


class UnservedSku(SandqError):
    """No worker serves the job's SKU right now (its queue has no consumer) and the client
    refuses such jobs (`Client(unserved="refuse")`, direct mode): nothing was published and no
    status written (docs/protocol.md "Which SKUs are served"). `job_id`, `sku`, `queue` say
    which."""

    def __init__(self, job_id: str, sku: str, queue: str):
        self.job_id, self.sku, self.queue = job_id, sku, queue
        super().__init__(f"no worker serves sku {sku} right now (queue {queue} has no consumer): job {job_id} not submitted")


class UnservedSkuWarning(UserWarning):
    """Warned (`warnings.warn`) by a direct-mode submission whose SKU no worker serves right now
    (its queue has no consumer): the job is published and waits in the queue until a worker
    comes, or expires after `queues.unserved_ttl`. `Client(unserved="ignore")` does not ask,
    `unserved="refuse"` raises `UnservedSku` instead. The warning is given before the publish:
    a filter that makes it an error (`warnings.simplefilter("error", sandq.UnservedSkuWarning)`)
    stops the submission there, unpublished."""


class GatewayError(SandqError):
    """An error answer of sandq-gateway that no class below names (`problem` says what)."""


class Unauthorized(SandqError, PermissionError):
    """401: the API key is missing, malformed, unknown or revoked."""


class ForbiddenByQuota(SandqError, PermissionError):
    """403: the request asks for more than the key may ever do (a larger SKU, a longer timeout,
    outbound network, a webhook host it does not allow)."""


class QuotaExceeded(SandqError):
    """429: over a rate or count quota now (jobs per minute, jobs in flight, sessions, open
    event streams); `retry_after` seconds later it may pass."""

    @property
    def retry_after(self) -> Optional[float]:
        return self.problem.retry_after if self.problem else None


class InvalidRequest(SandqError, ValueError):
    """400, 405, 408, 413, 415: the gateway refused the request as it is (`problem.detail` says
    which field or value); sending it again will not help."""


class Conflict(SandqError):
    """409: the job id was used with another body, or by a job the gateway did not accept; a
    session in use by a job."""


class Unavailable(SandqError, ConnectionError):
    """503, or no answer: the gateway, or a service behind it, failed after the client's
    retries; nothing was kept; try again after `retry_after` seconds."""

    @property
    def retry_after(self) -> Optional[float]:
        return self.problem.retry_after if self.problem else None


class WaitTimeout(SandqError, TimeoutError):
    """The job had no terminal result within the time the caller waited (it may still finish)."""


class NotFound(SandqError, KeyError):
    """404: no such job, artifact or session for this key's tenant (another tenant's ids
    included)."""


class JobNotFound(NotFound):
    """No result under this job id: never submitted, or its result expired (over HTTP: or
    another tenant's)."""


class Ended(Protocol):
    """What a `JobError` reads of the result it carries (a `sandq.JobResult`: `types.py` imports
    this module for `raise_for_status`, so this one names the fields, not the class)."""
    @property
    def job_id(self) -> str: ...
    @property
    def status(self) -> str: ...
    @property
    def reason(self) -> Optional[str]: ...
    @property
    def exit_code(self) -> Optional[int]: ...
    @property
    def signal(self) -> Optional[str]: ...


class JobError(SandqError):
    """A job ended with `status` (not `succeeded`); `reason` is the protocol's reason, when any;
    `result` the `sandq.JobResult`."""
    status = ""

    def __init__(self, result: Ended):
        self.result: Any = result
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


def error_for(result: Ended) -> JobError:
    return _BY_STATUS.get(result.status, JobError)(result)
