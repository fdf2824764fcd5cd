//! S3 access shared by clients and the worker: the client, content-addressed uploads, and
//! bounded, digest-checked downloads.

use std::path::Path;

use aws_sdk_s3::config::{Credentials, Region, RequestChecksumCalculation, ResponseChecksumValidation};
use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::Client;
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

use crate::config::S3Config;

/// Builds an S3 client for an S3-compatible server: path-style addressing, static keys, and
/// checksums only when required (the SDK's default aws-chunked CRC trailers are refused by many
/// S3-compatible servers).
pub fn client(config: &S3Config) -> Client {
    let credentials = Credentials::new(&config.access_key_id, &config.secret_access_key, None, None, "sandq-config");
    let conf = aws_sdk_s3::Config::builder()
        .behavior_version_latest()
        .endpoint_url(&config.endpoint)
        .region(Region::new(config.region.clone()))
        .credentials_provider(credentials)
        .force_path_style(true)
        .request_checksum_calculation(RequestChecksumCalculation::WhenRequired)
        .response_checksum_validation(ResponseChecksumValidation::WhenRequired)
        .build();
    Client::from_conf(conf)
}

/// Failure of an S3 transfer.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// Reading or writing a local file failed.
    #[error("local file {path}: {source}")]
    Local {
        /// The local path.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The object does not exist.
    #[error("object {key} does not exist")]
    Missing {
        /// The object's S3 key.
        key: String,
    },
    /// The S3 request failed (network, credentials, server).
    #[error("s3 request for {key} failed: {message}")]
    Request {
        /// The object's S3 key.
        key: String,
        /// The SDK's error with its sources.
        message: String,
    },
    /// The object has another size than expected (the message says "more than N bytes" when
    /// reading stopped past the declared size, the exact size when the object is shorter).
    #[error("object {key} is {} bytes, expected {expected}", size_seen(*.found, *.expected))]
    Size {
        /// The object's S3 key.
        key: String,
        /// Bytes seen (reading stops one byte past the expected size).
        found: u64,
        /// Declared size.
        expected: u64,
    },
    /// The object's SHA-256 differs from the declared one.
    #[error("object {key} has sha256 {found}, expected {expected}")]
    Digest {
        /// The object's S3 key.
        key: String,
        /// Digest of the bytes received.
        found: String,
        /// Declared digest.
        expected: String,
    },
}

impl TransferError {
    /// True when retrying later may succeed (network or server trouble), false when the
    /// request itself is wrong (missing object, wrong size or digest, local file).
    pub fn is_transient(&self) -> bool {
        matches!(self, TransferError::Request { .. })
    }
}

fn request_error<E: std::error::Error + 'static>(key: &str, err: E) -> TransferError {
    let mut message = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        message.push_str(": ");
        message.push_str(&s.to_string());
        source = s.source();
    }
    TransferError::Request { key: key.to_owned(), message }
}

/// SHA-256 and size of a local file, read in 64 KiB blocks.
///
/// # Errors
/// [`TransferError::Local`] when the file cannot be read.
pub async fn digest_file(path: &Path) -> Result<(String, u64), TransferError> {
    let local = |source| TransferError::Local { path: path.display().to_string(), source };
    let mut file = tokio::fs::File::open(path).await.map_err(local)?;
    digest_open_file(&mut file).await.map_err(local)
}

/// SHA-256 and size of an open file from its OS offset to its end, read on a blocking thread
/// through a duplicate of its fd (the offset is left at the end). The file must not have been
/// read through `tokio::fs::File` before (tokio's read-ahead would be skipped): every caller
/// hashes a file it just opened. Dropping the future does not stop the read.
///
/// # Errors
/// The read error.
pub async fn digest_open_file(file: &mut tokio::fs::File) -> std::io::Result<(String, u64)> {
    // On a blocking thread with std's reads of 1 MiB: tokio's file reads are a thread hop each
    // (100 MB in 64 KiB reads cost ~1,600 of them). The clone shares the file's offset, which
    // is left at the end, as reading through `file` would.
    let mut std_file = file.try_clone().await?.into_std().await;
    tokio::task::spawn_blocking(move || {
        use std::io::Read;
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut size = 0u64;
        loop {
            let n = match std_file.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            hasher.update(&buf[..n]);
            size += n as u64;
        }
        Ok((hex::encode(hasher.finalize()), size))
    })
    .await
    .map_err(std::io::Error::other)?
}

