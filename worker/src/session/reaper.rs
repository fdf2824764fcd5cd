//! The reaper: every worker deletes expired sessions (their files, state and packages in S3,
//! their index entry) and, taking turns through Redis, rebuilds the sessions index from the
//! manifests in S3.

use sandq_core::sessions;
use sandq_core::time::now_ms;

use crate::context::Context;

/// Deletes expired sessions every `sessions.reap_interval` until `shutdown` turns true.
pub(crate) async fn reaper(ctx: Context, mut shutdown: tokio::sync::watch::Receiver<bool>) {
    let settings = &ctx.settings;
    let reaper_id = format!("reaper-{}", settings.worker_id);
    // The index was found of another type and not rebuilt since: a rebuild is due a minute
    // after the last one, not an hour.
    let mut rebuild_pending = false;
    // When this worker last rebuilt: the turn key in Redis is a client's to delete, so each
    // worker also keeps its own pace (else a client deleting the key every 0.5 s would make
    // every worker rebuild every period).
    let mut last_rebuild: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            () = tokio::time::sleep(settings.sessions.reap_interval) => {}
            _ = shutdown.changed() => return,
        }
        let mut redis = ctx.redis.clone();
        let bucket = &settings.services.s3.bucket;
        let index_reset = match sessions::reap(&ctx.s3, bucket, &mut redis, &settings.names, now_ms(), &reaper_id).await {
            Ok(reaped) => {
                if !reaped.deleted.is_empty() {
                    tracing::info!(sessions = ?reaped.deleted, "deleted expired sessions");
                }
                if reaped.index_reset {
                    crate::metrics::session_index("reset");
                }
                reaped.index_reset
            }
            Err(e) => {
                tracing::warn!(error = %e, "session reaper failed; retrying next period");
                false
            }
        };
        // The index is a hint a client can write or that an update can miss: it is rebuilt from
        // the manifests in S3 every `sessions.rebuild_interval` (1 h) across the workers, and
        // within a minute of being found of another type (test:
        // a_sessions_index_a_client_overwrites_neither_reruns_jobs_nor_keeps_sessions_for_ever
        // in tests/untrusted_state.rs).
        rebuild_pending |= index_reset;
        let every = settings.sessions.rebuild_interval;
        let gap = if rebuild_pending { sessions::REBUILD_AFTER_RESET.min(every) } else { every };
        if last_rebuild.is_some_and(|at| at.elapsed() < gap) {
            continue;
        }
        match sessions::take_rebuild_turn(&mut redis, &settings.names, now_ms(), gap).await {
            Ok(true) => {
                last_rebuild = Some(tokio::time::Instant::now());
                match sessions::rebuild_index(&ctx.s3, bucket, &mut redis, &settings.names, now_ms()).await {
                    Ok(seen) => {
                        rebuild_pending = false;
                        crate::metrics::session_index("rebuilt");
                        tracing::info!(sessions = seen, "sessions index rebuilt from S3");
                    }
                    Err(e) => tracing::warn!(error = %e, "cannot rebuild the sessions index; trying again after the gap"),
                }
            }
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "cannot take a turn at rebuilding the sessions index"),
        }
    }
}
