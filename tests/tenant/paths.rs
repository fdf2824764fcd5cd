//! Finding 5: one file name bricked a session. The gateway accepted session paths the worker
//! refused to restore (a backslash, a component over 255 bytes, `data` beside `data/x.csv`)
//! through the REST PUT, E2B writes and MCP's `upload_file`; every later job of the session then
//! failed as an internal error after 3 attempts, and no route deleted one file. Now one path rule
//! (`sandq_schemas::paths`) is checked on every plane, the worker rejects a session it cannot
//! restore on the first attempt with a reason naming the file, and
//! `DELETE /v1/sessions/{name}/files/{path}` removes that file.

use std::collections::BTreeMap;

use sandq_core::sessions::{FileEntry, Manifest};
use sandq_core::storage;
use sandq_schemas::names::Names;

use super::*;

/// A file name refused by the rule, and how it is sent (escaped as one URL path segment each).
struct Bad {
    /// The path in `/work`.
    path: String,
    /// What the refusal says.
    says: &'static str,
}

fn bad_paths() -> Vec<Bad> {
    vec![
        Bad { path: "a\\b".into(), says: "backslash" },
        Bad { path: "..\\evil".into(), says: "backslash" },
        Bad { path: format!("d/{}", "x".repeat(256)), says: "255 bytes" },
        Bad { path: "x".repeat(1025), says: "1024 bytes" },
    ]
}

/// `path` as a URL path, each `/`-separated segment percent-escaped (a backslash too: a URL
/// parser would read it as a separator).
fn escaped(path: &str) -> String {
    path.split('/').map(component).collect::<Vec<_>>().join("/")
}

/// `text` percent-escaped but for ASCII letters, digits, `-`, `.` and `_`.
fn component(text: &str) -> String {
    text.bytes()
        .map(|b| if b.is_ascii_alphanumeric() || b"-._".contains(&b) { char::from(b).to_string() } else { format!("%{b:02X}") })
        .collect()
}

async fn put_file(key: &str, session: &str, path: &str, body: &'static str) -> (StatusCode, Value) {
    let response = http()
        .put(format!("{}/v1/sessions/{session}/files/{}", gateway(), escaped(path)))
        .bearer_auth(key)
        .body(body)
        .send()
        .await
        .expect("PUT");
    let status = response.status();
    (status, response.json().await.unwrap_or(Value::Null))
}

async fn delete_file(key: &str, session: &str, path: &str) -> StatusCode {
    http()
        .delete(format!("{}/v1/sessions/{session}/files/{}", gateway(), escaped(path)))
        .bearer_auth(key)
        .send()
        .await
        .expect("DELETE")
        .status()
}

async fn create_session(key: &str, name: &str) {
    let created =
        http().post(format!("{}/v1/sessions", gateway())).bearer_auth(key).json(&json!({"name": name})).send().await.expect("POST");
    assert_eq!(created.status(), StatusCode::CREATED);
}

async fn listed(key: &str, session: &str) -> Vec<String> {
    let (status, listing) = get_json(key, &format!("/v1/sessions/{session}/files")).await;
    assert_eq!(status, StatusCode::OK, "{listing}");
    listing["files"].as_array().expect("files").iter().filter_map(|f| f["path"].as_str().map(str::to_owned)).collect()
}

/// Runs `code` in `session` and returns the finished job.
async fn run_in(key: &str, session: &str, code: &str) -> Value {
    let mut body = python(code);
    body["session"] = json!(session);
    let (status, job) = post_job(key, &body).await;
    assert_eq!(status, StatusCode::CREATED, "{job}");
    wait_job(key, job["job_id"].as_str().expect("id")).await
}

