//! `sandq export`: finished jobs as a Jupyter notebook (directly only: it reads the code this
//! client recorded in Redis).

use std::path::Path;

use anyhow::{bail, Context as _};
use sandq_client::Client;
use sandq_schemas::{JobResult, Runtime};

/// `sandq export`: reads each job's terminal result and recorded code, writes the notebook.
pub(crate) async fn export(client: &mut Client, ids: Vec<String>, session: Option<&str>, path: &Path) -> anyhow::Result<()> {
    let mut results = Vec::new();
    let ids = match session {
        Some(name) => {
            sandq_schemas::validate::check_session_name(name)?;
            client.session_jobs(name).await?
        }
        None => ids,
    };
    for id in &ids {
        sandq_schemas::validate::check_job_id(id).map_err(|e| anyhow::anyhow!("{e}"))?;
        if results.iter().any(|r: &JobResult| &r.job_id == id) {
            // A session's list names a job again when it was submitted again with its id.
            if session.is_some() {
                continue;
            }
            bail!("job {id} is listed twice");
        }
        match client.status(id).await? {
            Some(result) if result.status.is_terminal() => results.push(result),
            // A session's list may name jobs whose results expired or that never ran: skip them.
            Some(result) if session.is_some() => eprintln!("sandq: job {id} is {}; left out", result.status),
            None if session.is_some() => eprintln!("sandq: job {id} is unknown (expired?); left out"),
            Some(result) => bail!("job {id} is {}, not finished", result.status),
            None => bail!("job {id} is unknown (never submitted, or its result expired)"),
        }
    }
    if let Some(name) = session {
        // Cells in the order they ran, from the session's last fresh start.
        results.sort_by_key(|r| r.started_at_ms.unwrap_or(u64::MAX));
        if let Some(start) = results.iter().rposition(|r| r.session.as_ref().is_some_and(|s| s.fresh)) {
            results.drain(..start);
        }
        if results.is_empty() {
            bail!("no finished job of session {name} was submitted with this client (or their results expired)");
        }
    }
    let mut cells = Vec::new();
    let mut runtime = None;
    for result in &results {
        let source = client.job_source(&result.job_id).await?;
        if source.is_none() {
            eprintln!("sandq: the code of job {} was not recorded; its cell says so", result.job_id);
        }
        runtime = runtime.or(source.as_ref().map(|s| s.runtime));
        cells.push(sandq_client::notebook::cell(client, result, source.as_ref()).await?);
    }
    let notebook = sandq_client::notebook::notebook(cells, runtime.unwrap_or(Runtime::Python));
    let mut text = serde_json::to_string_pretty(&notebook)?;
    text.push('\n');
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
    eprintln!("sandq: wrote {} cells to {}", results.len(), path.display());
    Ok(())
}
