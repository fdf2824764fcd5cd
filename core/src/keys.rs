//! Tenants' API keys for the HTTP gateway (`sandq-gateway`): created, listed and revoked by an
//! operator (`sandq key ...`), checked by the gateway on every request.
//!
//! A key is `sq_<id>_<secret>`: `<id>` is 12 of `[a-z0-9]` (public: it names the key in lists
//! and audit lines), `<secret>` 32 random bytes in unpadded base64url. Only the SHA-256 of the
//! whole key is stored: a 256-bit random secret needs no slow hash (no dictionary to try), and
//! a leaked Redis dump gives no usable key. The key is shown once, when created.
//!
//! Redis layout (namespace `<ns>`): `<ns>:apikey:{<id>}` a string holding the [`KeyRecord`] as
//! JSON (no TTL), and `<ns>:apikeys` the set of ids. Revoking keeps the record (with
//! `revoked_at_ms`), so a revoked key is told apart from an unknown one in the audit log.

use std::time::Duration;

use base64::Engine as _;
use rand::Rng as _;
use redis::AsyncCommands as _;
use sandq_schemas::names::Names;
use sandq_schemas::Sku;
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq as _;

use crate::redis_conn::RedisConn;

/// Longest tenant name: a tenant prefixes its jobs' and sessions' ids (`<tenant>_<id>`), which
/// are at most 64 characters, so a tenant leaves at least 40 to the client's id.
pub const MAX_TENANT_LEN: usize = 23;

/// What one key may do (`sandq key create --max-...`). Limits on a single request (SKU,
/// timeout, network) are refused with 403; limits on a rate or a count with 429 and
/// `Retry-After` (docs/gateway.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quotas {
    /// Jobs submitted with this key and not yet finished (queued or running); default 10.
    #[serde(default = "default_in_flight")]
    pub max_in_flight: u32,
    /// Jobs submitted with this key in one calendar minute (UTC); default 60.
    #[serde(default = "default_per_minute")]
    pub jobs_per_minute: u32,
    /// Largest SKU; default M.
    #[serde(default = "default_sku")]
    pub max_sku: Sku,
    /// Longest job timeout; default 5 min (humantime in JSON).
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub max_timeout: Duration,
    /// Whether jobs may ask for outbound network; default false.
    #[serde(default)]
    pub network: bool,
    /// Largest file uploaded in one request (`POST /v1/files`), bytes; default 100 MiB.
    #[serde(default = "default_upload")]
    pub max_upload_bytes: u64,
    /// Sessions the key's tenant may have at once (counted per tenant); default 100.
    #[serde(default = "default_sessions")]
    pub max_sessions: u32,
    /// Host names a job's `callback_url` may name (exact, lower case; `*`: any); default none.
    #[serde(default)]
    pub webhook_hosts: Vec<String>,
}

fn default_in_flight() -> u32 {
    10
}
fn default_per_minute() -> u32 {
    60
}
fn default_sku() -> Sku {
    Sku::M
}
fn default_sessions() -> u32 {
    100
}
fn default_upload() -> u64 {
    100 << 20
}
fn default_timeout() -> Duration {
    Duration::from_secs(300)
}

impl Default for Quotas {
    fn default() -> Self {
        Quotas {
            max_in_flight: default_in_flight(),
            jobs_per_minute: default_per_minute(),
            max_sku: default_sku(),
            max_timeout: default_timeout(),
            network: false,
            max_upload_bytes: default_upload(),
            max_sessions: default_sessions(),
            webhook_hosts: Vec::new(),
        }
    }
}

/// A key as stored (never its secret; its webhook signing secret, which signing needs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRecord {
    /// The key's public id (12 of `[a-z0-9]`).
    pub id: String,
    /// The tenant it acts for: 1 to [`MAX_TENANT_LEN`] of `[a-z0-9]`.
    pub tenant: String,
    /// A label for people (`ci`, `alice's laptop`), at most 200 bytes.
    pub name: String,
    /// SHA-256 of the whole key, 64 lower-case hex digits.
    pub sha256: String,
    /// When it was created, Unix epoch ms.
    pub created_at_ms: u64,
    /// When it was revoked, Unix epoch ms; `None` while it is valid.
    #[serde(default)]
    pub revoked_at_ms: Option<u64>,
    /// What it may do.
    pub quotas: Quotas,
    /// The secret that signs this key's webhooks (`whsec_` and 32 random bytes in base64url):
    /// stored as is (signing needs it), shown when the key is created. Empty in records
    /// written before webhooks: such a key's jobs cannot name a `callback_url`.
    #[serde(default)]
    pub webhook_secret: String,
}

