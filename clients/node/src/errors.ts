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

/** No worker serves the job's SKU right now (its queue has no consumer) and the client refuses
 * such jobs (`unserved: "refuse"`, direct mode): nothing was published and no status written
 * (docs/protocol.md "Which SKUs are served"). */
export class UnservedSku extends SandqError {
  override name = "UnservedSku";

  constructor(readonly jobId: string, readonly sku: string, readonly queue: string) {
    super(`no worker serves sku ${sku} right now (queue ${queue} has no consumer): job ${jobId} not submitted`);
  }
}

/** The job had no terminal result within the time the caller waited (it may still finish). */
export class WaitTimeout extends SandqError {
  override name = "WaitTimeout";
}

/** No result under this job id: never submitted, or its result expired; over HTTP also another
 * tenant's job (`problem` is then the gateway's `not-found` document). */
export class JobNotFound extends SandqError {
  override name = "JobNotFound";
  readonly problem: Problem | null;

  constructor(message: string, problem: Problem | null = null) {
    super(message);
    this.problem = problem;
  }
}

// --- the gateway's problem documents (HTTP mode) ------------------------------------------------

/** An RFC 9457 problem document as the gateway sends it (docs/gateway.md "Errors"). */
export interface Problem {
  /** `urn:sandq:problem:<slug>`, stable. */
  type: string;
  title: string;
  status: number;
  detail: string;
  /** Seconds to wait before trying again (429, 503, some 409s). */
  retry_after?: number;
  [extra: string]: unknown;
}

/** The gateway refused a request: `status` and the problem document's stable `type`. A response
 * that is not a problem document (a proxy's error page) is a `GatewayError` with `type`
 * `about:blank`. Subclasses name each documented type. */
export class GatewayError extends SandqError {
  override name = "GatewayError";
  readonly status: number;
  readonly type: string;
  readonly detail: string;
  /** Seconds to wait before retrying (`Retry-After`), when the gateway said. */
  readonly retryAfter: number | null;
  readonly problem: Problem;

  constructor(problem: Problem, context = "") {
    super(`${context ? `${context}: ` : ""}${problem.status} ${problem.type}: ${problem.detail || problem.title}`);
    this.problem = problem;
    this.status = problem.status;
    this.type = problem.type;
    this.detail = problem.detail;
    this.retryAfter = typeof problem.retry_after === "number" ? problem.retry_after : null;
  }
}

/** 401: no key, or a malformed, unknown or revoked one. */
export class Unauthorized extends GatewayError { override name = "Unauthorized"; }
/** 400: not the documented JSON, or a value validation refused (`detail` says which). */
export class InvalidRequest extends GatewayError { override name = "InvalidRequest"; }
/** 415. */
export class UnsupportedMediaType extends GatewayError { override name = "UnsupportedMediaType"; }
/** 413: over the gateway's `max_body_bytes` or the key's `max_upload_bytes`. */
export class BodyTooLarge extends GatewayError { override name = "BodyTooLarge"; }
/** 408: the body did not arrive within the gateway's `read_timeout`. */
export class BodyTimeout extends GatewayError { override name = "BodyTimeout"; }
/** 403: more than the key may ever do (SKU, timeout, network, webhook host). */
export class ForbiddenByQuota extends GatewayError { override name = "ForbiddenByQuota"; }
/** 429: over a rate or count quota now; `retryAfter` says when to try again. */
export class QuotaExceeded extends GatewayError { override name = "QuotaExceeded"; }
/** 404: no such thing for this key's tenant (an artifact, a session, a route). */
export class NotFound extends GatewayError { override name = "NotFound"; }
/** 409: a job id used with another body, a request with it under way, a session in use. */
export class Conflict extends GatewayError { override name = "Conflict"; }
/** 405. */
export class MethodNotAllowed extends GatewayError { override name = "MethodNotAllowed"; }
/** 503: the broker or Redis behind the gateway failed; nothing was kept (retried by the SDK
 * before it is thrown). */
export class Unavailable extends GatewayError { override name = "Unavailable"; }

const byProblem: Record<string, new (p: Problem, context?: string) => GatewayError> = {
  "urn:sandq:problem:unauthorized": Unauthorized,
  "urn:sandq:problem:invalid-request": InvalidRequest,
  "urn:sandq:problem:unsupported-media-type": UnsupportedMediaType,
  "urn:sandq:problem:body-too-large": BodyTooLarge,
  "urn:sandq:problem:body-timeout": BodyTimeout,
  "urn:sandq:problem:forbidden-by-quota": ForbiddenByQuota,
  "urn:sandq:problem:quota-exceeded": QuotaExceeded,
  "urn:sandq:problem:not-found": NotFound,
  "urn:sandq:problem:conflict": Conflict,
  "urn:sandq:problem:method-not-allowed": MethodNotAllowed,
  "urn:sandq:problem:unavailable": Unavailable,
};

/** The `GatewayError` subclass of a problem's `type` (`GatewayError` for a type this SDK does not
 * know). */
export function errorForProblem(problem: Problem, context = ""): GatewayError {
  return new (byProblem[problem.type] ?? GatewayError)(problem, context);
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
