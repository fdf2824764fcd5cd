//! Stage 2: decode a delivery's body and check it. Every failure here is the client's: the job
//! is `rejected` (never retried) with the error's message as the reason.

use sandq_schemas::{JobSpec, Sku, ValidJob};

use crate::settings::Settings;

/// Why a delivery is not a job this worker can run.
#[derive(Debug, thiserror::Error)]
pub enum ValidateError {
    /// Not MessagePack, or a field is missing, mistyped or has an unknown value (an unknown
    /// SKU lands here: `unknown variant "XXL", expected one of ...`).
    #[error(transparent)]
    Decode(#[from] sandq_schemas::DecodeError),
    /// Decoded, but breaks a rule or a limit.
    #[error(transparent)]
    Invalid(#[from] sandq_schemas::ValidationError),
    /// This worker has no slots for the job's SKU (it reached the wrong queue).
    #[error("sku {0} is not served by this worker")]
    SkuNotServed(Sku),
    /// The body's SKU is not the SKU of the queue it came from: a client allowed to publish
    /// only small jobs (per routing key) must not get a larger sandbox (security review F7).
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
pub fn validate(body: &[u8], settings: &Settings, queue: Sku) -> Result<ValidJob, ValidateError> {
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
