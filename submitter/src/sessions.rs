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

