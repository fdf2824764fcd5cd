//! Wire types of the sandq job protocol, shared by the worker, the Rust submitter and (through
//! `docs/protocol.md`) clients in any other language.
//!
//! Every message is MessagePack with **named fields** (`rmp_serde::to_vec_named`), so a client in
//! another language reads and writes plain maps with string keys. Enums are plain strings
//! (`"M"`, `"python"`, `"succeeded"`).
//!
//! - [`JobSpec`]: what a client publishes to RabbitMQ (one job per message).
//! - [`JobResult`] and [`JobStatus`]: what the worker writes to Redis, read back by clients.
//! - [`names`]: exchange, queue and routing names, Redis keys, S3 key layout.
//! - [`protocol`]: protocol text used verbatim in every language (the compare-and-set script).
//! - [`validate`]: limits and the checks every job passes before it is staged.
//! - [`de`]: the lenient field decoders (nil is absent; integers of any width, or integral
//!   floats), whose errors name the field.

pub mod de;
pub mod events;
pub mod job;
mod keys;
pub mod names;
pub mod protocol;
pub mod result;
pub mod validate;

pub use job::{Compat, Dialect, InputFile, JobSpec, NetworkMode, RunMode, Runtime, Sku};
pub use result::{
    Artifact, CapturedOutput, ErrorInfo, ImageSize, JobResult, JobStatus, MimeValue, Output, OutputType, ResourceUsage, SandboxStart,
    SessionInfo, SessionState, SkippedArtifact, TableShape, UnsavedVariable,
};
pub use validate::{Limits, ValidJob, ValidationError};

/// Version of the wire format written in `schema_version` of every [`JobSpec`] and [`JobResult`].
///
/// A worker rejects a job whose version it does not know (`rejected`, reason names the versions).
pub const SCHEMA_VERSION: u32 = 1;

/// Content type of every sandq message body (the AMQP `content_type` property).
pub const CONTENT_TYPE: &str = "application/msgpack";

/// Failure to turn bytes into a wire type.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The body is not MessagePack, or not a map with the fields of the type.
    #[error("malformed message: {0}")]
    Malformed(#[from] rmp_serde::decode::Error),
    /// The body is MessagePack but not a map: every sandq message and record is a map with
    /// named fields (docs/protocol.md). serde would read a struct from an array too, field by
    /// position; two readers of one body could then disagree on its job id (one decoding it
    /// whole, one peeking at `job_id` alone), and a result landed under a made-up id.
    #[error("malformed message: not a MessagePack map (every sandq message is a map with named fields)")]
    NotAMap,
    /// A map in the body has a key that is not a string. serde would take an integer key for
    /// the index of a field, and two readers of one body could disagree on its job id (see
    /// the `keys` module).
    #[error("malformed message: the map key at byte {offset} is not a string (every key of a sandq message is a string)")]
    KeyNotAString {
        /// Offset of the key in the body, bytes.
        offset: usize,
    },
}

/// Whether `bytes` starts with a MessagePack map (fixmap, map 16 or map 32).
fn is_map(bytes: &[u8]) -> bool {
    matches!(bytes.first(), Some(0x80..=0x8f | 0xde | 0xdf))
}

/// Failure to turn a wire type into bytes (only possible for a type serde cannot encode).
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    /// rmp-serde refused the value.
    #[error("cannot encode message: {0}")]
    Encode(#[from] rmp_serde::encode::Error),
}

/// Encodes a wire type as MessagePack with named fields.
///
/// # Errors
/// [`EncodeError::Encode`] if serde cannot encode the value (never for the types of this crate).
pub fn encode<T: serde::Serialize>(value: &T) -> Result<Vec<u8>, EncodeError> {
    Ok(rmp_serde::to_vec_named(value)?)
}

/// Decodes a wire type from MessagePack (a map: [`DecodeError::NotAMap`] otherwise, whose
/// keys at every depth are strings: [`DecodeError::KeyNotAString`] otherwise), nested at
/// most [`MAX_DEPTH`] deep. The lists and maps of a [`JobSpec`] are bounded while they are
/// decoded ([`de::MAX_ARGS`], [`de::MAX_INPUTS`], [`de::MAX_ENV`]), so a body decodes to at
/// most its own size plus a fixed amount, whoever wrote it.
///
/// # Errors
/// [`DecodeError::NotAMap`] when the bytes do not start with a map;
/// [`DecodeError::KeyNotAString`] when a map key is not a string; [`DecodeError::Malformed`] if the bytes are not MessagePack or lack a required field, or a
/// field has the wrong type or an unknown enum value (the message names the field or value).
pub fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, DecodeError> {
    if !is_map(bytes) {
        return Err(DecodeError::NotAMap);
    }
    if let Some(offset) = keys::first_non_string_key(bytes, MAX_DEPTH) {
        return Err(DecodeError::KeyNotAString { offset });
    }
    Ok(from_slice(bytes)?)
}

