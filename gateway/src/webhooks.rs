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
//!   address the host resolves to must be public (no loopback, private, link-local, CGNAT,
//!   unique-local, multicast or unspecified) unless the operator sets
//!   `gateway.webhook_allow_private`; the request goes to the address that was checked (no
//!   second lookup to rebind); redirects are not followed (a 3xx is a failed attempt).

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
    if !allowed.iter().any(|a| a == "*" || a.eq_ignore_ascii_case(&host)) {
        return Err(UrlError::Host(host));
    }
    Ok(Target { scheme, host, port })
}

/// Whether an address is one a webhook may reach without `webhook_allow_private`.
pub(crate) fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_multicast()
                || v4.is_broadcast()
                || v4.is_documentation()
                || a == 0
                || (a == 100 && (64..128).contains(&b))
                || (a == 198 && (18..20).contains(&b))
                || a >= 240)
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_public(IpAddr::V4(v4));
            }
            let first = v6.segments()[0];
            !(v6.is_loopback() || v6.is_unspecified() || v6.is_multicast() || (first & 0xfe00) == 0xfc00 || (first & 0xffc0) == 0xfe80)
        }
    }
}

/// Resolves the target's host to the address to call: the first, after every one was checked.
///
/// # Errors
/// [`UrlError::Private`].
pub(crate) async fn resolve(target: &Target, allow_private: bool) -> Result<SocketAddr, UrlError> {
    let refused = || UrlError::Private(target.host.clone());
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host((target.host.as_str(), target.port)).await.map_err(|_| refused())?.collect();
    if addrs.is_empty() || (!allow_private && addrs.iter().any(|a| !is_public(a.ip()))) {
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
    let key = match sandq_core::keys::get(redis, &gateway.names, key_id).await {
        Ok(key) => key,
        Err(e) => {
            tracing::warn!(error = %e, job_id, "the webhook's key is gone: not delivered");
            return Ok(Attempt::Done);
        }
    };
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
    fn only_public_addresses_are_public() {
        for private in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "198.18.0.2",
            "::1",
            "fc00::1",
            "fe80::1",
            "::ffff:127.0.0.1",
            "224.0.0.1",
            "255.255.255.255",
        ] {
            assert!(!is_public(private.parse().expect("ip")), "{private}");
        }
        for public in ["1.1.1.1", "8.8.8.8", "2606:4700::1111"] {
            assert!(is_public(public.parse().expect("ip")), "{public}");
        }
    }

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
    }

    #[test]
    fn the_signature_is_hmac_sha256_of_the_timestamp_and_body() {
        // Computed apart: python3 -c "import hmac, hashlib;
        // print(hmac.new(b'key', b'1.x', hashlib.sha256).hexdigest())"
        assert_eq!(signature("key", 1, b"x"), "t=1,v1=fc4913c41a7bf793267e2a384f3261c9436ec2cd097bd745e7b0d99113f510ec");
    }
}
