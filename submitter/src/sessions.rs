//! `sandq session ls` and `sandq session rm`: directly, the deployment's session index; over
//! HTTP, the tenant's sessions.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::Context as _;
use sandq_client::http::SessionInfo;
use sandq_client::Backend;
use sandq_core::sessions::Listed;
use sandq_core::time::now_ms;

/// `sandq session ls`: a table, or JSON.
pub(crate) async fn list(backend: &mut Backend, json: bool) -> anyhow::Result<i32> {
    match backend {
        Backend::Direct { client, .. } => {
            let sessions = client.sessions(1000).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&sessions)?);
            } else {
                print!("{}", listed_table(&sessions, now_ms()));
            }
        }
        Backend::Http(http) => {
            // `GET /v1/sessions`.
            let sessions = http.sessions().await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&sessions)?);
            } else {
                print!("{}", tenant_table(&sessions, now_ms()));
            }
        }
    }
    Ok(0)
}

/// `sandq session rm`: waits up to `wait` for a running job of the session, then deletes it.
pub(crate) async fn remove(backend: &mut Backend, name: &str, wait: Duration) -> anyhow::Result<i32> {
    match backend {
        Backend::Direct { client, .. } => {
            let deleted = client.remove_session(name, wait).await?;
            eprintln!("session {name}: {deleted} objects deleted");
        }
        Backend::Http(http) => {
            http.remove_session(name, wait).await.with_context(|| format!("cannot delete session {name}"))?;
            eprintln!("session {name}: deleted");
        }
    }
    Ok(0)
}

/// The deployment's sessions as a table (writing to a `String` cannot fail); `now` in Unix epoch ms.
fn listed_table(sessions: &[Listed], now: u64) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{:<40} {:>6} {:>12} {:>12}  IN USE BY", "SESSION", "FILES", "BYTES", "EXPIRES IN");
    for s in sessions {
        let left = Duration::from_secs(s.expires_at_ms.saturating_sub(now) / 1000);
        let _ = writeln!(
            out,
            "{:<40} {:>6} {:>12} {:>12}  {}",
            s.name,
            s.files.map_or("-".into(), |f| f.to_string()),
            s.bytes.map_or("-".into(), |b| b.to_string()),
            humantime::format_duration(left).to_string(),
            s.in_use_by.as_deref().unwrap_or_default()
        );
    }
    out
}

/// A tenant's sessions, as the gateway lists them, as a table; `now` in Unix epoch ms.
fn tenant_table(sessions: &[SessionInfo], now: u64) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{:<40} {:>6} {:>12} {:>12}  CELLS", "SESSION", "FILES", "BYTES", "EXPIRES IN");
    for s in sessions {
        let left = s
            .expires_at_ms
            .map_or("-".into(), |at| humantime::format_duration(Duration::from_secs(at.saturating_sub(now) / 1000)).to_string());
        let _ = writeln!(out, "{:<40} {:>6} {:>12} {:>12}  {}", s.name, s.files, s.bytes, left, s.execution_count);
    }
    out
}

#[cfg(test)]
mod tests {
    //! Expected tables written out by hand (columns of 40, 6, 12 and 12 characters).

    use sandq_client::http::SessionInfo;
    use sandq_core::sessions::Listed;

    use super::{listed_table, tenant_table};

    const NOW: u64 = 1_800_000_000_000;

    #[test]
    fn the_deployments_sessions_as_a_table() {
        let sessions = [
            Listed { name: "s1".into(), expires_at_ms: NOW + 90_500, files: Some(2), bytes: Some(59_689), in_use_by: Some("job-1".into()) },
            Listed { name: "old".into(), expires_at_ms: NOW - 5, files: None, bytes: None, in_use_by: None },
        ];
        assert_eq!(
            listed_table(&sessions, NOW),
            "SESSION                                   FILES        BYTES   EXPIRES IN  IN USE BY\n\
             s1                                            2        59689       1m 30s  job-1\n\
             old                                           -            -           0s  \n"
        );
    }

    #[test]
    fn a_tenants_sessions_as_a_table() {
        let sessions = [
            SessionInfo { name: "t1".into(), files: 3, bytes: 1024, expires_at_ms: Some(NOW + 29 * 60_000 + 999), execution_count: 7 },
            SessionInfo { name: "new".into(), files: 0, bytes: 0, expires_at_ms: None, execution_count: 0 },
        ];
        assert_eq!(
            tenant_table(&sessions, NOW),
            "SESSION                                   FILES        BYTES   EXPIRES IN  CELLS\n\
             t1                                            3         1024          29m  7\n\
             new                                           0            0            -  0\n"
        );
    }
}
