//! A fair share of each SKU's slots between tenants (issue 36, finding 10; the design is in
//! docs/threat-model.md "Finding 10" and docs/operations.md "Fair share between tenants").
//!
//! A SKU has one queue, first come, first served. To keep one tenant's backlog from holding
//! every slot, Redis keeps, per SKU, which jobs of each tenant are queued and which run:
//!
//! - the gateway records a job as queued ([`queued`]) just before it publishes it, and forgets
//!   it ([`not_queued`]) when the publish certainly failed;
//! - a worker that takes a first delivery reads every tenant's counts ([`shares`]) and asks
//!   [`turn`] whether the job's tenant may take the slot. When the tenant already runs more
//!   jobs than another tenant who has jobs waiting, the worker publishes the job again at the
//!   tail of the queue instead of running it (`sandq_worker::fair`), so the queue turns until
//!   the other tenant's job comes up. Otherwise the job moves from queued to running
//!   ([`start`]) until its attempt ends ([`end`]).
//!
//! Every entry carries an expiry (a sorted set's score, Unix ms): a queued entry lives as long
//! as the message may wait in the queue, a running one as long as an attempt may last. An
//! entry nobody removed (a gateway that died between recording and publishing, a worker killed
//! mid-job, a purged queue) therefore disappears by itself, and the counts heal: they are a
//! hint for ordering, never a condition for running a job. Whatever fails here (Redis down),
//! the job runs.
//!
//! Keys, all of one SKU in one Redis Cluster slot (hash tag `{<ns>:<sku>}`), so that
//! [`shares`] is one script:
//!
//! - `<ns>:fair:{<ns>:<sku>}:queued` and `...:running`: members `<tenant>_<id>` (a gateway's
//!   job id as it is; a job of no tenant is `-_<job_id>`), all of score 0, so that one tenant's
//!   count is a `ZLEXCOUNT` of its prefix and the tenants are found by jumping from prefix to
//!   prefix (tenant names are `[a-z0-9]`, so `_` ends one and never occurs in it);
//! - `...:queued:expiry` and `...:running:expiry`: the same members scored by expiry.

use std::time::Duration;

use redis::RedisResult;
use sandq_schemas::names::Names;
use sandq_schemas::Sku;

use crate::redis_conn::{RedisConn, Script};

/// The tenant of jobs that did not come through the gateway (published by an operator's client
/// directly): one tenant of its own. Not a tenant name (those are `[a-z0-9]`).
pub const NO_TENANT: &str = "-";

/// Most tenants [`shares`] reports per SKU (the script's work is bounded by it).
pub const MAX_TENANTS: usize = 1000;

/// How long a key of the fair share lives after its last write (a safety net: every member
/// expires by its own score long before).
const KEY_TTL: Duration = Duration::from_secs(8 * 24 * 3600);

/// The four keys of SKU `sku`: queued, queued expiry, running, running expiry.
fn keys(names: &Names, sku: Sku) -> [String; 4] {
    let base = format!("{ns}:fair:{{{ns}:{sku}}}", ns = names.namespace());
    [format!("{base}:queued"), format!("{base}:queued:expiry"), format!("{base}:running"), format!("{base}:running:expiry")]
}

/// Until when a message published at `now_ms` may wait in a queue whose unserved TTL is
/// `unserved_ttl` (Unix ms; a day when the queues have none): a queued entry's expiry.
pub fn queued_until(unserved_ttl: Duration, now_ms: u64) -> u64 {
    let wait = if unserved_ttl.is_zero() { Duration::from_secs(24 * 3600) } else { unserved_ttl };
    now_ms.saturating_add(u64::try_from(wait.as_millis()).unwrap_or(u64::MAX))
}

/// The tenant of a gateway job id (`<tenant>_<id>`): the part before the first `_`, if it is
/// a tenant name (1 to 24 of `[a-z0-9]`).
pub fn tenant_of(job_id: &str) -> Option<&str> {
    let (tenant, rest) = job_id.split_once('_')?;
    let ok = !tenant.is_empty()
        && !rest.is_empty()
        && tenant.len() <= crate::keys::MAX_TENANT_LEN
        && tenant.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    ok.then_some(tenant)
}

/// One tenant's jobs of a SKU as [`shares`] counted them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    /// The tenant (or [`NO_TENANT`]).
    pub tenant: String,
    /// Its jobs recorded as queued (not yet taken by a worker).
    pub queued: u64,
    /// Its jobs a worker has taken and not yet finished.
    pub running: u64,
}

/// What a worker does with a first delivery of `tenant`'s job: [`turn`]'s answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Turn {
    /// Run it.
    Run,
    /// Put it back at the tail of the queue: `waiting` has jobs queued and fewer running.
    Rotate {
        /// The tenant whose turn it is.
        waiting: String,
    },
}