/// Uploads an open file (from offset 0) to `key` with `content_type`.
///
/// # Errors
/// [`TransferError::Local`] or [`TransferError::Request`].
pub async fn put_file(
    s3: &Client,
    bucket: &str,
    key: &str,
    file: tokio::fs::File,
    path_for_errors: &str,
    content_type: &str,
) -> Result<(), TransferError> {
    let body = ByteStream::read_from()
        .file(file)
        .build()
        .await
        .map_err(|e| TransferError::Local { path: path_for_errors.to_owned(), source: std::io::Error::other(e) })?;
    s3.put_object().bucket(bucket).key(key).content_type(content_type).body(body).send().await.map_err(|e| request_error(key, e))?;
    Ok(())
}

/// Uploads `bytes` to `key` with `content_type`.
///
/// # Errors
/// [`TransferError::Request`].
pub async fn put_bytes(s3: &Client, bucket: &str, key: &str, bytes: Vec<u8>, content_type: &str) -> Result<(), TransferError> {
    s3.put_object()
        .bucket(bucket)
        .key(key)
        .content_type(content_type)
        .body(ByteStream::from(bytes))
        .send()
        .await
        .map_err(|e| request_error(key, e))?;
    Ok(())
}

/// True when `key` exists in `bucket`.
///
/// # Errors
/// [`TransferError::Request`] for any failure but "not found".
pub async fn exists(s3: &Client, bucket: &str, key: &str) -> Result<bool, TransferError> {
    Ok(object_size(s3, bucket, key).await?.is_some())
}

/// The size of `key` in bytes (`HEAD`); `None` when there is no such object.
///
/// # Errors
/// [`TransferError::Request`].
pub async fn object_size(s3: &Client, bucket: &str, key: &str) -> Result<Option<u64>, TransferError> {
    match s3.head_object().bucket(bucket).key(key).send().await {
        Ok(head) => Ok(Some(head.content_length().and_then(|n| u64::try_from(n).ok()).unwrap_or(0))),
        Err(e) if e.as_service_error().is_some_and(|s| s.is_not_found()) => Ok(None),
        Err(e) => Err(request_error(key, e)),
    }
}

/// SHA-256 (hex) and size of the object `key`, read as a stream; `None` when it is larger
/// than `max` bytes (reading stops there).
///
/// # Errors
/// [`TransferError::Missing`] or [`TransferError::Request`].
pub async fn digest_object(s3: &Client, bucket: &str, key: &str, max: u64) -> Result<Option<(String, u64)>, TransferError> {
    let response = match s3.get_object().bucket(bucket).key(key).send().await {
        Ok(r) => r,
        Err(e) if e.as_service_error().is_some_and(|s| s.is_no_such_key()) => return Err(TransferError::Missing { key: key.to_owned() }),
        Err(e) => return Err(request_error(key, e)),
    };
    let mut body = response.body;
    let mut hasher = Sha256::new();
    let mut size = 0u64;
    while let Some(chunk) = body.try_next().await.map_err(|e| request_error(key, e))? {
        size += chunk.len() as u64;
        if size > max {
            return Ok(None);
        }
        hasher.update(&chunk);
    }
    Ok(Some((hex::encode(hasher.finalize()), size)))
}

