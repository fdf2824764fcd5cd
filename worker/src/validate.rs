//! Step 1, validate (`crate::job`): decode a delivery's body and check it. Every failure here is the client's: the job
//! is `rejected` (never retried) with the error's message as the reason.

use sandq_schemas::{JobSpec, Sku, ValidJob};

use crate::settings::Settings;

/// Why a delivery is not a job this worker can run.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ValidateError {
    /// Not MessagePack, or a field is missing, mistyped or has an unknown value (an unknown
    /// SKU lands here: `unknown variant "XXL", expected one of ...`).
    #[error(transparent)]
    Decode(#[from] sandq_schemas::DecodeError),
    /// Decoded, but breaks a rule or a limit.
    #[error(transparent)]
    Invalid(#[from] sandq_schemas::ValidationError),
    /// The body is larger than any valid job could be: refused before it is decoded, since
    /// decoding a crafted message costs many times its size (100 MB of 5-byte input entries
    /// took the worker to 1.7 GB; test: an_oversize_message_is_refused_before_decoding in
    /// tests/hostile.rs).
    #[error("message of {size} bytes is larger than any valid job ({max} bytes at most)")]
    TooLarge {
        /// The body's size, bytes.
        size: usize,
        /// The largest body accepted, bytes.
        max: usize,
    },
    /// This worker has no slots for the job's SKU (it reached the wrong queue).
    #[error("sku {0} is not served by this worker")]
    SkuNotServed(Sku),
    /// The body's SKU is not the SKU of the queue it came from: a client allowed to publish
    /// only small jobs (per routing key) must not get a larger sandbox (test:
    /// a_sku_other_than_the_queues_is_rejected in tests/hostile.rs).
    #[error("sku {body} in the job does not match the queue of sku {queue} it was published to")]
    SkuMismatch {
        /// The SKU the body names.
        body: Sku,
        /// The SKU of the queue the delivery came from.
        queue: Sku,
    },
}

/// Decodes and validates `body`, delivered from the queue of SKU `queue`.
///
/// # Errors
/// [`ValidateError`]; the caller finds the job id, if any, with
/// [`sandq_schemas::peek_job_id`].
pub(crate) fn validate(body: &[u8], settings: &Settings, queue: Sku) -> Result<ValidJob, ValidateError> {
    let max = max_body_bytes(&settings.limits);
    if body.len() > max {
        return Err(ValidateError::TooLarge { size: body.len(), max });
    }
    let spec: JobSpec = sandq_schemas::decode(body)?;
    let valid = spec.validate(&settings.limits)?;
    if valid.spec.sku != queue {
        return Err(ValidateError::SkuMismatch { body: valid.spec.sku, queue });
    }
    if !settings.skus.contains_key(&valid.spec.sku) {
        return Err(ValidateError::SkuNotServed(valid.spec.sku));
    }
    Ok(valid)
}

/// The largest body a valid job can have, bytes: its code and stdin at their limits, plus
/// 4 MiB for everything else (1,000 inputs of at most 1 KiB paths, args and env at most 1 MiB
/// together, the other fields).
pub(crate) fn max_body_bytes(limits: &sandq_schemas::Limits) -> usize {
    limits.max_code_bytes + limits.max_stdin_bytes + (4 << 20)
}