/// The rule: a job of `tenant` runs unless some other tenant has jobs queued and fewer running
/// than `tenant` (then that tenant's job should take the slot: the job goes round again). Ties
/// run, so a tenant alone, or tenants running as many jobs each, keep first come, first served.
/// The tenant with the fewest running is named (the first such in `shares`' order).
pub fn turn(tenant: &str, shares: &[Share]) -> Turn {
    let own = shares.iter().find(|s| s.tenant == tenant).map_or(0, |s| s.running);
    shares
        .iter()
        .filter(|s| s.tenant != tenant && s.queued > 0 && s.running < own)
        .min_by_key(|s| s.running)
        .map_or(Turn::Run, |s| Turn::Rotate { waiting: s.tenant.clone() })
}

/// Records the gateway's job `job_id` of SKU `sku` as queued until `expires_at_ms` (Unix ms:
/// when the message can no longer be waiting in the queue). Recording it again moves its
/// expiry. A job id that is no tenant's ([`tenant_of`]) is not recorded.
///
/// # Errors
/// Redis's.
pub async fn queued(redis: &mut RedisConn, names: &Names, sku: Sku, job_id: &str, expires_at_ms: u64) -> RedisResult<()> {
    if tenant_of(job_id).is_none() {
        return Ok(());
    }
    let [queued, queued_expiry, ..] = keys(names, sku);
    let ttl = KEY_TTL.as_secs();
    redis::pipe()
        .atomic()
        .cmd("ZADD")
        .arg(&queued)
        .arg(0)
        .arg(job_id)
        .ignore()
        .cmd("ZADD")
        .arg(&queued_expiry)
        .arg(expires_at_ms)
        .arg(job_id)
        .ignore()
        .cmd("EXPIRE")
        .arg(&queued)
        .arg(ttl)
        .ignore()
        .cmd("EXPIRE")
        .arg(&queued_expiry)
        .arg(ttl)
        .ignore()
        .query_async(redis)
        .await
}

/// Forgets a job [`queued`] recorded: its publish certainly failed.
///
/// # Errors
/// Redis's.
pub async fn not_queued(redis: &mut RedisConn, names: &Names, sku: Sku, job_id: &str) -> RedisResult<()> {
    let [queued, queued_expiry, ..] = keys(names, sku);
    unqueue(redis::pipe().atomic(), &queued, &queued_expiry, job_id).query_async(redis).await
}

/// Adds to `pipe` the removal of `job_id` from a SKU's queued set and its expiries.
fn unqueue<'a>(pipe: &'a mut redis::Pipeline, queued: &str, queued_expiry: &str, job_id: &str) -> &'a mut redis::Pipeline {
    pipe.cmd("ZREM").arg(queued).arg(job_id).ignore().cmd("ZREM").arg(queued_expiry).arg(job_id).ignore()
}

/// Drops expired entries, then counts each tenant's queued and running jobs (by jumping from
/// one tenant's prefix to the next: `ARGV[3]` tenants at most per set), and whether `ARGV[2]`
/// (a job id) is recorded as queued. `KEYS`: queued, queued expiry, running, running expiry;
/// `ARGV[1]`: now (Unix ms). Answers `{registered, tenant, queued, running, ...}`.
const SHARES_SCRIPT: &str = r"
local function prune(set, expiry)
  local old = redis.call('ZRANGEBYSCORE', expiry, '-inf', ARGV[1], 'LIMIT', 0, 500)
  if #old > 0 then
    redis.call('ZREM', expiry, unpack(old))
    redis.call('ZREM', set, unpack(old))
  end
end
prune(KEYS[1], KEYS[2])
prune(KEYS[3], KEYS[4])
local counts = {}
local order = {}
local function walk(set, field)
  local from = '-'
  for _ = 1, tonumber(ARGV[3]) do
    local first = redis.call('ZRANGEBYLEX', set, from, '+', 'LIMIT', 0, 1)
    if #first == 0 then return end
    local cut = string.find(first[1], '_', 1, true)
    if not cut then
      from = '(' .. first[1]
    else
      local tenant = string.sub(first[1], 1, cut - 1)
      if not counts[tenant] then
        counts[tenant] = {0, 0}
        table.insert(order, tenant)
      end
      counts[tenant][field] = redis.call('ZLEXCOUNT', set, '[' .. tenant .. '_', '(' .. tenant .. '`')
      from = '[' .. tenant .. '`'
    end
  end
end
walk(KEYS[1], 1)
walk(KEYS[3], 2)
local answer = {0}
if redis.call('ZSCORE', KEYS[2], ARGV[2]) then answer[1] = 1 end
for _, tenant in ipairs(order) do
  table.insert(answer, tenant)
  table.insert(answer, counts[tenant][1])
  table.insert(answer, counts[tenant][2])
end
return answer
";

