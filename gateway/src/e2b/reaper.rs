//! The reaper: the sessions of sandboxes past their end deleted, by whichever replica takes
//! each first.

use std::sync::Arc;
use std::time::Duration;

use redis::AsyncCommands as _;
use sandq_core::sessions::Removed;

use super::record::due_key;
use super::state::now_ms;
use crate::state::Gateway;

/// Deletes the sessions of sandboxes past their end, every 10 s until `shutdown`: one replica
/// takes each (`ZREM` answers 1 to one only).
pub async fn reap(gateway: Arc<Gateway>, mut shutdown: tokio::sync::watch::Receiver<bool>) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(10)) => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
        let mut redis = gateway.redis.clone();
        let due: Vec<String> = redis.zrangebyscore_limit(due_key(&gateway), 0, now_ms(), 0, 100).await.unwrap_or_default();
        for member in due {
            let taken: i64 = redis.zrem(due_key(&gateway), &member).await.unwrap_or(0);
            let Some((tenant, id)) = member.split_once('/') else { continue };
            if taken != 1 {
                continue;
            }
            let scoped = format!("{tenant}_{id}");
            let holder = format!("gateway-e2b-{}", uuid::Uuid::new_v4());
            let bucket = &gateway.service.s3.bucket;
            let removed =
                sandq_core::sessions::remove(&gateway.s3, bucket, &mut redis, &gateway.names, &scoped, &holder, Duration::from_secs(30))
                    .await;
            if let Ok(Removed { deleted: Err(e), .. }) = removed {
                tracing::warn!(sandbox = %id, error = %e, "cannot delete an expired E2B sandbox's session");
            }
            let _: redis::RedisResult<()> = redis.zrem(crate::sessions::tenant_sessions_key(&gateway, tenant), id).await;
        }
    }
}
