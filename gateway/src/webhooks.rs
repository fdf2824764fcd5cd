//! Webhooks: a job submitted with a `callback_url` has its terminal result POSTed there,
//! signed, retried with exponential backoff on errors and 5xx, durably.
//!
//! - **Durable**: a delivery is a member of the Redis sorted set `<ns>:webhooks` (the queue's
//!   job id, scored by when it is next due) with its state in `<ns>:webhook:{<job id>}` (a
//!   hash: url, key id, delivery id, attempts, created). Every gateway replica runs a
//!   [`dispatch`] loop; a due delivery is taken by one of them with [`TAKE_SCRIPT`] (its score
//!   moved a lease ahead), so a replica that dies mid-attempt leaves it to another after the
//!   lease. A gateway or worker restart loses nothing.
//! - **Signed**: `Sandq-Signature: t=<unix s>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`
//!   with the key's webhook secret (the scheme Stripe documents); `Sandq-Delivery: <uuid>`
//!   names the delivery, the same on every attempt (the receiver's idempotency id).
//! - **Safe destinations**: `http`/`https` only, host among the key's `webhook_hosts`; every
//!   address the host resolves to must be public ([`sandq_core::addr::is_public`]: globally
//!   reachable in the IANA special-purpose registries, not multicast, and any IPv4 address an
//!   IPv6 form carries public too: NAT64, 6to4, Teredo, mapped, compatible) unless the operator
//!   sets `gateway.webhook_allow_private`; the request goes to the address that was checked (no
//!   second lookup to rebind); redirects are not followed (a 3xx is a failed attempt).
//! - **Ended by revocation**: every attempt reads the key again; a revoked (or deleted) key's
//!   deliveries are dropped, with an audit line, and never sent again.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use hmac::{Hmac, Mac as _};
use redis::AsyncCommands as _;
use sandq_core::redis_conn::RedisConn;
use sandq_schemas::JobStatus;
use sha2::Sha256;

use crate::problem::Problem;
use crate::state::Gateway;

/// The sorted set of deliveries.
fn queue_key(gateway: &Gateway) -> String {
    format!("{}:webhooks", gateway.names.namespace())
}

/// One delivery's state.
fn state_key(gateway: &Gateway, job_id: &str) -> String {
    format!("{}:webhook:{{{job_id}}}", gateway.names.namespace())
}

/// Takes a due delivery: `KEYS[1]` the set, `ARGV[1]` now (ms), `ARGV[2]` the lease end (ms).
/// Returns the job id, or false when none is due.
const TAKE_SCRIPT: &str = r"
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, 1)
if #due == 0 then return false end
redis.call('ZADD', KEYS[1], 'XX', ARGV[2], due[1])
return due[1]
";

/// Why a callback URL is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum UrlError {
    /// Not an absolute `http` or `https` URL with a host (and no user name or password).
    #[error("callback_url must be an http or https URL with a host and no credentials")]
    Shape,
    /// The host is not among the key's `webhook_hosts`.
    #[error("callback_url's host {0:?} is not one this key may call")]
    Host(String),
    /// The host resolves to no address, or to one that is not public.
    #[error("callback_url's host {0:?} resolves to no public address")]
    Private(String),
}

/// A callback URL's parts that matter here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Target {
    /// `http` or `https`.
    pub(crate) scheme: String,
    /// Lower-case host name or IP literal (without brackets).
    pub(crate) host: String,
    /// The port (default 80 or 443).
    pub(crate) port: u16,
}

/// Parses a callback URL and checks its host against `allowed` (`*`: any).
///
/// # Errors
/// [`UrlError::Shape`], [`UrlError::Host`].
pub(crate) fn check_url(url: &str, allowed: &[String]) -> Result<Target, UrlError> {
    let parsed = url.parse::<axum::http::Uri>().map_err(|_| UrlError::Shape)?;
    let scheme = parsed.scheme_str().map(str::to_ascii_lowercase).ok_or(UrlError::Shape)?;
    if scheme != "http" && scheme != "https" || url.len() > 2048 {
        return Err(UrlError::Shape);
    }
    let authority = parsed.authority().ok_or(UrlError::Shape)?;
    if authority.as_str().contains('@') {
        return Err(UrlError::Shape);
    }
    let host = authority.host().trim_start_matches('[').trim_end_matches(']').to_ascii_lowercase();
    if host.is_empty() {
        return Err(UrlError::Shape);
    }
    let port = authority.port_u16().unwrap_or(if scheme == "https" { 443 } else { 80 });
    if !allowed.iter().any(|a| host_matches(a, &host)) {
        return Err(UrlError::Host(host));
    }
    Ok(Target { scheme, host, port })
}