/// What [`shares`] read for one job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shares {
    /// The job's tenant: its id's prefix when the gateway recorded it as queued, else
    /// [`NO_TENANT`] (a job published directly, or one whose record is gone: a retry after a
    /// worker died, an entry expired).
    pub tenant: String,
    /// Every tenant with jobs queued or running on the SKU (at most [`MAX_TENANTS`] of each).
    pub all: Vec<Share>,
}

impl Shares {
    /// The member [`start`] records job `job_id` under: the job id for a tenant's job, else
    /// `-_<job_id>`.
    pub fn member(&self, job_id: &str) -> String {
        if self.tenant == NO_TENANT {
            format!("{NO_TENANT}_{job_id}")
        } else {
            job_id.to_owned()
        }
    }
}

/// Counts every tenant's queued and running jobs of SKU `sku` at `now_ms` (dropping expired
/// entries first) and finds `job_id`'s tenant.
///
/// # Errors
/// Redis's.
pub async fn shares(redis: &mut RedisConn, names: &Names, sku: Sku, job_id: &str, now_ms: u64) -> RedisResult<Shares> {
    let [queued, queued_expiry, running, running_expiry] = keys(names, sku);
    let answer: Vec<redis::Value> = Script::new(SHARES_SCRIPT)
        .key(&queued)
        .key(&queued_expiry)
        .key(&running)
        .key(&running_expiry)
        .arg(now_ms)
        .arg(job_id)
        .arg(MAX_TENANTS)
        .invoke_async(redis)
        .await?;
    let registered: i64 = answer.first().map(redis::from_redis_value_ref).transpose()?.unwrap_or(0);
    let mut all = Vec::new();
    for chunk in answer.get(1..).unwrap_or_default().chunks_exact(3) {
        all.push(Share {
            tenant: redis::from_redis_value_ref(&chunk[0])?,
            queued: redis::from_redis_value_ref(&chunk[1])?,
            running: redis::from_redis_value_ref(&chunk[2])?,
        });
    }
    let tenant = match tenant_of(job_id) {
        Some(tenant) if registered == 1 => tenant.to_owned(),
        _ => NO_TENANT.to_owned(),
    };
    Ok(Shares { tenant, all })
}

/// Moves job `job_id` from queued to running as `member` ([`Shares::member`]) until
/// `lease_until_ms` (Unix ms: the longest its attempt may last).
///
/// # Errors
/// Redis's.
pub async fn start(redis: &mut RedisConn, names: &Names, sku: Sku, job_id: &str, member: &str, lease_until_ms: u64) -> RedisResult<()> {
    let [queued, queued_expiry, running, running_expiry] = keys(names, sku);
    let ttl = KEY_TTL.as_secs();
    unqueue(redis::pipe().atomic(), &queued, &queued_expiry, job_id)
        .cmd("ZADD")
        .arg(&running)
        .arg(0)
        .arg(member)
        .ignore()
        .cmd("ZADD")
        .arg(&running_expiry)
        .arg(lease_until_ms)
        .arg(member)
        .ignore()
        .cmd("EXPIRE")
        .arg(&running)
        .arg(ttl)
        .ignore()
        .cmd("EXPIRE")
        .arg(&running_expiry)
        .arg(ttl)
        .ignore()
        .query_async(redis)
        .await
}

/// The job went round again (put back at the tail): its queued entry now expires at
/// `expires_at_ms` (the new message's wait), if it has one.
///
/// # Errors
/// Redis's.
pub async fn requeued_at_tail(redis: &mut RedisConn, names: &Names, sku: Sku, job_id: &str, expires_at_ms: u64) -> RedisResult<()> {
    let [_, queued_expiry, ..] = keys(names, sku);
    redis::cmd("ZADD").arg(&queued_expiry).arg("XX").arg(expires_at_ms).arg(job_id).query_async(redis).await
}

/// Records that job `job_id` went round `rounds` times (its newest copy, confirmed by the
/// broker, carries that count), for `ttl` (the job's longest life: a stale delivery of it may
/// come back until then). Written before the delivery the copy replaces is acked, so that
/// delivery, if the broker hands it out again, is known as superseded ([`rounds`]).
///
/// # Errors
/// Redis's.
pub async fn went_round(redis: &mut RedisConn, names: &Names, job_id: &str, rounds: u32, ttl: Duration) -> RedisResult<()> {
    redis::cmd("SET").arg(names.rounds_key(job_id)).arg(rounds).arg("EX").arg(ttl.as_secs().max(1)).query_async(redis).await
}