/// The deepest nesting of MessagePack containers any decode of this crate follows (a JobSpec
/// is at most 3 deep: the message, `inputs`, an input; a JobResult about 5). rmp-serde's own
/// default is 1,024, and serde's recursion over a body of 600 nested one-byte arrays
/// (1,084 bytes) overflowed a debug build's 2 MiB tokio stack and aborted the worker (test:
/// a_deeply_nested_body_is_rejected_and_the_worker_lives).
pub const MAX_DEPTH: usize = 32;

/// `rmp_serde::from_slice` with the nesting bounded to [`MAX_DEPTH`]: every decode of
/// untrusted bytes in sandq goes through here.
fn from_slice<'de, T: serde::Deserialize<'de>>(bytes: &'de [u8]) -> Result<T, rmp_serde::decode::Error> {
    let mut de = rmp_serde::Deserializer::from_read_ref(bytes);
    de.set_max_depth(MAX_DEPTH);
    T::deserialize(&mut de)
}

/// Reads only the `job_id` field of a message that may be malformed otherwise, so that a
/// `rejected` result can still be written for it. Returns `None` when the body is not a map
/// with a string `job_id` that passes [`validate::check_job_id`], or has a map key that is not
/// a string ([`decode`] refuses the same bodies, so the two never disagree on the id).
pub fn peek_job_id(bytes: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct JobIdOnly {
        job_id: String,
    }
    if !is_map(bytes) || keys::first_non_string_key(bytes, MAX_DEPTH).is_some() {
        return None;
    }
    let peeked: JobIdOnly = from_slice(bytes).ok()?;
    validate::check_job_id(&peeked.job_id).ok()?;
    Some(peeked.job_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job body as an array (fields by position) is not a job: decoding it whole and peeking
    /// at its id must agree that it has none (the fuzz test found a dead letter given the id
    /// "job_id" from an array whose elements were the map's keys and values).
    #[test]
    fn only_maps_are_messages() {
        let spec = JobSpec::new("a-job", Sku::S, Runtime::Python, "print(1)".to_owned());
        let as_array = rmp_serde::to_vec(&spec).expect("encode as array");
        assert!(matches!(as_array.first(), Some(0x90..=0x9f | 0xdc | 0xdd)), "rmp_serde::to_vec writes an array");
        assert!(matches!(decode::<JobSpec>(&as_array), Err(DecodeError::NotAMap)));
        assert_eq!(peek_job_id(&as_array), None);
        // Keys and values flattened into an array: the id "job_id" must not come out of it.
        let flat = rmpv::Value::Array(vec!["schema_version".into(), 1.into(), "job_id".into(), "x".into()]);
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &flat).expect("encode");
        assert!(decode::<JobSpec>(&bytes).is_err());
        assert_eq!(peek_job_id(&bytes), None);
        let map = encode(&spec).expect("encode");
        assert_eq!(peek_job_id(&map).as_deref(), Some("a-job"));
        assert_eq!(decode::<JobSpec>(&map).expect("decode").job_id, "a-job");
    }

    /// An integer key is taken by serde for a field's index: `{1: "x"}` would set `job_id`
    /// of a whole `JobSpec` but not of the peek. The fuzz test's body (seed 42fdb49d1c490778)
    /// had `schema_version` followed by the key 1: the worker dead-lettered it as having no
    /// id, and its dead-letter consumer, decoding it whole, found one. Both now refuse it.
    #[test]
    fn an_integer_key_is_refused_by_decode_and_peek_alike() {
        use rmpv::Value;
        let body = Value::Map(vec![
            ("schema_version".into(), 1.into()),
            (Value::from(1), "job-from-an-index".into()),
            ("sku".into(), "S".into()),
            ("runtime".into(), "python".into()),
            ("code".into(), "print(1)".into()),
        ]);
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &body).expect("encode");
        // The quirk this guards against: without the key check serde reads field 1.
        let unchecked: JobSpec = from_slice(&bytes).expect("serde reads an index key");
        assert_eq!(unchecked.job_id, "job-from-an-index");
        // fixmap, "schema_version" (15 bytes), 1: the key 1 is at byte 17.
        assert!(matches!(decode::<JobSpec>(&bytes), Err(DecodeError::KeyNotAString { offset: 17 })));
        assert_eq!(peek_job_id(&bytes), None);
    }

    proptest::proptest! {
        /// Whatever a body becomes by byte mutations, a whole decode and a peek agree on its
        /// job id (the worker and its dead-letter consumer read ids each way).
        #[test]
        fn decode_and_peek_agree_on_the_job_id_of_any_mutated_body(
            edits in proptest::collection::vec((0usize..400, 0u8..3, proptest::num::u8::ANY), 1..6),
        ) {
            let mut spec = JobSpec::new("c22953dd-66d1-4d46-ae6d-5aac8dee8156", Sku::S, Runtime::Python, "print(1)".to_owned());
            spec.timeout = Some("60s".into());
            spec.result_ttl = Some("10m".into());
            let mut body = encode(&spec).expect("encode");
            for (at, op, byte) in edits {
                let at = at % body.len();
                match op {
                    0 => body[at] = byte,
                    1 => body.truncate(at.max(1)),
                    _ => body.insert(at, byte),
                }
            }
            let whole = decode::<JobSpec>(&body).ok().map(|s| s.job_id).filter(|id| validate::check_job_id(id).is_ok());
            if let Some(id) = whole {
                proptest::prop_assert_eq!(peek_job_id(&body), Some(id));
            }
        }
    }

    /// A client in another language sees plain maps with string keys and string enums.
    #[test]
    fn results_are_plain_maps() {
        let mut result = JobResult::new("j1", JobStatus::TimedOut);
        result.sku = Some(Sku::XL);
        let bytes = encode(&result).expect("encode");
        let value = rmpv::decode::read_value(&mut bytes.as_slice()).expect("msgpack");
        let map = value.as_map().expect("a map");
        let get = |k: &str| map.iter().find(|(key, _)| key.as_str() == Some(k)).map(|(_, v)| v.clone());
        assert_eq!(get("status").and_then(|v| v.as_str().map(str::to_owned)).as_deref(), Some("timed_out"));
        assert_eq!(get("sku").and_then(|v| v.as_str().map(str::to_owned)).as_deref(), Some("XL"));
        assert_eq!(get("job_id").and_then(|v| v.as_str().map(str::to_owned)).as_deref(), Some("j1"));
        assert!(get("stdout").is_some_and(|v| v.is_map()));
        let back: JobResult = decode(&bytes).expect("decode");
        assert_eq!(back, result);
    }

    #[test]
    fn job_ids_are_peeked_from_partial_messages() {
        let partial = rmp_serde::to_vec_named(&std::collections::BTreeMap::from([("job_id", "abc-1")])).expect("encode");
        assert_eq!(peek_job_id(&partial).as_deref(), Some("abc-1"));
        let hostile = rmp_serde::to_vec_named(&std::collections::BTreeMap::from([("job_id", "../x")])).expect("encode");
        assert_eq!(peek_job_id(&hostile), None);
        assert_eq!(peek_job_id(b"\xc1garbage"), None);
    }

    /// `{"job_id": "deep-1", "x": [[[...]]]}` with `levels` nested one-element arrays.
    fn nested(levels: usize) -> Vec<u8> {
        let mut bytes = vec![0x82, 0xa6];
        bytes.extend_from_slice(b"job_id");
        bytes.push(0xa6);
        bytes.extend_from_slice(b"deep-1");
        bytes.extend_from_slice(&[0xa1, b'x']);
        bytes.extend(std::iter::repeat_n(0x91, levels));
        bytes.push(0xc0);
        bytes
    }

    /// 600 nested arrays in an ignored field (1,084 bytes) overflowed a debug
    /// build's 2 MiB thread stack; past [`MAX_DEPTH`] the body is refused, and the job id is not
    /// peeked out of it. Run on a thread of a 2 MiB stack, as tokio's workers have.
    #[test]
    fn nesting_past_the_depth_limit_is_refused() {
        let thread = std::thread::Builder::new().stack_size(2 << 20).spawn(|| {
            for levels in [600, 5_000] {
                let err = decode::<JobSpec>(&nested(levels)).expect_err("too deep").to_string();
                assert!(err.contains("depth limit exceeded"), "{levels}: {err}");
                assert_eq!(peek_job_id(&nested(levels)), None, "{levels}");
            }
            // The map itself is one level: MAX_DEPTH - 2 arrays plus their nil still decode.
            assert_eq!(peek_job_id(&nested(MAX_DEPTH - 2)).as_deref(), Some("deep-1"));
            assert_eq!(peek_job_id(&nested(MAX_DEPTH + 1)), None);
        });
        thread.expect("spawn").join().expect("the decoder stayed within a 2 MiB stack");
    }

    proptest::proptest! {
        /// The decoder never panics on arbitrary bytes.
        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let _ = decode::<JobSpec>(&bytes);
            let _ = peek_job_id(&bytes);
        }
    }
}