/// Whether the `webhook_hosts` entry `allowed` names `host` (lower-case, without brackets):
/// `*` names any; an IP literal (with or without brackets) names the same address however it
/// is written (`64:ff9b::7f00:1` and `[64:ff9b:0:0::7f00:1]`); a name, itself in any case.
fn host_matches(allowed: &str, host: &str) -> bool {
    let literal = |s: &str| s.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>().ok();
    match (literal(allowed), literal(host)) {
        (Some(a), Some(h)) => a == h,
        _ => allowed == "*" || allowed.eq_ignore_ascii_case(host),
    }
}

/// Resolves the target's host to the address to call: the first, after every one was checked.
///
/// # Errors
/// [`UrlError::Private`].
pub(crate) async fn resolve(target: &Target, allow_private: bool) -> Result<SocketAddr, UrlError> {
    let refused = || UrlError::Private(target.host.clone());
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host((target.host.as_str(), target.port)).await.map_err(|_| refused())?.collect();
    if addrs.is_empty() || (!allow_private && addrs.iter().any(|a| !sandq_core::addr::is_public(a.ip()))) {
        return Err(refused());
    }
    Ok(addrs[0])
}

/// The signature header of `body` at `unix_s`: `t=<unix_s>,v1=<hex>`.
pub(crate) fn signature(secret: &str, unix_s: u64, body: &[u8]) -> String {
    let mut mac = <Hmac<Sha256>>::new_from_slice(secret.as_bytes()).expect("HMAC takes a key of any length");
    mac.update(unix_s.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("t={unix_s},v1={}", hex::encode(mac.finalize().into_bytes()))
}

/// Records a delivery for the job `job_id`, due at once (the dispatcher waits for the result).
///
/// # Errors
/// 503 when Redis fails.
pub(crate) async fn schedule(gateway: &Gateway, job_id: &str, key_id: &str, url: &str) -> Result<(), Problem> {
    let mut redis = gateway.redis.clone();
    let now = sandq_core::time::now_ms();
    let state = state_key(gateway, job_id);
    let delivery = uuid::Uuid::new_v4().to_string();
    let ttl = gateway.settings.webhook_retry_for + Duration::from_secs(8 * 24 * 3600);
    let unavailable = |e: redis::RedisError| Problem::unavailable(format!("redis: {e}"));
    let () = redis::pipe()
        .hset_multiple(&state, &[("url", url), ("key_id", key_id), ("delivery", &delivery), ("created_ms", &now.to_string())])
        .ignore()
        .expire(&state, ttl.as_secs() as i64)
        .ignore()
        .query_async(&mut redis)
        .await
        .map_err(unavailable)?;
    let () = redis.zadd(queue_key(gateway), job_id, now).await.map_err(unavailable)?;
    Ok(())
}

/// Forgets a delivery whose job was certainly not queued.
pub(crate) async fn unschedule(gateway: &Gateway, job_id: &str) {
    let mut redis = gateway.redis.clone();
    let _: redis::RedisResult<()> = redis.zrem(queue_key(gateway), job_id).await;
    let _: redis::RedisResult<()> = redis.del(state_key(gateway, job_id)).await;
}

/// How often an idle dispatcher looks for due deliveries, and re-checks a job not yet over.
const IDLE: Duration = Duration::from_millis(500);
const NOT_OVER_YET: Duration = Duration::from_secs(1);

/// Delivers due webhooks until the process ends. Runs in every replica.
pub async fn dispatch(gateway: Arc<Gateway>) {
    let client =
        match reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).timeout(gateway.settings.webhook_timeout).build() {
            Ok(client) => client,
            Err(e) => {
                tracing::error!(error = %e, "cannot make the webhook client: webhooks are not delivered by this gateway");
                return;
            }
        };
    let mut redis = gateway.redis.clone();
    loop {
        let now = sandq_core::time::now_ms();
        let lease = now + 2 * gateway.settings.webhook_timeout.as_millis() as u64 + 5_000;
        let taken: redis::RedisResult<Option<String>> =
            sandq_core::redis_conn::Script::new(TAKE_SCRIPT).key(queue_key(&gateway)).arg(now).arg(lease).invoke_async(&mut redis).await;
        match taken {
            Ok(Some(job_id)) => {
                let gateway = gateway.clone();
                let client = client.clone();
                // One task a delivery: a slow receiver holds only its own.
                tokio::spawn(async move { attempt(&gateway, &client, &job_id).await });
            }
            Ok(None) => tokio::time::sleep(IDLE).await,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the webhook queue");
                tokio::time::sleep(IDLE).await;
            }
        }
    }
}