/// Downloads `key` into the already created, empty `dest` file, reading at most
/// `expected_size + 1` bytes, and checks size and (if given) SHA-256.
///
/// # Errors
/// [`TransferError::Missing`], [`TransferError::Request`], [`TransferError::Size`],
/// [`TransferError::Digest`] or [`TransferError::Local`].
pub async fn get_to_file(
    s3: &Client,
    bucket: &str,
    key: &str,
    dest: &mut tokio::fs::File,
    dest_name: &str,
    expected_size: Option<u64>,
    expected_sha256: Option<&str>,
) -> Result<u64, TransferError> {
    let response = match s3.get_object().bucket(bucket).key(key).send().await {
        Ok(r) => r,
        Err(e) if e.as_service_error().is_some_and(|s| s.is_no_such_key()) => return Err(TransferError::Missing { key: key.to_owned() }),
        Err(e) => return Err(request_error(key, e)),
    };
    let local = |source| TransferError::Local { path: dest_name.to_owned(), source };
    let mut body = response.body;
    let mut hasher = Sha256::new();
    let mut written = 0u64;
    while let Some(chunk) = body.try_next().await.map_err(|e| request_error(key, e))? {
        written += chunk.len() as u64;
        if let Some(expected) = expected_size {
            if written > expected {
                return Err(TransferError::Size { key: key.to_owned(), found: written, expected });
            }
        }
        hasher.update(&chunk);
        dest.write_all(&chunk).await.map_err(local)?;
    }
    dest.flush().await.map_err(local)?;
    if let Some(expected) = expected_size {
        if written != expected {
            return Err(TransferError::Size { key: key.to_owned(), found: written, expected });
        }
    }
    let found = hex::encode(hasher.finalize());
    if let Some(expected) = expected_sha256 {
        if found != expected {
            return Err(TransferError::Digest { key: key.to_owned(), found, expected: expected.to_owned() });
        }
    }
    Ok(written)
}

