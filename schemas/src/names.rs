//! Names every party must agree on: AMQP exchange, queues and routing keys, Redis keys, S3 keys.
//!
//! All names derive from a namespace (default [`DEFAULT_NAMESPACE`], `"sandq"`), so that several
//! deployments or test runs can share one broker and one Redis without seeing each other.

use crate::Sku;

/// Version of the Redis key layout this code reads and writes: 2 since keys carry a Redis
/// Cluster hash tag (`sandq:job:{<id>}`); 1 was `sandq:job:<id>`. Not negotiated on the wire:
/// a deployment cuts over from 1 to 2 as docs/protocol.md "Redis key layout" says.
pub const REDIS_KEY_LAYOUT: u32 = 2;

/// Namespace of a default deployment.
pub const DEFAULT_NAMESPACE: &str = "sandq";

/// The names of one deployment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    namespace: String,
}

impl Default for Names {
    fn default() -> Self {
        Names::new(DEFAULT_NAMESPACE)
    }
}

impl Names {
    /// Names under `namespace` (`[A-Za-z0-9_-]`, checked by the worker's config).
    pub fn new(namespace: impl Into<String>) -> Self {
        Names { namespace: namespace.into() }
    }

    /// The prefix every name here starts with (`sandq` by default).
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Durable direct exchange jobs are published to: `<ns>.jobs`.
    pub fn jobs_exchange(&self) -> String {
        format!("{}.jobs", self.namespace)
    }

    /// Routing key of a SKU on the jobs exchange: the SKU's wire name (`"M"`).
    pub fn routing_key(&self, sku: Sku) -> String {
        sku.as_str().to_owned()
    }

    /// Durable quorum queue of a SKU: `<ns>.jobs.<SKU>` (`sandq.jobs.M`).
    pub fn jobs_queue(&self, sku: Sku) -> String {
        format!("{}.jobs.{}", self.namespace, sku.as_str())
    }

    /// Dead-letter exchange (fanout): `<ns>.dlx`.
    pub fn dead_letter_exchange(&self) -> String {
        format!("{}.dlx", self.namespace)
    }

    /// Durable queue holding dead-lettered messages: `<ns>.dead`.
    pub fn dead_letter_queue(&self) -> String {
        format!("{}.dead", self.namespace)
    }

    /// Redis hash of a job: `<ns>:job:{<job_id>}`, fields `status` (the [`crate::JobStatus`] wire
    /// name) and `result` (a MessagePack [`crate::JobResult`]). Expires `result_ttl` after the
    /// last write.
    ///
    /// The braces are a Redis Cluster hash tag: only `<job_id>` is hashed, so every key of one
    /// job (this one, [`Self::done_key`], [`Self::cancel_key`], [`Self::job_source_key`]) is in
    /// one hash slot and the compare-and-set script, which names two of them, runs on a cluster
    /// (key layout [`REDIS_KEY_LAYOUT`] 2; docs/protocol.md "Redis key layout"). The namespace
    /// has no braces (`[A-Za-z0-9_-]`), so the first `{` is ours; a job id is never empty.
    pub fn job_key(&self, job_id: &str) -> String {
        format!("{}:job:{{{}}}", self.namespace, job_id)
    }

    /// Redis list `<ns>:job:{<job_id>}:done`: the worker pushes the terminal status onto it (same
    /// TTL as the job key), so a client can wait with `BLPOP` instead of polling.
    pub fn done_key(&self, job_id: &str) -> String {
        format!("{}:done", self.job_key(job_id))
    }

    /// Redis Stream `<ns>:job:{<job_id>}:events`: the job's live events (what it prints and
    /// displays while it runs, its lifecycle, and `end` with the terminal result), written
    /// best effort by workers, expiring with the job key (docs/protocol.md "Live events").
    pub fn events_key(&self, job_id: &str) -> String {
        format!("{}:events", self.job_key(job_id))
    }

    /// Redis string `<ns>:job:{<job_id>}:cancel`: set by a client to cancel the job.
    pub fn cancel_key(&self, job_id: &str) -> String {
        format!("{}:cancel", self.job_key(job_id))
    }

    /// Redis string `<ns>:job:{<job_id>}:rounds`: how many times the job went round its queue
    /// for another tenant's turn (the worker's fair share), written by a worker once the
    /// round's copy is confirmed and before the delivery it replaced is acked. Only workers
    /// write it.
    pub fn rounds_key(&self, job_id: &str) -> String {
        format!("{}:rounds", self.job_key(job_id))
    }

