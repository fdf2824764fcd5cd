//! `sandq status` and `sandq cancel`: one job, by its id.

use std::collections::BTreeMap;

use anyhow::bail;
use sandq_client::Backend;

use crate::render;

/// `sandq status`: the result of a finished job as `run` prints it, else `<id> <status>`;
/// 2 for a job that is unknown.
pub(crate) async fn status(backend: &mut Backend, id: &str, json: bool) -> anyhow::Result<i32> {
    if let Err(e) = sandq_schemas::validate::check_job_id(id) {
        bail!("{e}");
    }
    match backend.status(id).await? {
        None => {
            eprintln!("job {id} is unknown (never submitted, or its result expired)");
            Ok(2)
        }
        Some(result) if json => {
            println!("{}", serde_json::to_string_pretty(&result)?);
            Ok(0)
        }
        Some(result) if result.status.is_terminal() => {
            render::print_result(&result, &[], &BTreeMap::new(), None, &mut std::io::stdout().lock(), &mut std::io::stderr().lock())?;
            Ok(0)
        }
        Some(result) => {
            println!("{} {}", result.job_id, result.status);
            Ok(0)
        }
    }
}

/// `sandq cancel`: 2 when the job is unknown or over.
pub(crate) async fn cancel(backend: &mut Backend, id: &str) -> anyhow::Result<i32> {
    if backend.cancel(id).await? {
        eprintln!("cancellation of {id} requested");
        Ok(0)
    } else {
        eprintln!("job {id} is unknown or already finished");
        Ok(2)
    }
}