/// Finding 5, REST: every path the worker could not restore is refused at the PUT (400 naming
/// the rule; 409 `path-conflict` naming the other file), and the session still runs a job that
/// finds the files written before.
#[tokio::test]
async fn session_writes_the_worker_cannot_restore_are_refused_and_the_session_still_runs() {
    let key = key("paths", Quotas::default()).await;
    create_session(&key, "s").await;
    assert_eq!(put_file(&key, "s", "data/x.csv", "1,2\n").await.0, StatusCode::CREATED);
    for bad in bad_paths() {
        let (status, problem) = put_file(&key, "s", &bad.path, "x").await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{:.80}: {problem}", bad.path);
        assert_eq!(problem["type"], "urn:sandq:problem:invalid-request");
        assert!(problem["detail"].as_str().unwrap_or_default().contains(bad.says), "{problem}");
    }
    // A file where the session has a directory, and one under a file of the session.
    for (path, other) in [("data", "data/x.csv"), ("data/x.csv/y", "data/x.csv")] {
        let (status, problem) = put_file(&key, "s", path, "x").await;
        assert_eq!(status, StatusCode::CONFLICT, "{path}: {problem}");
        assert_eq!(problem["type"], "urn:sandq:problem:path-conflict");
        assert!(problem["detail"].as_str().unwrap_or_default().contains(&format!("{other:?}")), "{problem}");
    }
    // A sibling and a replacement are fine.
    assert_eq!(put_file(&key, "s", "data/y.csv", "3,4\n").await.0, StatusCode::CREATED);
    assert_eq!(put_file(&key, "s", "data/x.csv", "5,6\n").await.0, StatusCode::CREATED);
    assert_eq!(listed(&key, "s").await, vec!["data/x.csv", "data/y.csv"]);
    let done = run_in(&key, "s", "print(open('data/x.csv').read() + open('data/y.csv').read(), end='')").await;
    assert_eq!(done["status"], "succeeded", "{done}");
    assert_eq!(done["stdout"]["text"], "5,6\n3,4\n");
    // A job's inputs pass the same rule.
    let uploaded = http().post(format!("{}/v1/files", gateway())).bearer_auth(&key).body("x").send().await.expect("POST /v1/files");
    let file_id = uploaded.json::<Value>().await.expect("json")["file_id"].clone();
    let mut body = python("print(1)");
    body["inputs"] = json!([{"file_id": file_id, "path": "a\\b"}]);
    let (status, problem) = post_job(&key, &body).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{problem}");
    assert!(problem["detail"].as_str().unwrap_or_default().contains("backslash"), "{problem}");
}

/// Finding 5, the fix's route: one file deleted (204, then 404), its tenant's only: another
/// tenant's DELETE of it is a 404 and the file stays.
#[tokio::test]
async fn one_session_file_is_deleted_by_its_tenant_only() {
    let key_a = key("paths", Quotas::default()).await;
    let key_b = key("paths", Quotas::default()).await;
    create_session(&key_a, "s").await;
    create_session(&key_b, "s").await;
    assert_eq!(put_file(&key_a, "s", "keep.txt", "a").await.0, StatusCode::CREATED);
    assert_eq!(put_file(&key_a, "s", "gone.txt", "b").await.0, StatusCode::CREATED);
    // Tenant B's session of the same name holds no such file, and it reaches none of A's.
    assert_eq!(delete_file(&key_b, "s", "keep.txt").await, StatusCode::NOT_FOUND);
    assert_eq!(delete_file(&key_b, "nothere", "keep.txt").await, StatusCode::NOT_FOUND);
    assert_eq!(listed(&key_a, "s").await, vec!["gone.txt", "keep.txt"]);
    assert_eq!(delete_file(&key_a, "s", "gone.txt").await, StatusCode::NO_CONTENT);
    assert_eq!(delete_file(&key_a, "s", "gone.txt").await, StatusCode::NOT_FOUND);
    assert_eq!(listed(&key_a, "s").await, vec!["keep.txt"]);
    let done = run_in(&key_a, "s", "import os; print(sorted(os.listdir('.')))").await;
    assert_eq!(done["stdout"]["text"], "['keep.txt']\n", "{done}");
}