/// Failure of a key operation.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The tenant name is not 1 to [`MAX_TENANT_LEN`] of `[a-z0-9]`.
    #[error("tenant {0:?} is not 1 to {MAX_TENANT_LEN} characters of [a-z0-9]")]
    Tenant(String),
    /// The label is longer than 200 bytes.
    #[error("a key's name is at most 200 bytes")]
    Name,
    /// No key has this id.
    #[error("no key {0:?}")]
    Unknown(String),
    /// Redis failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// A stored record is not valid JSON (written by something else).
    #[error("key record {id:?} is unreadable: {source}")]
    Corrupt {
        /// The key's id.
        id: String,
        /// Why.
        source: serde_json::Error,
    },
}

/// Why a presented key was not accepted. The gateway answers all of them with the same 401
/// (a caller learns nothing about other keys); the audit line names which.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AuthError {
    /// Not of the shape `sq_<id>_<secret>`.
    #[error("malformed key")]
    Malformed,
    /// No key has its id, or its secret does not match.
    #[error("unknown key")]
    Unknown,
    /// The key was revoked.
    #[error("revoked key")]
    Revoked,
}

/// Redis key of one key's record.
fn record_key(names: &Names, id: &str) -> String {
    format!("{}:apikey:{{{id}}}", names.namespace())
}

/// Redis set of every key id.
fn index_key(names: &Names) -> String {
    format!("{}:apikeys", names.namespace())
}

/// Checks a tenant name: 1 to [`MAX_TENANT_LEN`] of `[a-z0-9]` (no `_`, which separates it
/// from the client's ids).
///
/// # Errors
/// [`KeyError::Tenant`].
pub fn check_tenant(tenant: &str) -> Result<(), KeyError> {
    let ok = !tenant.is_empty() && tenant.len() <= MAX_TENANT_LEN && tenant.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if ok {
        Ok(())
    } else {
        Err(KeyError::Tenant(tenant.to_owned()))
    }
}

/// SHA-256 of a presented key, lower-case hex.
fn digest(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// Splits `sq_<id>_<secret>` into the id, checking the shape.
fn key_id(presented: &str) -> Result<&str, AuthError> {
    let rest = presented.strip_prefix("sq_").ok_or(AuthError::Malformed)?;
    let (id, secret) = rest.split_once('_').ok_or(AuthError::Malformed)?;
    let id_ok = id.len() == 12 && id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    let secret_ok = secret.len() == 43 && secret.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if id_ok && secret_ok {
        Ok(id)
    } else {
        Err(AuthError::Malformed)
    }
}

/// Creates a key for `tenant` and returns its record and the key itself (the only time it is
/// shown).
///
/// # Errors
/// [`KeyError::Tenant`], [`KeyError::Name`], [`KeyError::Redis`].
pub async fn create(
    redis: &mut RedisConn,
    names: &Names,
    tenant: &str,
    name: &str,
    quotas: Quotas,
) -> Result<(KeyRecord, String), KeyError> {
    check_tenant(tenant)?;
    if name.len() > 200 {
        return Err(KeyError::Name);
    }
    let (id, secret, webhook_secret) = {
        let mut rng = rand::rng();
        const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
        let id: String = (0..12).map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char).collect();
        let bytes: [u8; 32] = rng.random();
        let signing: [u8; 32] = rng.random();
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        (id, b64.encode(bytes), format!("whsec_{}", b64.encode(signing)))
    };
    let key = format!("sq_{id}_{secret}");
    let record = KeyRecord {
        id: id.clone(),
        tenant: tenant.to_owned(),
        name: name.to_owned(),
        sha256: digest(&key),
        created_at_ms: crate::time::now_ms(),
        revoked_at_ms: None,
        quotas,
        webhook_secret,
    };
    let json = serde_json::to_string(&record).map_err(|source| KeyError::Corrupt { id: id.clone(), source })?;
    // Two commands, not a transaction: the record and the index are in different cluster slots.
    // A crash between them leaves a record no list shows, which still authenticates.
    let () = redis.set(record_key(names, &id), json).await?;
    let () = redis.sadd(index_key(names), &id).await?;
    Ok((record, key))
}

/// Reads one key's record.
///
/// # Errors
/// [`KeyError::Unknown`], [`KeyError::Redis`], [`KeyError::Corrupt`].
pub async fn get(redis: &mut RedisConn, names: &Names, id: &str) -> Result<KeyRecord, KeyError> {
    let json: Option<String> = redis.get(record_key(names, id)).await?;
    let json = json.ok_or_else(|| KeyError::Unknown(id.to_owned()))?;
    serde_json::from_str(&json).map_err(|source| KeyError::Corrupt { id: id.to_owned(), source })
}