/// What became of one delivery attempt.
enum Attempt {
    /// The receiver took it (2xx), or it can never be delivered: forget it.
    Done,
    /// Try again after this long.
    Later(Duration),
}

async fn attempt(gateway: &Gateway, client: &reqwest::Client, job_id: &str) {
    let mut redis = gateway.redis.clone();
    let outcome = match try_deliver(gateway, client, &mut redis, job_id).await {
        Ok(outcome) => outcome,
        Err(e) => {
            tracing::warn!(error = %e, job_id, "webhook delivery failed on redis; retrying");
            Attempt::Later(Duration::from_secs(5))
        }
    };
    let queue = queue_key(gateway);
    match outcome {
        Attempt::Done => {
            let _: redis::RedisResult<()> = redis.zrem(&queue, job_id).await;
            let _: redis::RedisResult<()> = redis.del(state_key(gateway, job_id)).await;
        }
        Attempt::Later(after) => {
            let due = sandq_core::time::now_ms() + after.as_millis() as u64;
            let _: redis::RedisResult<()> = redis::cmd("ZADD").arg(&queue).arg("XX").arg(due).arg(job_id).query_async(&mut redis).await;
        }
    }
}

async fn try_deliver(gateway: &Gateway, client: &reqwest::Client, redis: &mut RedisConn, job_id: &str) -> redis::RedisResult<Attempt> {
    let state: std::collections::HashMap<String, String> = redis.hgetall(state_key(gateway, job_id)).await?;
    let (Some(url), Some(key_id), Some(delivery)) = (state.get("url"), state.get("key_id"), state.get("delivery")) else {
        return Ok(Attempt::Done);
    };
    let attempts: u32 = state.get("attempts").and_then(|a| a.parse().ok()).unwrap_or(0);
    // The key is read again at every attempt: a delivery of a key that was deleted or revoked
    // since (issue 36: revocation ends its webhooks) is dropped, never sent.
    // A key the store cannot read now (Redis trouble) is tried again later, as `is_revoked`
    // counts it valid: only a key known to be gone or revoked drops the delivery.
    let key = match sandq_core::keys::get(redis, &gateway.names, key_id).await {
        Ok(key) => key,
        Err(e @ (sandq_core::keys::KeyError::Unknown(_) | sandq_core::keys::KeyError::Corrupt { .. })) => {
            tracing::warn!(error = %e, job_id, "the webhook's key is gone: not delivered");
            return Ok(Attempt::Done);
        }
        Err(e) => {
            tracing::warn!(error = %e, job_id, "cannot read the webhook's key; trying again later");
            return Ok(Attempt::Later(NOT_OVER_YET));
        }
    };
    if let Some(revoked_at_ms) = key.revoked_at_ms {
        tracing::info!(target: "audit", job_id, key_id = %key.id, tenant = %key.tenant, revoked_at_ms, attempts, "webhook dropped: its key was revoked");
        return Ok(Attempt::Done);
    }
    let Ok(Some(result)) = sandq_core::results::read(redis, &gateway.names, job_id).await else {
        // Not queued yet, or its result expired: wait, at most as long as a job can live.
        let created: u64 = state.get("created_ms").and_then(|c| c.parse().ok()).unwrap_or(0);
        let life = gateway.service.queues.unserved_ttl + Duration::from_secs(3600);
        return Ok(if sandq_core::time::now_ms().saturating_sub(created) > life.as_millis() as u64 {
            Attempt::Done
        } else {
            Attempt::Later(NOT_OVER_YET)
        });
    };
    if !result.status.is_terminal() {
        return Ok(Attempt::Later(NOT_OVER_YET));
    }
    let finished = result.finished_at_ms.unwrap_or_else(sandq_core::time::now_ms);
    let give_up = sandq_core::time::now_ms().saturating_sub(finished) > gateway.settings.webhook_retry_for.as_millis() as u64;
    let body = serde_json::to_vec(&serde_json::json!({
        "type": "job.finished",
        "delivery_id": delivery,
        "job": crate::scope::view_for_tenant(&key.tenant, &result),
    }))
    .unwrap_or_default();
    let sent = send(gateway, client, url, &key, delivery, &body).await;
    let () = redis.hincr(state_key(gateway, job_id), "attempts", 1).await?;
    match sent {
        Ok(()) => {
            tracing::info!(target: "audit", job_id, key_id = %key.id, tenant = %key.tenant, attempts = attempts + 1, status = %result.status, "webhook delivered");
            Ok(Attempt::Done)
        }
        Err(why) if give_up || result.status == JobStatus::Queued => {
            tracing::warn!(job_id, key_id = %key.id, attempts = attempts + 1, error = %why, "webhook not delivered: gave up");
            Ok(Attempt::Done)
        }
        Err(why) => {
            let backoff = gateway.settings.webhook_backoff.saturating_mul(1 << attempts.min(16)).min(Duration::from_secs(600));
            tracing::info!(job_id, attempts = attempts + 1, error = %why, retry_in_ms = backoff.as_millis() as u64, "webhook attempt failed");
            Ok(Attempt::Later(backoff))
        }
    }
}