    /// Redis string `<ns>:job:{<job_id>}:source`: the submitted code and runtime as JSON
    /// (`{"runtime": "python", "code": "..."}`), written by the Rust client after the broker
    /// confirmed a job with `code`, with the job's `result_ttl`; read by `sandq export`. The
    /// result does not carry the code, and other clients need not write it.
    pub fn job_source_key(&self, job_id: &str) -> String {
        format!("{}:source", self.job_key(job_id))
    }

    /// Redis list `<ns>:session:{<name>}:jobs`: ids of the session's jobs in the order the Rust
    /// client submitted them (expires with the last one's `result_ttl`); read by `sandq export
    /// --session`. The session manifest keeps only the last job's id.
    pub fn session_jobs_key(&self, session: &str) -> String {
        format!("{}:jobs", self.session_key_prefix(session))
    }

    /// Redis sorted set `<ns>:sessions`: session name -> expiry (Unix epoch ms) as the score.
    /// Workers reap members whose score has passed.
    pub fn sessions_index(&self) -> String {
        format!("{}:sessions", self.namespace)
    }

    /// Redis sorted set `<ns>:deferred`: the dead-letter consumer's deferred checks of running
    /// jobs, member `<attempt>:<job_id>`, score the time (Unix epoch ms) the check is due.
    /// Any worker's sweeper takes the due ones (the worker's `dead_letter` module).
    pub fn deferred_checks(&self) -> String {
        format!("{}:deferred", self.namespace)
    }

    /// Redis string `<ns>:sessions:rebuilt`: when (Unix epoch ms) a worker last started
    /// rebuilding [`Self::sessions_index`] from the manifests in S3; workers take turns by it
    /// (at most one rebuild an hour, or a minute after the index was found of another type).
    pub fn sessions_rebuilt_key(&self) -> String {
        format!("{}:sessions:rebuilt", self.namespace)
    }

    /// S3 prefix under which each session has its own prefix: `sessions/<ns>/`.
    pub fn sessions_prefix(&self) -> String {
        format!("sessions/{}/", self.namespace)
    }

    /// Redis string `<ns>:session:{<name>}:lock`: the attempt id of the job using the session
    /// (`SET NX PX`, a 30 s lease renewed every 10 s); one job of a session runs at a time.
    pub fn session_lock_key(&self, session: &str) -> String {
        format!("{}:lock", self.session_key_prefix(session))
    }

    /// Redis string `<ns>:session:{<name>}:expired`: set (for 7 days) when an expired session
    /// is deleted, so that the next job naming it is told the session expired.
    pub fn session_tombstone_key(&self, session: &str) -> String {
        format!("{}:expired", self.session_key_prefix(session))
    }

    /// `<ns>:session:{<name>}`: the start of every Redis key of a session, hash-tagged like
    /// [`Self::job_key`] so that a session's keys share a Redis Cluster slot.
    fn session_key_prefix(&self, session: &str) -> String {
        format!("{}:session:{{{}}}", self.namespace, session)
    }

    /// S3 prefix of a session's objects: `sessions/<ns>/<name>/`.
    pub fn session_prefix(&self, session: &str) -> String {
        format!("{}{}/", self.sessions_prefix(), session)
    }

    /// S3 key of a session's manifest (JSON: path -> sha256, size): `sessions/<ns>/<name>/manifest.json`.
    pub fn session_manifest_key(&self, session: &str) -> String {
        format!("{}manifest.json", self.session_prefix(session))
    }

    /// Content-addressed S3 key of a session file: `sessions/<ns>/<name>/blobs/<sha256>`.
    pub fn session_blob_key(&self, session: &str, sha256_hex: &str) -> String {
        format!("{}blobs/{sha256_hex}", self.session_prefix(session))
    }
}

/// Content-addressed S3 key of an uploaded input: `inputs/sha256/<hex>` (the layout of
/// clients that write to S3 themselves).
pub fn input_key(sha256_hex: &str) -> String {
    format!("inputs/sha256/{sha256_hex}")
}

/// S3 key of an input a tenant uploaded through the gateway: `inputs/tenant/<tenant>/sha256/<hex>`.
/// Addressed per tenant so that an upload never finds another tenant's bytes already stored
/// (and answers no faster for them): uploads reveal nothing across tenants (issue 36, finding 8).
pub fn tenant_input_key(tenant: &str, sha256_hex: &str) -> String {
    format!("inputs/tenant/{tenant}/sha256/{sha256_hex}")
}

/// Whether `key` is an input key of the bytes `sha256_hex`: [`input_key`], or
/// [`tenant_input_key`] of a tenant of 1 to 23 of `[a-z0-9]` (`sandq_core::keys`' rule).
pub fn is_input_key(key: &str, sha256_hex: &str) -> bool {
    if key == input_key(sha256_hex) {
        return true;
    }
    let Some(rest) = key.strip_prefix("inputs/tenant/") else { return false };
    let Some((tenant, digest)) = rest.split_once("/sha256/") else { return false };
    let tenant_ok = !tenant.is_empty() && tenant.len() <= 23 && tenant.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    tenant_ok && digest == sha256_hex
}