/// Finding 5, a session bricked the old way (its manifest written straight into S3 with `data`
/// beside `data/x.csv`, and a backslash name): the job is `rejected` on its first attempt with
/// a reason naming the file to delete (not retried, not an internal error); once that file is
/// deleted, the next job of the session runs.
#[tokio::test]
async fn a_session_the_worker_cannot_restore_fails_its_job_once_with_a_reason_and_is_mended_by_delete() {
    for (bad, other) in [("data", Some("data/x.csv")), ("a\\b", None)] {
        let label = tenant("paths");
        let (_, key) = new_key(&label, Quotas::default()).await;
        create_session(&key, "s").await;
        // Written behind the gateway's back, as the gateway's PUT used to: the session's blobs
        // and manifest in S3.
        let config = sandq_tests::service_config();
        let s3 = storage::client(&config.s3);
        let names = Names::new(sandq_tests::namespace());
        let scoped = format!("{label}_s");
        let mut files = BTreeMap::new();
        for (path, bytes) in [(bad, "bad"), ("data/x.csv", "1,2\n")] {
            let sha256 = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(bytes.as_bytes()));
            storage::put_bytes(
                &s3,
                &config.s3.bucket,
                &names.session_blob_key(&scoped, &sha256),
                bytes.as_bytes().to_vec(),
                "application/octet-stream",
            )
            .await
            .expect("blob");
            files.insert(path.to_owned(), FileEntry { sha256, size: bytes.len() as u64 });
        }
        let now = sandq_core::time::now_ms();
        let manifest =
            Manifest { files, created_at_ms: now, updated_at_ms: now, expires_at_ms: now + 30 * 60 * 1000, ..Manifest::default() };
        let mut redis = sandq_core::redis_conn::connect(&config.redis).await.expect("redis");
        sandq_core::sessions::store(&s3, &config.s3.bucket, &mut redis, &names, &scoped, &manifest).await.expect("manifest");

        let done = run_in(&key, "s", "print('ran')").await;
        assert_eq!(done["status"], "rejected", "{done}");
        assert_eq!(done["attempt"], 1, "not retried: {done}");
        let reason = done["reason"].as_str().unwrap_or_default();
        assert!(reason.contains(&format!("{bad:?}")) && reason.contains("DELETE /v1/sessions/"), "{reason}");
        if let Some(other) = other {
            assert!(reason.contains(&format!("{other:?}")), "{reason}");
        }
        assert!(done["stdout"]["text"].as_str().unwrap_or_default().is_empty(), "the program did not run: {done}");
        let data_dir = sandq_tests::worker_data_dir().display().to_string();
        assert!(!done.to_string().contains(&data_dir), "no host path in the result (finding 11): {done}");

        assert_eq!(delete_file(&key, "s", bad).await, StatusCode::NO_CONTENT);
        let done = run_in(&key, "s", "print(open('data/x.csv').read(), end='')").await;
        assert_eq!(done["status"], "succeeded", "{done}");
        assert_eq!(done["stdout"]["text"], "1,2\n");
        assert_eq!(listed(&key, "s").await, vec!["data/x.csv"]);
    }
}

/// An E2B sandbox of `key`'s tenant; its id.
async fn e2b_sandbox(key: &str) -> String {
    let response = http().post(format!("{}/sandboxes", gateway())).header("X-API-Key", key).json(&json!({})).send().await.expect("POST");
    assert_eq!(response.status(), StatusCode::CREATED);
    let sandbox: Value = response.json().await.expect("json");
    sandbox["sandboxID"].as_str().expect("id").to_owned()
}

/// A request to the sandbox plane of sandbox `id` (envd's port).
fn envd(method: reqwest::Method, path: &str, key: &str, id: &str) -> reqwest::RequestBuilder {
    http()
        .request(method, format!("{}{path}", gateway()))
        .header("X-Access-Token", key)
        .header("E2b-Sandbox-Id", id)
        .header("E2b-Sandbox-Port", "49983")
}