/// One POST of `body`; `Err` says why it did not count as delivered.
async fn send(
    gateway: &Gateway,
    client: &reqwest::Client,
    url: &str,
    key: &sandq_core::keys::KeyRecord,
    delivery: &str,
    body: &[u8],
) -> Result<(), String> {
    let target = check_url(url, &key.quotas.webhook_hosts).map_err(|e| e.to_string())?;
    let addr = resolve(&target, gateway.settings.webhook_allow_private).await.map_err(|e| e.to_string())?;
    // The connection goes to the address checked above, whatever a second lookup would say.
    let pinned = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(gateway.settings.webhook_timeout)
        .resolve(&target.host, addr)
        .build()
        .unwrap_or_else(|_| client.clone());
    let unix_s = sandq_core::time::now_ms() / 1000;
    let response = pinned
        .post(url)
        .header("content-type", "application/json")
        .header("sandq-signature", signature(&key.webhook_secret, unix_s, body))
        .header("sandq-delivery", delivery)
        .header("user-agent", "sandq-gateway")
        .body(body.to_vec())
        .send()
        .await
        .map_err(|e| format!("request: {e}"))?;
    if response.status().is_success() {
        Ok(())
    } else {
        Err(format!("status {}", response.status()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_need_a_scheme_a_host_no_credentials_and_an_allowed_host() {
        let allowed = vec!["hooks.example.com".to_owned()];
        assert_eq!(check_url("https://hooks.example.com/x", &allowed).map(|t| t.port), Ok(443));
        assert_eq!(check_url("http://HOOKS.example.com:8080/x", &allowed).map(|t| t.port), Ok(8080));
        assert_eq!(check_url("https://evil.example.com/", &allowed), Err(UrlError::Host("evil.example.com".into())));
        for bad in ["ftp://hooks.example.com/", "/relative", "https://user:pw@hooks.example.com/", "hooks.example.com", ""] {
            assert!(check_url(bad, &allowed).is_err(), "{bad}");
        }
        assert!(check_url("http://anything.test/", &["*".to_owned()]).is_ok());
        // An IP literal is named by the same address however either side writes it.
        let literal = vec!["64:ff9b:0:0::7f00:1".to_owned()];
        assert_eq!(check_url("http://[64:FF9B::7F00:1]:9/", &literal).map(|t| t.host), Ok("64:ff9b::7f00:1".into()));
        assert!(check_url("http://[64:ff9b::7f00:2]/", &literal).is_err());
    }

    #[test]
    fn the_signature_is_hmac_sha256_of_the_timestamp_and_body() {
        // Computed apart: python3 -c "import hmac, hashlib;
        // print(hmac.new(b'key', b'1.x', hashlib.sha256).hexdigest())"
        assert_eq!(signature("key", 1, b"x"), "t=1,v1=fc4913c41a7bf793267e2a384f3261c9436ec2cd097bd745e7b0d99113f510ec");
    }
}