/// How many times job `job_id` went round, as [`went_round`] recorded it (`None`: never, or
/// the record is gone or is not a count a worker writes, at most `max`).
///
/// # Errors
/// Redis's (a key of another type included).
pub async fn rounds(redis: &mut RedisConn, names: &Names, job_id: &str, max: u32) -> RedisResult<Option<u32>> {
    let value: Option<String> = redis::cmd("GET").arg(names.rounds_key(job_id)).query_async(redis).await?;
    Ok(value.and_then(|v| v.parse::<u32>().ok()).filter(|n| *n <= max))
}

/// The attempt of the job recorded as `member` ended: it no longer runs. When its delivery was
/// handed back to the queue (`back_in_queue_until_ms`: until when it may wait there) and it is a
/// tenant's, it is queued again.
///
/// # Errors
/// Redis's.
pub async fn end(redis: &mut RedisConn, names: &Names, sku: Sku, member: &str, back_in_queue_until_ms: Option<u64>) -> RedisResult<()> {
    let [queued, queued_expiry, running, running_expiry] = keys(names, sku);
    let mut pipe = redis::pipe();
    pipe.atomic().cmd("ZREM").arg(&running).arg(member).ignore().cmd("ZREM").arg(&running_expiry).arg(member).ignore();
    if let (Some(until), Some(_)) = (back_in_queue_until_ms, tenant_of(member)) {
        pipe.cmd("ZADD").arg(&queued).arg(0).arg(member).ignore().cmd("ZADD").arg(&queued_expiry).arg(until).arg(member).ignore();
    }
    pipe.query_async(redis).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(tenant: &str, queued: u64, running: u64) -> Share {
        Share { tenant: tenant.into(), queued, running }
    }

    #[test]
    fn a_tenant_alone_runs_whatever_it_has_queued() {
        assert_eq!(turn("a", &[share("a", 48, 2)]), Turn::Run);
        assert_eq!(turn("a", &[]), Turn::Run);
    }

    #[test]
    fn a_waiting_tenant_with_fewer_running_takes_the_slot() {
        let shares = [share("a", 47, 1), share("b", 1, 0)];
        assert_eq!(turn("a", &shares), Turn::Rotate { waiting: "b".into() });
        // b's own job runs.
        assert_eq!(turn("b", &shares), Turn::Run);
    }

    #[test]
    fn ties_and_tenants_with_nothing_waiting_keep_the_queue_order() {
        assert_eq!(turn("a", &[share("a", 47, 1), share("b", 1, 1)]), Turn::Run, "as many running each");
        assert_eq!(turn("a", &[share("a", 47, 2), share("b", 0, 0)]), Turn::Run, "b waits for nothing");
        assert_eq!(turn("a", &[share("a", 47, 0), share("b", 3, 0)]), Turn::Run, "a runs nothing yet");
    }

    #[test]
    fn the_tenant_with_fewest_running_is_named() {
        let shares = [share("a", 5, 3), share("b", 2, 2), share("c", 1, 0), share("d", 0, 0)];
        assert_eq!(turn("a", &shares), Turn::Rotate { waiting: "c".into() });
        assert_eq!(turn("b", &shares), Turn::Rotate { waiting: "c".into() });
    }

    #[test]
    fn jobs_of_no_tenant_are_one_tenant() {
        let shares = [share(NO_TENANT, 0, 2), share("b", 1, 0)];
        assert_eq!(turn(NO_TENANT, &shares), Turn::Rotate { waiting: "b".into() });
        assert_eq!(turn("b", &shares), Turn::Run);
    }

    #[test]
    fn a_tenant_is_the_prefix_of_a_gateway_job_id() {
        assert_eq!(tenant_of("acme42_job-1"), Some("acme42"));
        assert_eq!(tenant_of("acme_a_b"), Some("acme"));
        for none in ["job-1", "_x", "acme_", "Acme_x", "ac-me_x", &format!("{}_x", "a".repeat(25)), "-_x"] {
            assert_eq!(tenant_of(none), None, "{none:?}");
        }
    }

    #[test]
    fn a_job_of_no_tenant_is_recorded_under_a_prefix_no_tenant_has() {
        let none = Shares { tenant: NO_TENANT.into(), all: vec![] };
        assert_eq!(none.member("acme_x"), "-_acme_x");
        assert_eq!(tenant_of(&none.member("acme_x")), None);
        let acme = Shares { tenant: "acme".into(), all: vec![] };
        assert_eq!(acme.member("acme_x"), "acme_x");
    }

    #[test]
    fn a_queued_entry_lives_as_long_as_its_message_may_wait() {
        assert_eq!(queued_until(Duration::from_secs(60), 1_000), 61_000);
        assert_eq!(queued_until(Duration::ZERO, 0), 24 * 3600 * 1000);
    }

    #[test]
    fn every_key_of_a_sku_is_in_one_cluster_slot() {
        let keys = keys(&Names::new("ns"), Sku::M);
        assert!(keys.iter().all(|k| k.starts_with("ns:fair:{ns:M}:")), "{keys:?}");
    }
}
