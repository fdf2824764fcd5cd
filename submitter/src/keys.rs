//! `sandq key create`, `sandq key ls`, `sandq key revoke`: the gateway's API keys, in the key
//! store in Redis (no broker or S3 needed; never through a gateway).

use std::fmt::Write as _;

use anyhow::Context as _;
use sandq_core::config::ServiceConfig;
use sandq_core::keys::{self, KeyRecord};
use sandq_schemas::names::Names;

use crate::args::KeyCommand;

/// Runs one `sandq key` command against the key store of `service`.
pub(crate) async fn run(service: &ServiceConfig, command: KeyCommand, json: bool) -> anyhow::Result<i32> {
    let mut redis = sandq_core::redis_conn::connect(&service.redis).await.context("cannot connect to redis")?;
    let names = Names::new(service.namespace.clone());
    match command {
        KeyCommand::Create(new) => {
            let quotas = keys::Quotas {
                max_in_flight: new.max_in_flight,
                jobs_per_minute: new.jobs_per_minute,
                max_sku: new.max_sku,
                max_timeout: new.max_timeout.into(),
                network: new.network,
                max_upload_bytes: new.max_upload_bytes,
                max_sessions: new.max_sessions,
                webhook_hosts: new.webhook_hosts.iter().map(|h| h.to_ascii_lowercase()).collect(),
            };
            let (record, key) = keys::create(&mut redis, &names, &new.tenant, &new.name, quotas).await?;
            if json {
                println!("{}", serde_json::json!({"key": key, "record": record}));
            } else {
                eprintln!("key {} for tenant {}: shown once, store it now", record.id, record.tenant);
                eprintln!("webhook signing secret: {}", record.webhook_secret);
                println!("{key}");
            }
        }
        KeyCommand::Ls => {
            let mut records = keys::list(&mut redis, &names).await?;
            for r in &mut records {
                r.webhook_secret.clear();
            }
            if json {
                println!("{}", serde_json::to_string_pretty(&records)?);
            } else {
                print!("{}", key_table(&records));
            }
        }
        KeyCommand::Revoke { id } => {
            let record = keys::revoke(&mut redis, &names, &id).await?;
            eprintln!("key {} of tenant {} is revoked", record.id, record.tenant);
        }
    }
    Ok(0)
}

/// The keys as a table: id, tenant, name (its first 20 characters), quotas, state; never the
/// key or the webhook secret. Writing to a `String` cannot fail.
fn key_table(records: &[KeyRecord]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<12} {:<23} {:<20} {:>9} {:>7} {:>3} {:>9} {:>7}  STATE",
        "ID", "TENANT", "NAME", "IN FLIGHT", "PER MIN", "SKU", "TIMEOUT", "NETWORK"
    );
    for r in records {
        let q = &r.quotas;
        let _ = writeln!(
            out,
            "{:<12} {:<23} {:<20} {:>9} {:>7} {:>3} {:>9} {:>7}  {}",
            r.id,
            r.tenant,
            r.name.chars().take(20).collect::<String>(),
            q.max_in_flight,
            q.jobs_per_minute,
            format!("{:?}", q.max_sku),
            humantime::format_duration(q.max_timeout).to_string(),
            q.network,
            if r.revoked_at_ms.is_some() { "revoked" } else { "valid" }
        );
    }
    out
}

#[cfg(test)]
mod tests {
    //! The expected table is written out by hand (columns of 12, 23, 20, 9, 7, 3, 9 and 7).

    use std::time::Duration;

    use sandq_core::keys::{KeyRecord, Quotas};
    use sandq_schemas::Sku;

    use super::key_table;

    fn record(id: &str, tenant: &str, name: &str, quotas: Quotas, revoked_at_ms: Option<u64>) -> KeyRecord {
        KeyRecord {
            id: id.into(),
            tenant: tenant.into(),
            name: name.into(),
            sha256: "0".repeat(64),
            created_at_ms: 1,
            revoked_at_ms,
            quotas,
            webhook_secret: String::new(),
        }
    }

    #[test]
    fn keys_as_a_table_with_long_names_cut() {
        let quotas = |max_in_flight, jobs_per_minute, max_sku, max_timeout, network| Quotas {
            max_in_flight,
            jobs_per_minute,
            max_sku,
            max_timeout,
            network,
            max_upload_bytes: 100 << 20,
            max_sessions: 100,
            webhook_hosts: Vec::new(),
        };
        let records = [
            record("abcdefghijkl", "acme", "a name longer than twenty", quotas(10, 60, Sku::M, Duration::from_secs(300), false), None),
            record("mnopqrstuvwx", "beta", "", quotas(1, 2, Sku::XL, Duration::from_secs(5400), true), Some(2)),
        ];
        assert_eq!(
            key_table(&records),
            "ID           TENANT                  NAME                 IN FLIGHT PER MIN SKU   TIMEOUT NETWORK  STATE\n\
             abcdefghijkl acme                    a name longer than t        10      60   M        5m   false  valid\n\
             mnopqrstuvwx beta                                                 1       2  XL    1h 30m    true  revoked\n"
        );
    }
}
