//! A parsed output's values stored: inline within the job's budget, or in S3.

use std::collections::BTreeMap;

use sandq_core::storage;
use sandq_schemas::names::output_key;
use sandq_schemas::{Artifact, MimeValue, Output};

use super::parse::{is_binary, Parsed};
use super::{Caps, OutputsError};

/// Most S3 objects (images, large values) stored per job.
pub(super) const MAX_STORED_PER_JOB: usize = 100;

/// File extension of an output representation in S3.
fn extension(mime: &str) -> &'static str {
    match mime {
        "image/png" => "png",
        "image/jpeg" => "jpg",
        "image/gif" => "gif",
        "image/webp" => "webp",
        "image/svg+xml" => "svg",
        "application/pdf" => "pdf",
        "text/html" => "html",
        "text/markdown" => "md",
        "text/latex" => "tex",
        m if m.ends_with("json") => "json",
        m if m.starts_with("text/") => "txt",
        _ => "bin",
    }
}

/// Objects this attempt already stored (S3 key -> SHA-256): the live displays' uploads
/// ([`crate::live::displays`]), which [`super::collect`] does not upload again.
pub(crate) type Uploaded = std::sync::Mutex<std::collections::HashMap<String, String>>;

/// Where outputs are stored: the bucket, and what this attempt stored already.
#[derive(Clone, Copy)]
pub(crate) struct Sink<'a> {
    /// The client outputs are uploaded with.
    pub s3: &'a aws_sdk_s3::Client,
    /// Where they go (`s3.bucket`), under the attempt's prefix.
    pub bucket: &'a str,
    /// Objects stored already (not uploaded again).
    pub uploaded: &'a Uploaded,
}

/// What storing outputs has used of the job's bounds so far.
#[derive(Debug)]
pub(super) struct Budget {
    /// Inline bytes left ([`super::INLINE_BUDGET`] for the result; per value only for a live event).
    pub(super) inline_left: u64,
    /// S3 objects stored ([`MAX_STORED_PER_JOB`]).
    pub(super) stored: usize,
    /// Representations left out.
    pub(super) dropped: u64,
}

/// Stores one parsed output: its text inline within `budget`, the rest (images always) in S3
/// as `output-<index>-<n>.<ext>` under the attempt's prefix, unless `uploaded` has the same
/// object already.
pub(super) async fn store(
    job_id: &str,
    attempt_id: &str,
    index: usize,
    p: Parsed,
    caps: Caps,
    budget: &mut Budget,
    sink: Sink<'_>,
) -> Result<Output, OutputsError> {
    let Sink { s3, bucket, uploaded } = sink;
    let mut output =
        Output { output_type: p.output_type, data: BTreeMap::new(), table: p.table, image: p.image, display: p.display, error: p.error };
    for (n, (mime, bytes)) in p.values.into_iter().enumerate() {
        let size = bytes.len() as u64;
        let inline = !is_binary(&mime) && size <= caps.max_inline_value && size <= budget.inline_left;
        let value = if inline {
            budget.inline_left -= size;
            MimeValue { text: Some(String::from_utf8_lossy(&bytes).into_owned()), artifact: None, size }
        } else if budget.stored >= MAX_STORED_PER_JOB {
            budget.dropped += 1;
            continue;
        } else {
            budget.stored += 1;
            let file = format!("output-{index}-{n}.{}", extension(&mime));
            let key = output_key(job_id, attempt_id, &file);
            let sha256 = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&bytes));
            let done = uploaded.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(&key) == Some(&sha256);
            if !done {
                storage::put_bytes(s3, bucket, &key, bytes, &mime)
                    .await
                    .map_err(|source| OutputsError::Upload { key: key.clone(), source })?;
                uploaded.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(key.clone(), sha256.clone());
            }
            let artifact =
                Artifact { path: file.clone(), key, size, sha256, content_type: mime.clone(), url: None, url_expires_at_ms: None };
            MimeValue { text: None, artifact: Some(artifact), size }
        };
        output.data.insert(mime, value);
    }
    output.data.entry("text/plain".into()).or_insert(MimeValue { text: Some(String::new()), artifact: None, size: 0 });
    Ok(output)
}