/// S3 prefix of everything one attempt of a job writes: `jobs/<job_id>/<attempt_id>/`. Every
/// processing of a delivery has its own attempt id (the worker's `a<16 hex digits>`), so that
/// a duplicate delivery of a job (at-least-once delivery, or a client reusing an id) never
/// overwrites the objects a stored result points at (test:
/// a_duplicate_delivery_never_changes_a_finished_job).
pub fn attempt_prefix(job_id: &str, attempt_id: &str) -> String {
    format!("jobs/{job_id}/{attempt_id}/")
}

/// S3 key of a job's artifact: `jobs/<job_id>/<attempt_id>/artifacts/<path>` (path relative
/// to `/work`).
pub fn artifact_key(job_id: &str, attempt_id: &str, path: &str) -> String {
    format!("{}artifacts/{path}", attempt_prefix(job_id, attempt_id))
}

/// S3 key of a job's rich-output representation: `jobs/<job_id>/<attempt_id>/outputs/<file>`
/// (`<file>` = `output-<output index>-<n>.<ext>`, e.g. `output-0-1.png`).
pub fn output_key(job_id: &str, attempt_id: &str, file: &str) -> String {
    format!("{}outputs/{file}", attempt_prefix(job_id, attempt_id))
}

/// S3 key of a job's captured stream: `jobs/<job_id>/<attempt_id>/stdout` or `.../stderr`.
pub fn log_key(job_id: &str, attempt_id: &str, stream: &str) -> String {
    format!("{}{stream}", attempt_prefix(job_id, attempt_id))
}

#[cfg(test)]
mod tests {
    use super::Names;

    #[test]
    fn input_keys_are_the_shared_layout_or_a_tenants_own() {
        let d = "a".repeat(64);
        assert!(super::is_input_key(&super::input_key(&d), &d));
        assert!(super::is_input_key(&super::tenant_input_key("acme1", &d), &d));
        assert_eq!(super::tenant_input_key("acme1", &d), format!("inputs/tenant/acme1/sha256/{d}"));
        let other = "b".repeat(64);
        for bad in [
            super::input_key(&other),
            super::tenant_input_key("acme1", &other),
            format!("inputs/tenant//sha256/{d}"),
            format!("inputs/tenant/Acme/sha256/{d}"),
            format!("inputs/tenant/a/b/sha256/{d}"),
            format!("inputs/tenant/{}/sha256/{d}", "a".repeat(24)),
            format!("inputs/tenant/../sha256/{d}"),
            format!("sessions/x/sha256/{d}"),
            format!("inputs/tenant/a/sha256/{d}/x"),
        ] {
            assert!(!super::is_input_key(&bad, &d), "{bad}");
        }
    }

    /// The hash tag Redis Cluster hashes (its spec, "Hash tags"): the text between the first
    /// `{` and the first `}` after it, when not empty; else the whole key.
    fn hash_tag(key: &str) -> &str {
        if let Some(open) = key.find('{') {
            if let Some(len) = key[open + 1..].find('}') {
                if len > 0 {
                    return &key[open + 1..open + 1 + len];
                }
            }
        }
        key
    }

    #[test]
    fn keys_of_a_job_or_a_session_share_a_hash_tag() {
        let names = Names::new("ns-1");
        for id in ["j1", "a}b", "x{y", "01J0000000000000000000000000"] {
            let keys = [names.job_key(id), names.done_key(id), names.cancel_key(id), names.job_source_key(id), names.rounds_key(id)];
            let tags: Vec<&str> = keys.iter().map(|k| hash_tag(k)).collect();
            assert!(tags.iter().all(|t| *t == tags[0]), "{keys:?} -> {tags:?}");
            assert_ne!(tags[0], keys[0], "{id}: no hash tag in {}", keys[0]);
        }
        assert_eq!(names.job_key("j1"), "ns-1:job:{j1}");
        assert_eq!(names.done_key("j1"), "ns-1:job:{j1}:done");
        assert_eq!(names.rounds_key("j1"), "ns-1:job:{j1}:rounds");
        let session = [names.session_jobs_key("s"), names.session_lock_key("s"), names.session_tombstone_key("s")];
        assert_eq!(session, ["ns-1:session:{s}:jobs", "ns-1:session:{s}:lock", "ns-1:session:{s}:expired"]);
        assert!(session.iter().all(|k| hash_tag(k) == "s"));
    }
}
