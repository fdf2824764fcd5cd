//! The live-event vectors (schemas/vectors/events.json, written by hand from docs/protocol.md
//! "Live events"): each case's entries, read as `XREAD` returns them, fold into what the
//! vector says a reader makes of them.

use std::collections::BTreeMap;

use sandq_core::events::{Event, Transcript};
use serde_json::Value;

#[test]
fn every_event_vector_reads_as_its_expectation() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../schemas/vectors/events.json");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).expect("events.json")).expect("json");
    let cases = doc["cases"].as_array().expect("cases");
    assert!(cases.len() >= 3);
    for case in cases {
        let name = case["name"].as_str().expect("name");
        let mut transcript = Transcript::default();
        for entry in case["entries"].as_array().expect("entries") {
            let fields: BTreeMap<String, String> = serde_json::from_value(entry["fields"].clone()).expect("fields");
            transcript.push(&Event::parse(entry["id"].as_str().expect("id"), fields));
        }
        let expect = &case["expect"];
        let attempts: Vec<u32> = serde_json::from_value(expect["attempts"].clone()).expect("attempts");
        assert_eq!(transcript.attempts, attempts, "{name}");
        assert_eq!(u64::from(transcript.attempt()), expect["final_attempt"].as_u64().expect("final_attempt"), "{name}");
        assert_eq!(transcript.stdout, expect["stdout"].as_str().expect("stdout"), "{name}");
        assert_eq!(transcript.stderr, expect["stderr"].as_str().expect("stderr"), "{name}");
        let displays: Vec<(u64, String, Option<String>)> = transcript
            .displays
            .iter()
            .map(|(index, output)| {
                let output = output.as_ref().expect("a display parses");
                let image = output.data.get("image/png").and_then(|v| v.artifact.as_ref()).map(|a| a.key.clone());
                (*index, serde_json::to_value(output.output_type).expect("type").as_str().expect("str").to_owned(), image)
            })
            .collect();
        let expected: Vec<(u64, String, Option<String>)> = expect["displays"]
            .as_array()
            .expect("displays")
            .iter()
            .map(|d| {
                (
                    d["index"].as_u64().expect("index"),
                    d["output_type"].as_str().expect("type").to_owned(),
                    d["image_key"].as_str().map(str::to_owned),
                )
            })
            .collect();
        assert_eq!(displays, expected, "{name}");
        let missing: Vec<(u32, u64)> = expect["missing"]
            .as_array()
            .expect("missing")
            .iter()
            .map(|m| (m["attempt"].as_u64().expect("attempt") as u32, m["seq"].as_u64().expect("seq")))
            .collect();
        assert_eq!(transcript.missing, missing, "{name}");
        let truncated: Vec<String> = serde_json::from_value(expect["truncated"].clone()).expect("truncated");
        assert_eq!(transcript.truncated, truncated, "{name}");
        assert_eq!(transcript.status.as_deref(), expect["status"].as_str(), "{name}");
        assert_eq!(transcript.last_id.as_deref(), expect["last_id"].as_str(), "{name}");
    }
}