/// Every key's record, sorted by tenant then creation time.
///
/// # Errors
/// [`KeyError::Redis`], [`KeyError::Corrupt`].
pub async fn list(redis: &mut RedisConn, names: &Names) -> Result<Vec<KeyRecord>, KeyError> {
    let ids: Vec<String> = redis.smembers(index_key(names)).await?;
    let mut records = Vec::with_capacity(ids.len());
    for id in ids {
        match get(redis, names, &id).await {
            Ok(record) => records.push(record),
            Err(KeyError::Unknown(_)) => {}
            Err(e) => return Err(e),
        }
    }
    records.sort_by(|a, b| (&a.tenant, a.created_at_ms, &a.id).cmp(&(&b.tenant, b.created_at_ms, &b.id)));
    Ok(records)
}

/// Revokes a key: from now on every request with it is refused. Returns the record as
/// revoked; revoking a revoked key keeps its first revocation time.
///
/// # Errors
/// [`KeyError::Unknown`], [`KeyError::Redis`], [`KeyError::Corrupt`].
pub async fn revoke(redis: &mut RedisConn, names: &Names, id: &str) -> Result<KeyRecord, KeyError> {
    let mut record = get(redis, names, id).await?;
    if record.revoked_at_ms.is_none() {
        record.revoked_at_ms = Some(crate::time::now_ms());
        let json = serde_json::to_string(&record).map_err(|source| KeyError::Corrupt { id: id.to_owned(), source })?;
        let () = redis.set(record_key(names, id), json).await?;
    }
    Ok(record)
}

/// Checks a presented key: its shape, its record, its hash (compared in constant time) and
/// that it is not revoked. `Ok(Err(..))` is a refusal; `Err` a failure to check.
///
/// # Errors
/// [`KeyError::Redis`], [`KeyError::Corrupt`].
pub async fn authenticate(redis: &mut RedisConn, names: &Names, presented: &str) -> Result<Result<KeyRecord, AuthError>, KeyError> {
    let id = match key_id(presented) {
        Ok(id) => id,
        Err(e) => return Ok(Err(e)),
    };
    let record = match get(redis, names, id).await {
        Ok(record) => record,
        Err(KeyError::Unknown(_)) => return Ok(Err(AuthError::Unknown)),
        Err(e) => return Err(e),
    };
    if !bool::from(digest(presented).as_bytes().ct_eq(record.sha256.as_bytes())) {
        return Ok(Err(AuthError::Unknown));
    }
    if record.revoked_at_ms.is_some() {
        return Ok(Err(AuthError::Revoked));
    }
    Ok(Ok(record))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_of_the_documented_shape_names_its_id() {
        let key = format!("sq_abcdefghij12_{}", "A".repeat(43));
        assert_eq!(key_id(&key), Ok("abcdefghij12"));
    }

    #[test]
    fn keys_of_another_shape_are_malformed() {
        let good_secret = "A".repeat(43);
        for key in [
            String::new(),
            "sq_".into(),
            format!("sk_abcdefghij12_{good_secret}"),
            format!("sq_ABCDEFGHIJ12_{good_secret}"),
            format!("sq_abcdefghij1_{good_secret}"),
            format!("sq_abcdefghij12_{}", "A".repeat(42)),
            format!("sq_abcdefghij12_{}=", "A".repeat(42)),
            format!("sq_abcdefghij12{good_secret}"),
        ] {
            assert_eq!(key_id(&key), Err(AuthError::Malformed), "{key:?}");
        }
    }

    #[test]
    fn tenants_are_short_lower_case_alphanumerics() {
        assert!(check_tenant("acme42").is_ok());
        assert!(check_tenant(&"a".repeat(MAX_TENANT_LEN)).is_ok());
        for bad in ["", "Acme", "a_b", "a-b", "a b", "ä", &"a".repeat(MAX_TENANT_LEN + 1)] {
            assert!(check_tenant(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn quotas_decode_with_defaults_and_refuse_unknown_fields() {
        let q: Quotas = serde_json::from_str(r#"{"max_sku": "L", "max_timeout": "2m"}"#).expect("decodes");
        assert_eq!((q.max_sku, q.max_timeout, q.max_in_flight, q.network), (Sku::L, Duration::from_secs(120), 10, false));
        assert!(serde_json::from_str::<Quotas>(r#"{"max_skus": "L"}"#).is_err());
    }
}
