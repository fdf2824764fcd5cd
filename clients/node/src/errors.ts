// Exceptions. A job that ended other than `succeeded` is a `JobError` subclass named after its
// status, carrying the result and the protocol's `reason`. `wait`/`run` throw `JobRejected`,
// `JobExpired` and `JobInternalError` by default (the program never ran, or sandq failed);
// `failed`, `timed_out`, `oom_killed` and `cancelled` come back as results, and
// `raiseForStatus(result)` throws them too.
import type { JobResult } from "./types.js";

export class SandqError extends Error {
  override name = "SandqError";
}

/** The broker did not confirm the job, or returned it: it is not queued (retry with the same job id). */
export class SubmitError extends SandqError {
  override name = "SubmitError";
}

/** The job had no terminal result within the time the caller waited (it may still finish). */
export class WaitTimeout extends SandqError {
  override name = "WaitTimeout";
}

/** No result under this job id: never submitted, or its result expired. */
export class JobNotFound extends SandqError {
  override name = "JobNotFound";
}

export class JobError extends SandqError {
  override name = "JobError";
  readonly result: JobResult;
  readonly jobId: string;
  readonly status: string;
  readonly reason: string | null;

  constructor(result: JobResult) {
    const detail = result.reason ?? (result.exit_code != null ? `exit code ${result.exit_code}` : result.signal) ?? "";
    super(`job ${result.job_id} ${result.status}${detail ? `: ${detail}` : ""}`);
    this.result = result;
    this.jobId = result.job_id;
    this.status = result.status;
    this.reason = result.reason ?? null;
  }
}

export class JobFailed extends JobError { override name = "JobFailed"; }
export class JobTimedOut extends JobError { override name = "JobTimedOut"; }
export class JobOOMKilled extends JobError { override name = "JobOOMKilled"; }
export class JobRejected extends JobError { override name = "JobRejected"; }
export class JobCancelled extends JobError { override name = "JobCancelled"; }
export class JobExpired extends JobError { override name = "JobExpired"; }
export class JobInternalError extends JobError { override name = "JobInternalError"; }

const byStatus: Record<string, new (r: JobResult) => JobError> = {
  failed: JobFailed,
  timed_out: JobTimedOut,
  oom_killed: JobOOMKilled,
  rejected: JobRejected,
  cancelled: JobCancelled,
  expired: JobExpired,
  internal_error: JobInternalError,
};

/** Statuses that `wait` throws unless told not to. */
export const RAISED_BY_WAIT: ReadonlySet<string> = new Set(["rejected", "expired", "internal_error"]);

export function errorFor(result: JobResult): JobError {
  return new (byStatus[result.status] ?? JobError)(result);
}

/** Throws the `JobError` subclass of a status other than `succeeded`; returns the result otherwise. */
export function raiseForStatus(result: JobResult): JobResult {
  if (result.status !== "succeeded") throw errorFor(result);
  return result;
}
