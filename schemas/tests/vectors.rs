//! The shared protocol test vectors of `schemas/vectors/` (written by its `generate.py`, their
//! meanings written there by hand from docs/protocol.md): every valid JobSpec decodes to its
//! meaning and passes validation, every invalid one is refused with its exact reason, every
//! JobResult decodes to its meaning (and survives a round trip), and every duration parses to
//! its length. The Python and TypeScript SDKs run the same files.

use std::path::{Path, PathBuf};

use sandq_schemas::{JobResult, JobSpec, Limits};
use serde_json::Value;

fn dir(sub: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("vectors").join(sub)
}

/// (name, bytes, sidecar) of every vector in `sub`, by name.
fn vectors(sub: &str) -> Vec<(String, Vec<u8>, Value)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir(sub)).expect("vector dir") {
        let path = entry.expect("entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("msgpack") {
            continue;
        }
        let name = path.file_stem().and_then(|s| s.to_str()).expect("name").to_owned();
        let bytes = std::fs::read(&path).expect("vector");
        let sidecar: Value = serde_json::from_slice(&std::fs::read(path.with_extension("json")).expect("sidecar")).expect("json");
        out.push((name, bytes, sidecar));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(!out.is_empty(), "no vectors in {sub}");
    out
}

#[test]
fn valid_jobspecs_decode_to_their_meaning_and_validate() {
    for (name, bytes, sidecar) in vectors("jobspec/valid") {
        let spec: JobSpec = sandq_schemas::decode(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        let decoded = serde_json::to_value(&spec).expect("json");
        assert_eq!(decoded, sidecar["spec"], "{name}");
        // Validated as a worker does (outbound allowed, entrypoints named by an input).
        spec.validate(&Limits::default()).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[test]
fn invalid_jobspecs_are_refused_with_their_exact_reason() {
    for (name, bytes, sidecar) in vectors("jobspec/invalid") {
        let reason = match sandq_schemas::decode::<JobSpec>(&bytes) {
            Err(e) => e.to_string(),
            Ok(spec) => spec.validate(&Limits::default()).map(|_| "accepted".to_owned()).unwrap_or_else(|e| e.to_string()),
        };
        assert_eq!(Some(reason.as_str()), sidecar["reason"].as_str(), "{name}");
    }
}

#[test]
fn jobresults_decode_to_their_meaning() {
    for (name, bytes, sidecar) in vectors("jobresult") {
        let result: JobResult = sandq_schemas::decode(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(serde_json::to_value(&result).expect("json"), sidecar["result"], "{name}");
        let again: JobResult = sandq_schemas::decode(&sandq_schemas::encode(&result).expect("encode")).expect("decode");
        assert_eq!(again, result, "{name}: round trip");
    }
}

#[test]
fn every_status_has_a_result_vector() {
    let statuses: Vec<String> =
        vectors("jobresult").iter().filter_map(|(_, _, s)| s["result"]["status"].as_str().map(str::to_owned)).collect();
    for status in
        ["queued", "running", "succeeded", "failed", "timed_out", "oom_killed", "rejected", "cancelled", "expired", "internal_error"]
    {
        assert!(statuses.iter().any(|s| s == status), "no JobResult vector of status {status}");
    }
}

#[test]
fn durations_parse_as_the_worker_parses_them() {
    let file: Value = serde_json::from_slice(&std::fs::read(dir("durations.json")).expect("durations")).expect("json");
    for case in file["durations"].as_array().expect("list") {
        let text = case["text"].as_str().expect("text");
        let parsed = humantime::parse_duration(text).ok().map(|d| d.as_secs_f64());
        assert_eq!(parsed, case["seconds"].as_f64(), "{text:?}");
    }
}