async fn e2b_write(key: &str, id: &str, path: &str) -> (StatusCode, Value) {
    let url_path = format!("/files?path={}", component(path));
    let response = envd(reqwest::Method::POST, &url_path, key, id)
        .header("content-type", "application/octet-stream")
        .body("x")
        .send()
        .await
        .expect("POST /files");
    let status = response.status();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// Finding 5, E2B: envd writes of paths the worker could not restore are refused (400; a file
/// beside a directory of its name 409), `files.remove` deletes a file (another tenant's call
/// reaches nothing), and the sandbox still runs a job.
#[tokio::test]
async fn e2b_writes_the_worker_cannot_restore_are_refused_and_remove_deletes_a_file() {
    let key_a = key("paths", Quotas::default()).await;
    let key_b = key("paths", Quotas::default()).await;
    let id = e2b_sandbox(&key_a).await;
    assert_eq!(e2b_write(&key_a, &id, "/home/user/data/x.csv").await.0, StatusCode::OK);
    for bad in bad_paths() {
        let (status, answer) = e2b_write(&key_a, &id, &format!("/home/user/{}", bad.path)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{:.80}: {answer}", bad.path);
        assert!(answer["message"].as_str().unwrap_or_default().contains(bad.says), "{answer}");
    }
    let (status, answer) = e2b_write(&key_a, &id, "/home/user/data").await;
    assert_eq!(status, StatusCode::CONFLICT, "{answer}");
    assert!(answer["message"].as_str().unwrap_or_default().contains("data/x.csv"), "{answer}");
    // A multipart write is checked whole before any part is written: a bad part, or two parts
    // a file and a directory of one name, and none is.
    for (names, status) in [(["ok.txt", "a\\b"], StatusCode::BAD_REQUEST), (["m", "m/y"], StatusCode::CONFLICT)] {
        let boundary = "sandqboundary";
        let mut body = String::new();
        for name in names {
            body.push_str(&format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\nContent-Type: application/octet-stream\r\n\r\nx\r\n"
            ));
        }
        body.push_str(&format!("--{boundary}--\r\n"));
        let response = envd(reqwest::Method::POST, "/files", &key_a, &id)
            .header("content-type", format!("multipart/form-data; boundary={boundary}"))
            .body(body)
            .send()
            .await
            .expect("POST /files");
        assert_eq!(response.status(), status, "{names:?}: {}", response.text().await.unwrap_or_default());
    }
    assert_eq!(listed(&key_a, &id).await, vec!["data/x.csv"], "no part of a refused write is kept");
    assert_eq!(e2b_write(&key_a, &id, "/home/user/gone.txt").await.0, StatusCode::OK);
    assert_eq!(listed(&key_a, &id).await, vec!["data/x.csv", "gone.txt"]);
    // files.remove: another tenant's key finds no such sandbox; the owner's removes the file.
    let remove = |key: String| {
        let id = id.clone();
        async move {
            envd(reqwest::Method::POST, "/filesystem.Filesystem/Remove", &key, &id)
                .json(&json!({"path": "/home/user/gone.txt"}))
                .send()
                .await
                .expect("Remove")
                .status()
        }
    };
    assert_ne!(remove(key_b.clone()).await, StatusCode::OK);
    assert_eq!(listed(&key_a, &id).await, vec!["data/x.csv", "gone.txt"]);
    assert_eq!(remove(key_a.clone()).await, StatusCode::OK);
    assert_eq!(remove(key_a.clone()).await, StatusCode::NOT_FOUND);
    assert_eq!(listed(&key_a, &id).await, vec!["data/x.csv"]);
    let done = run_in(&key_a, &id, "import os; print(sorted(os.listdir('.')), open('data/x.csv').read())").await;
    assert_eq!(done["status"], "succeeded", "{done}");
    assert_eq!(done["stdout"]["text"], "['data'] x\n");
}

/// One MCP tool call with `key`; the tool result (`result`).
async fn mcp_call(key: &str, tool: &str, arguments: Value) -> Value {
    let request = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": tool, "arguments": arguments}});
    let response = http()
        .post(format!("{}/mcp", gateway()))
        .bearer_auth(key)
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", "2025-06-18")
        .json(&request)
        .send()
        .await
        .expect("POST /mcp");
    assert_eq!(response.status(), StatusCode::OK);
    let answer: Value = response.json().await.expect("json");
    answer["result"].clone()
}

fn tool_text(result: &Value) -> String {
    result["content"].as_array().into_iter().flatten().filter_map(|c| c["text"].as_str()).collect()
}

/// Finding 5, MCP: `upload_file` refuses every path the worker could not restore, as a tool
/// error the model reads; `delete_file` deletes one file; the session still runs a job.
#[tokio::test]
async fn mcp_uploads_the_worker_cannot_restore_are_refused_and_delete_file_deletes_one() {
    let key_a = key("paths", Quotas::default()).await;
    let key_b = key("paths", Quotas::default()).await;
    create_session(&key_a, "s").await;
    let upload = |key: String, path: String| async move {
        mcp_call(&key, "upload_file", json!({"session": "s", "path": path, "content": "x"})).await
    };
    let ok = upload(key_a.clone(), "data/x.csv".into()).await;
    assert_ne!(ok["isError"], true, "{ok}");
    for bad in bad_paths() {
        let refused = upload(key_a.clone(), bad.path.clone()).await;
        assert_eq!(refused["isError"], true, "{refused}");
        let text = tool_text(&refused);
        assert!(text.contains("invalid arguments") && text.contains(bad.says), "{text}");
    }
    let refused = upload(key_a.clone(), "data".into()).await;
    assert_eq!(refused["isError"], true, "{refused}");
    assert!(tool_text(&refused).contains("path-conflict"), "{refused}");
    assert_ne!(upload(key_a.clone(), "gone.txt".into()).await["isError"], true);
    // Tenant B's delete_file reaches nothing of A's.
    let theirs = mcp_call(&key_b, "delete_file", json!({"session": "s", "path": "gone.txt"})).await;
    assert_eq!(theirs["isError"], true, "{theirs}");
    assert_eq!(listed(&key_a, "s").await, vec!["data/x.csv", "gone.txt"]);
    let deleted = mcp_call(&key_a, "delete_file", json!({"session": "s", "path": "gone.txt"})).await;
    assert_ne!(deleted["isError"], true, "{deleted}");
    assert_eq!(listed(&key_a, "s").await, vec!["data/x.csv"]);
    let done = run_in(&key_a, "s", "print(open('data/x.csv').read())").await;
    assert_eq!(done["status"], "succeeded", "{done}");
    assert_eq!(done["stdout"]["text"], "x\n");
}