/// Downloads `key` into memory, at most `max` bytes.
///
/// # Errors
/// [`TransferError::Missing`], [`TransferError::Request`], or [`TransferError::Size`] when the
/// object is larger than `max`.
pub async fn get_bytes(s3: &Client, bucket: &str, key: &str, max: u64) -> Result<Vec<u8>, TransferError> {
    let response = match s3.get_object().bucket(bucket).key(key).send().await {
        Ok(r) => r,
        Err(e) if e.as_service_error().is_some_and(|s| s.is_no_such_key()) => return Err(TransferError::Missing { key: key.to_owned() }),
        Err(e) => return Err(request_error(key, e)),
    };
    let mut body = response.body;
    let mut bytes = Vec::new();
    while let Some(chunk) = body.try_next().await.map_err(|e| request_error(key, e))? {
        if (bytes.len() + chunk.len()) as u64 > max {
            return Err(TransferError::Size { key: key.to_owned(), found: (bytes.len() + chunk.len()) as u64, expected: max });
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok(bytes)
}

/// How many bytes a size check saw: the count when the object ended early, "more than N" when
/// reading stopped past the declared size N (what lies beyond is never read).
fn size_seen(found: u64, expected: u64) -> String {
    if found > expected {
        format!("more than {expected}")
    } else {
        found.to_string()
    }
}

/// Characters percent-encoded in `x-amz-copy-source`: everything but unreserved characters
/// and `/` (S3 URL-decodes the header; a key holding `%`, `?`, `+` or non-ASCII must survive).
const COPY_SOURCE: &percent_encoding::AsciiSet =
    &percent_encoding::NON_ALPHANUMERIC.remove(b'/').remove(b'-').remove(b'_').remove(b'.').remove(b'~');

/// Server-side copy of `from` to `to` in `bucket` (S3 CopyObject: no bytes pass through here).
///
/// # Errors
/// [`TransferError::Request`].
pub async fn copy(s3: &Client, bucket: &str, from: &str, to: &str) -> Result<(), TransferError> {
    let source = percent_encoding::utf8_percent_encode(&format!("{bucket}/{from}"), COPY_SOURCE).to_string();
    s3.copy_object().bucket(bucket).key(to).copy_source(source).send().await.map_err(|e| request_error(from, e))?;
    Ok(())
}

/// Deletes `keys` (a missing key is not an error), 1,000 per DeleteObjects request.
///
/// # Errors
/// [`TransferError::Request`].
pub async fn delete_keys(s3: &Client, bucket: &str, keys: &[String]) -> Result<(), TransferError> {
    use aws_sdk_s3::types::{Delete, ObjectIdentifier};
    for chunk in keys.chunks(1000) {
        let objects = chunk
            .iter()
            .map(|k| ObjectIdentifier::builder().key(k).build().map_err(|e| request_error(k, e)))
            .collect::<Result<Vec<_>, _>>()?;
        let delete = Delete::builder().set_objects(Some(objects)).quiet(true).build().map_err(|e| request_error(&chunk[0], e))?;
        s3.delete_objects().bucket(bucket).delete(delete).send().await.map_err(|e| request_error(&chunk[0], e))?;
    }
    Ok(())
}

/// Keys under `prefix`, in key order, at most `max`.
///
/// # Errors
/// [`TransferError::Request`].
pub async fn list(s3: &Client, bucket: &str, prefix: &str, max: usize) -> Result<Vec<String>, TransferError> {
    list_pages(s3, bucket, prefix, None, max, |page| page.contents().iter().filter_map(|o| o.key().map(str::to_owned)).collect()).await
}

/// The "directories" directly under `prefix` (S3 common prefixes for the delimiter `/`), without
/// `prefix` and the trailing `/`, in key order, at most `max`: `a/x/1`, `a/y/2` under `a/`
/// give `x`, `y`.
///
/// # Errors
/// [`TransferError::Request`].
pub async fn list_dirs(s3: &Client, bucket: &str, prefix: &str, max: usize) -> Result<Vec<String>, TransferError> {
    list_pages(s3, bucket, prefix, Some("/"), max, |page| {
        page.common_prefixes().iter().filter_map(|p| p.prefix()?.strip_prefix(prefix)?.strip_suffix('/').map(str::to_owned)).collect()
    })
    .await
}

/// What `items` takes from each page of `ListObjectsV2` under `prefix` (with `delimiter`), in
/// order, until `max` or the last page.
async fn list_pages(
    s3: &Client,
    bucket: &str,
    prefix: &str,
    delimiter: Option<&str>,
    max: usize,
    items: impl Fn(&aws_sdk_s3::operation::list_objects_v2::ListObjectsV2Output) -> Vec<String>,
) -> Result<Vec<String>, TransferError> {
    let mut found = Vec::new();
    let mut token = None;
    loop {
        let page = s3
            .list_objects_v2()
            .bucket(bucket)
            .prefix(prefix)
            .set_delimiter(delimiter.map(str::to_owned))
            .set_continuation_token(token)
            .send()
            .await
            .map_err(|e| request_error(prefix, e))?;
        found.extend(items(&page));
        if found.len() >= max {
            found.truncate(max);
            return Ok(found);
        }
        match page.next_continuation_token() {
            Some(next) if page.is_truncated() == Some(true) => token = Some(next.to_owned()),
            _ => return Ok(found),
        }
    }
}

/// Deletes every object under `prefix`; returns how many.
///
/// # Errors
/// [`TransferError::Request`].
pub async fn delete_prefix(s3: &Client, bucket: &str, prefix: &str) -> Result<usize, TransferError> {
    let mut deleted = 0;
    loop {
        let keys = list(s3, bucket, prefix, 1000).await?;
        if keys.is_empty() {
            return Ok(deleted);
        }
        delete_keys(s3, bucket, &keys).await?;
        deleted += keys.len();
    }
}

/// A presigned GET URL of `key`, valid for `expires_in` (at most 7 days: the SigV4 limit).
/// Signing happens locally; no request is made.
///
/// # Errors
/// [`TransferError::Request`] when the duration is out of range or signing fails.
pub async fn presign_get(s3: &Client, bucket: &str, key: &str, expires_in: std::time::Duration) -> Result<String, TransferError> {
    let config = aws_sdk_s3::presigning::PresigningConfig::expires_in(expires_in).map_err(|e| request_error(key, e))?;
    // `attachment`: a browser downloads the object instead of rendering it on the S3 origin
    // (an HTML artifact written by the program must not run there).
    let request = s3
        .get_object()
        .bucket(bucket)
        .key(key)
        .response_content_disposition("attachment")
        .presigned(config)
        .await
        .map_err(|e| request_error(key, e))?;
    Ok(request.uri().to_owned())
}

#[cfg(test)]
mod tests {
    /// Trial gap 18: a short object is not reported as "1099 bytes or more".
    #[test]
    fn size_errors_say_what_was_seen() {
        let short = super::TransferError::Size { key: "k".into(), found: 1099, expected: 1100 };
        assert_eq!(short.to_string(), "object k is 1099 bytes, expected 1100");
        let long = super::TransferError::Size { key: "k".into(), found: 1101, expected: 1100 };
        assert_eq!(long.to_string(), "object k is more than 1100 bytes, expected 1100");
    }
}
