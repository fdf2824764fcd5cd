//! The MCP server: its tools (run code, sessions, files, jobs), a session's files as
//! resources, progress while code runs, and `run_code` as an MCP task (SEP-2663) for a client
//! that declares the extension: the task id is the job id and the task's state is the job's, so
//! nothing is kept here.
//!
//! Arguments that do not match a tool's schema (unknown fields, wrong types) or its limits are
//! tool error results naming the problem (rmcp's rule, and MCP's for input validation); an
//! unknown tool or a malformed message is a JSON-RPC error; what the gateway refuses (a quota, a bad path, another tenant's
//! id) is an `isError` tool result whose text says why, so the model can change course.

use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use futures::StreamExt as _;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{
    CallToolResponse, CallToolResult, CancelTaskParams, ContentBlock, CreateTaskResult, DetailedTask, Extensions, GetTaskParams,
    GetTaskResult, ListResourceTemplatesResult, ListResourcesResult, PaginatedRequestParams, ProgressNotificationParam,
    ReadResourceRequestParams, ReadResourceResponse, ReadResourceResult, Resource, ResourceContents, ResourceTemplate, ServerCapabilities,
    ServerConfig, Task, TaskPayload,
};
use rmcp::service::RequestContext;
use rmcp::{tool, tool_handler, tool_router, ErrorData, RoleServer, ServerHandler};
use sandq_schemas::{JobResult, JobStatus};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::content::{self, Limits};
use crate::refusal::{no_task, refused, with_causes};
use sandq_client::http::{HttpClient, HttpError, Transport};

/// Largest program `run_code` takes (the JobSpec's limit, docs/protocol.md).
const MAX_CODE_BYTES: usize = 1 << 20;
/// Largest file `upload_file` takes inline (after base64 decoding: its JSON then fits the
/// gateway's default 10 MiB body); larger files go through the REST API (`PUT /v1/sessions/{name}/files/{path}`).
const MAX_UPLOAD_BYTES: usize = 5 << 20;
/// Largest file `read_file` returns (text inline up to [`Limits::text_chars`]).
const MAX_READ_BYTES: usize = 8 << 20;
/// Files `list_files` lists at most (then says it cut the list).
const MAX_LISTED: usize = 200;
/// Resources `resources/list` gives at most, over the tenant's sessions.
const MAX_RESOURCES: usize = 500;
/// Sessions `resources/list` looks into at most (one REST call each).
const MAX_LISTED_SESSIONS: usize = 50;
/// How long `run_code` waits for a job past its timeout (queueing, staging) before it
/// answers with the job id to ask again later.
const QUEUE_ALLOWANCE: Duration = Duration::from_secs(120);
/// Timeout of a job that names none (the queue's default).
const DEFAULT_TIMEOUT_S: u64 = 60;
/// How long the result of a `run_code` run as an MCP task is kept (its job's `result_ttl`),
/// and so how long `tasks/get` finds it: the task's `ttlMs`.
const TASK_RESULT_TTL: Duration = Duration::from_secs(3600);
/// How often a client is asked to poll `tasks/get` (`pollIntervalMs`).
const TASK_POLL_INTERVAL: Duration = Duration::from_millis(500);

/// Where the API key of a tool call comes from.
#[derive(Clone)]
pub enum KeySource {
    /// One key for every call (stdio: the local config's).
    Fixed(String),
    /// The `Authorization: Bearer` (or `X-Api-Key`) header of the MCP HTTP request.
    Bearer,
}

/// The sandq MCP server. Cheap to clone (one per MCP session of the HTTP transport).
#[derive(Clone)]
pub struct Sandq {
    transport: Arc<dyn Transport>,
    keys: KeySource,
    fetch: reqwest::Client,
    limits: Limits,
    tool_router: ToolRouter<Self>,
}

/// A program's language.
#[derive(Debug, Clone, Copy, Default, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Language {
    /// Python 3.11+ in a notebook cell (IPython): the last expression is shown, charts are
    /// captured; pandas, numpy, scipy, matplotlib, seaborn, plotly, scikit-learn and more are
    /// installed.
    #[default]
    Python,
    /// Node.js 20+ (the last expression's value is shown).
    Javascript,
}

/// A sandbox size.
#[derive(Debug, Clone, Copy, Deserialize, JsonSchema)]
pub enum SkuArg {
    /// 1 core, 2 GB.
    S,
    /// 2 cores, 4 GB.
    M,
    /// 4 cores, 8 GB.
    L,
    /// 8 cores, 16 GB.
    XL,
}

/// `run_code`'s arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunCodeArgs {
    /// The program to run, like one notebook cell.
    pub code: String,
    /// `python` (default) or `javascript`.
    #[serde(default)]
    pub language: Language,
    /// A session (from `create_session`) to run in: its files under /work and, for Python, its
    /// variables carry over from earlier runs. Without one, every run starts empty.
    #[serde(default)]
    pub session: Option<String>,
    /// Sandbox size: S (1 core, 2 GB, default), M (2, 4 GB), L (4, 8 GB), XL (8, 16 GB).
    #[serde(default)]
    pub sku: Option<SkuArg>,
    /// Wall-clock limit in seconds (default 60).
    #[serde(default)]
    pub timeout: Option<u64>,
    /// Allow outbound network access (default false: no network at all).
    #[serde(default)]
    pub network: Option<bool>,
}

/// `create_session`'s arguments.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSessionArgs {
    /// A name (1 to 40 of letters, digits, `_`, `.`, `-`); default a new random one.
    #[serde(default)]
    pub name: Option<String>,
}

/// Arguments naming a session.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionArgs {
    /// The session's name.
    pub session: String,
}

/// How `upload_file`'s content is written.
#[derive(Debug, Clone, Copy, Default, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// UTF-8 text, written as is (default).
    #[default]
    Text,
    /// Base64 of the bytes (for binary files: images, spreadsheets).
    Base64,
}

/// `upload_file`'s arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UploadFileArgs {
    /// The session to put the file in.
    pub session: String,
    /// Its path under /work (relative: `data/sales.csv`), where the session's code reads it.
    pub path: String,
    /// The file's content.
    pub content: String,
    /// `text` (default) or `base64`.
    #[serde(default)]
    pub encoding: Encoding,
}

/// `list_files`'s arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListFilesArgs {
    /// The session.
    pub session: String,
    /// Only files under this directory (relative to /work); default all.
    #[serde(default)]
    pub path: Option<String>,
}

/// `read_file`'s and `delete_file`'s arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadFileArgs {
    /// The session.
    pub session: String,
    /// The file's path under /work, as `list_files` gives it.
    pub path: String,
}

/// `get_job`'s arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JobArgs {
    /// The job's id, as `run_code` gave it.
    pub job_id: String,
}

impl Sandq {
    /// A server whose REST calls go through `transport` with keys from `keys`; `fetch` reads
    /// presigned URLs (redirects off).
    pub fn new(transport: Arc<dyn Transport>, keys: KeySource, fetch: reqwest::Client) -> Self {
        Sandq { transport, keys, fetch, limits: Limits::default(), tool_router: Self::tool_router() }
    }

    /// The REST client for a call, with its key.
    fn rest(&self, extensions: &Extensions) -> Result<HttpClient, ErrorData> {
        let key = match &self.keys {
            KeySource::Fixed(key) => key.clone(),
            KeySource::Bearer => extensions
                .get::<http::request::Parts>()
                .and_then(|parts| bearer(&parts.headers))
                .ok_or_else(|| ErrorData::invalid_request("no API key: send Authorization: Bearer <key>", None))?,
        };
        Ok(HttpClient::with_transport(self.transport.clone(), key, self.fetch.clone()))
    }
}

/// The API key of a request's headers: `Authorization: Bearer <key>`, else `X-Api-Key`.
pub fn bearer(headers: &http::HeaderMap) -> Option<String> {
    let auth = headers.get(http::header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    let bearer = auth.and_then(|v| {
        let (scheme, token) = v.split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then(|| token.trim().to_owned())
    });
    bearer.or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()).map(str::to_owned)).filter(|k| !k.is_empty())
}

/// Arguments a tool cannot take, as a tool error result: what rmcp does for arguments that do
/// not match the schema, and what MCP (2025-11-25, "Tool Execution Errors") asks of input
/// validation, so that the model reads why and corrects the call.
fn bad_arguments(why: String) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(format!("invalid arguments: {why}"))])
}

/// Sends progress while a job runs: one notification per stdout or stderr chunk (its last
/// line as the message) and per lifecycle event, `progress` counting them. Best effort: ends
/// with the job's `end` event, the stream's end or the first error.
async fn progress(rest: HttpClient, job_id: String, token: rmcp::model::ProgressToken, peer: rmcp::Peer<RoleServer>) {
    let Ok(events) = rest.raw_events(&job_id).await else { return };
    let mut events = std::pin::pin!(events);
    let mut n = 0.0;
    while let Some(Ok(event)) = events.next().await {
        let message = match event.kind.as_str() {
            "stdout" | "stderr" => {
                let text = event.data.get("text").and_then(Value::as_str).unwrap_or_default();
                let last = text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or_default();
                format!("{}: {}", event.kind, content::cut(last, 200).0)
            }
            "started" => {
                let warm = event.data.get("warm").and_then(Value::as_bool).unwrap_or(false);
                format!("started job {job_id} ({})", if warm { "warm" } else { "cold" })
            }
            "display" => "displayed an output".to_owned(),
            "end" => break,
            _ => continue,
        };
        n += 1.0;
        if peer.notify_progress(ProgressNotificationParam::new(token.clone(), n).with_message(message)).await.is_err() {
            break;
        }
    }
}

/// Milliseconds since the Unix epoch.
fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// An ISO 8601 (RFC 3339, UTC, milliseconds) time of `ms` since the Unix epoch, as MCP task
/// times are written.
fn rfc3339(ms: u64) -> String {
    humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

/// A job as an MCP task (SEP-2663): queued or running is `working` (the status its message),
/// `cancelled` is `cancelled`, any other end is `completed` with `run_code`'s result (an
/// `isError` one for a failed program, as the extension counts tool errors). Times are the
/// job's: created when queued, updated at its last change.
async fn job_task(rest: &HttpClient, result: &JobResult, limits: &Limits) -> DetailedTask {
    let created = result.queued_at_ms.or(result.started_at_ms).unwrap_or_else(now_ms);
    let updated = result.finished_at_ms.or(result.started_at_ms).unwrap_or(created);
    let mut task = Task::new(result.job_id.clone(), rmcp::model::TaskStatus::Working, rfc3339(created), rfc3339(updated))
        .with_ttl_ms(TASK_RESULT_TTL.as_millis() as u64)
        .with_poll_interval_ms(TASK_POLL_INTERVAL.as_millis() as u64);
    let payload = match result.status {
        JobStatus::Queued | JobStatus::Running => {
            task = task.with_status_message(result.status.to_string());
            TaskPayload::Working
        }
        JobStatus::Cancelled => {
            task = task.with_status_message("the job was cancelled");
            TaskPayload::Cancelled
        }
        _ => {
            let call = content::job_result(rest, result, limits).await;
            let result = match serde_json::to_value(call) {
                Ok(Value::Object(map)) => map,
                _ => serde_json::Map::new(),
            };
            TaskPayload::Completed { result }
        }
    };
    DetailedTask::new(task, payload)
}

#[tool_router]
impl Sandq {
    /// Runs a program in a fresh sandbox and returns what it printed and displayed.
    #[tool(
        description = "Run Python (a notebook cell: the last expression is shown, matplotlib/seaborn charts come back as images, DataFrames as markdown tables) or JavaScript (Node.js) in an isolated sandbox, and return stdout, stderr, rich outputs, the files the code wrote under /work (as links) and any error with its traceback. Preinstalled Python packages: pandas, numpy, scipy, statsmodels, matplotlib, seaborn, plotly, scikit-learn, xgboost, requests, beautifulsoup4, httpx, openpyxl, python-docx, pypdf, Pillow. Pass `session` (from create_session) to keep variables and files between calls; files uploaded with upload_file are under /work. No network unless `network` is true."
    )]
    async fn run_code(
        &self,
        Parameters(args): Parameters<RunCodeArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        if args.code.len() > MAX_CODE_BYTES {
            return Ok(bad_arguments(format!("code is {} bytes; at most {MAX_CODE_BYTES}", args.code.len())).into());
        }
        let rest = self.rest(&context.extensions)?;
        let timeout = args.timeout.unwrap_or(DEFAULT_TIMEOUT_S);
        // A client that declared MCP Tasks (SEP-2663) gets the job as a task at once: the task
        // id is the job id, tasks/get reads the job, tasks/cancel cancels it.
        let as_task = context.client_capabilities().is_some_and(|c| c.supports_tasks());
        let mut job = json!({
            "job_id": uuid::Uuid::new_v4().to_string(),
            "runtime": match args.language { Language::Python => "python", Language::Javascript => "node" },
            "code": args.code,
            "mode": "notebook",
            "timeout": format!("{timeout}s"),
            "network": if args.network.unwrap_or(false) { "outbound" } else { "none" },
        });
        if let Some(sku) = args.sku {
            job["sku"] = json!(format!("{sku:?}"));
        }
        if let Some(session) = &args.session {
            job["session"] = json!(session);
        }
        if as_task {
            job["result_ttl"] = json!(format!("{}s", TASK_RESULT_TTL.as_secs()));
        }
        let submitted = match rest.submit_json(&job).await {
            Ok(r) => r,
            Err(e) => return refused(e).map(Into::into),
        };
        let job_id = submitted.job_id;
        if as_task {
            let now = rfc3339(now_ms());
            let task = Task::new(job_id, rmcp::model::TaskStatus::Working, now.clone(), now)
                .with_status_message("queued")
                .with_ttl_ms(TASK_RESULT_TTL.as_millis() as u64)
                .with_poll_interval_ms(TASK_POLL_INTERVAL.as_millis() as u64);
            return Ok(CallToolResponse::Task(CreateTaskResult::new(task)));
        }
        let watcher = context
            .meta
            .get_progress_token()
            .map(|token| tokio::spawn(progress(rest.clone(), job_id.clone(), token, context.peer.clone())));
        let deadline = Instant::now() + Duration::from_secs(timeout) + QUEUE_ALLOWANCE;
        let outcome = loop {
            let wait = deadline.saturating_duration_since(Instant::now()).min(Duration::from_secs(30));
            tokio::select! {
                read = rest.job(&job_id, Some(wait)) => match read {
                    Ok(result) if result.status.is_terminal() || Instant::now() >= deadline => break Ok(result),
                    Ok(_) => continue,
                    Err(e) => break Err(e),
                },
                _ = context.ct.cancelled() => {
                    // The client gave up on the call: the job is cancelled too.
                    let _ = rest.cancel(&job_id).await;
                    break rest.job(&job_id, Some(Duration::from_secs(5))).await;
                }
            }
        };
        if let Some(watcher) = watcher {
            watcher.abort();
        }
        match outcome {
            Ok(result) => Ok(content::job_result(&rest, &result, &self.limits).await.into()),
            Err(e) => refused(e).map(Into::into),
        }
    }

    /// Creates a session.
    #[tool(
        description = "Create a session: a workspace whose files (under /work) and Python variables persist between run_code calls that name it, until it is deleted or expires after a period of disuse. Returns its name."
    )]
    async fn create_session(
        &self,
        Parameters(args): Parameters<CreateSessionArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let rest = self.rest(&context.extensions)?;
        match rest.create_session(args.name.as_deref()).await {
            Ok(name) => Ok(CallToolResult::success(vec![ContentBlock::text(format!("session: {name}"))])),
            Err(e) => refused(e),
        }
    }

    /// Deletes a session.
    #[tool(description = "Delete a session with all its files and variables.")]
    async fn delete_session(
        &self,
        Parameters(args): Parameters<SessionArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let rest = self.rest(&context.extensions)?;
        match rest.delete_session(&args.session).await {
            Ok(()) => Ok(CallToolResult::success(vec![ContentBlock::text(format!("deleted session {}", args.session))])),
            Err(e) => refused(e),
        }
    }

    /// Writes a file into a session.
    #[tool(
        description = "Put a file into a session's /work directory (for example a CSV the user gave you), so that run_code in that session can read it at /work/<path>. Content is text, or base64 with encoding=base64 for binary files. At most 5 MB."
    )]
    async fn upload_file(
        &self,
        Parameters(args): Parameters<UploadFileArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let bytes = match args.encoding {
            Encoding::Text => args.content.into_bytes(),
            Encoding::Base64 => match base64::engine::general_purpose::STANDARD.decode(args.content.trim()) {
                Ok(bytes) => bytes,
                Err(e) => return Ok(bad_arguments(format!("content is not base64: {e}"))),
            },
        };
        // The path rule the gateway and the worker share: a refusal the model reads and
        // corrects, before any bytes are sent.
        if let Err(e) = sandq_schemas::paths::check_session_path(&args.path) {
            return Ok(bad_arguments(format!(
                "path {:?} cannot be a file under /work: {e} (relative, '/'-separated, each component 1 to 255 bytes and not '.' or '..', no backslash)",
                sandq_schemas::paths::clipped(&args.path)
            )));
        }
        if bytes.len() > MAX_UPLOAD_BYTES {
            return Ok(bad_arguments(format!("content is {} bytes; at most {MAX_UPLOAD_BYTES} here", bytes.len())));
        }
        let rest = self.rest(&context.extensions)?;
        let size = bytes.len();
        match rest.write_file(&args.session, &args.path, bytes).await {
            Ok(()) => Ok(CallToolResult::success(vec![ContentBlock::text(format!(
                "wrote /work/{} ({size} bytes) in session {}",
                args.path, args.session
            ))])),
            Err(e) => refused(e),
        }
    }

    /// Deletes one file of a session.
    #[tool(
        description = "Delete one file from a session's /work directory, by its path as list_files gives it (for example one a run_code call says cannot be restored)."
    )]
    async fn delete_file(
        &self,
        Parameters(args): Parameters<ReadFileArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let rest = self.rest(&context.extensions)?;
        match rest.delete_file(&args.session, &args.path).await {
            Ok(()) => {
                Ok(CallToolResult::success(vec![ContentBlock::text(format!("deleted /work/{} from session {}", args.path, args.session))]))
            }
            Err(e) => refused(e),
        }
    }

    /// Lists a session's files.
    #[tool(
        description = "List the files in a session's /work directory (path and size in bytes), optionally only under a subdirectory. At most 200 are listed; the answer says when there are more."
    )]
    async fn list_files(
        &self,
        Parameters(args): Parameters<ListFilesArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let rest = self.rest(&context.extensions)?;
        let (files, cut_by_gateway) = match rest.session_files(&args.session).await {
            Ok(f) => f,
            Err(e) => return refused(e),
        };
        let prefix = args.path.as_deref().map(|p| p.trim_matches('/')).filter(|p| !p.is_empty() && *p != ".");
        let wanted: Vec<_> =
            files.iter().filter(|f| prefix.is_none_or(|p| f.path.strip_prefix(p).is_some_and(|rest| rest.starts_with('/')))).collect();
        let mut text = String::new();
        for f in wanted.iter().take(MAX_LISTED) {
            text.push_str(&format!("{}\t{}\n", f.path, f.size));
        }
        if wanted.is_empty() {
            text.push_str("(no files)\n");
        }
        if wanted.len() > MAX_LISTED || cut_by_gateway {
            text.push_str(&format!(
                "[list truncated: {} shown of {}{}]\n",
                wanted.len().min(MAX_LISTED),
                wanted.len(),
                if cut_by_gateway { " or more" } else { "" }
            ));
        }
        Ok(CallToolResult::success(vec![ContentBlock::text(text)]))
    }

    /// Reads a session's file.
    #[tool(
        description = "Read a file from a session's /work directory: text files come back as text (long ones cut, with a note), images as images, other binary files as a short description."
    )]
    async fn read_file(
        &self,
        Parameters(args): Parameters<ReadFileArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let rest = self.rest(&context.extensions)?;
        let bytes = match rest.read_file(&args.session, &args.path, MAX_READ_BYTES).await {
            Ok(b) => b,
            Err(e) => return refused(e),
        };
        Ok(CallToolResult::success(file_content(&args.session, &args.path, &bytes, &self.limits)))
    }

    /// Reads a job.
    #[tool(
        description = "Get a job's result by its job_id (as run_code gave it): its status, and once it is over, its output as run_code returns it."
    )]
    async fn get_job(
        &self,
        Parameters(args): Parameters<JobArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let rest = self.rest(&context.extensions)?;
        match rest.job(&args.job_id, None).await {
            Ok(result) => Ok(content::job_result(&rest, &result, &self.limits).await),
            Err(e) => refused(e),
        }
    }

    /// Cancels a job.
    #[tool(description = "Cancel a queued or running job by its job_id: a running program is killed within about a second.")]
    async fn cancel_job(
        &self,
        Parameters(args): Parameters<JobArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let rest = self.rest(&context.extensions)?;
        match rest.cancel_existing(&args.job_id).await {
            Ok(true) => Ok(CallToolResult::success(vec![ContentBlock::text(format!("cancelling job {}", args.job_id))])),
            Ok(false) => Ok(CallToolResult::success(vec![ContentBlock::text(format!("job {} was already over", args.job_id))])),
            Err(e) => refused(e),
        }
    }
}

/// A file's bytes as content: an image (bounded), text (cut), or a description.
fn file_content(session: &str, path: &str, bytes: &[u8], limits: &Limits) -> Vec<ContentBlock> {
    if let Ok(text) = std::str::from_utf8(bytes) {
        let (shown, was_cut) = content::cut(text, limits.text_chars);
        let mut out = shown.to_owned();
        if was_cut {
            out.push_str(&format!(
                "\n[cut here: {} bytes in all; the whole file is the resource {}]",
                bytes.len(),
                content::file_uri(session, path)
            ));
        }
        return vec![ContentBlock::text(out)];
    }
    let kind = imagesize::image_type(bytes).ok();
    let mime = match kind {
        Some(imagesize::ImageType::Png) => Some("image/png"),
        Some(imagesize::ImageType::Jpeg) => Some("image/jpeg"),
        Some(imagesize::ImageType::Gif) => Some("image/gif"),
        Some(imagesize::ImageType::Webp) => Some("image/webp"),
        _ => None,
    };
    let fits = imagesize::blob_size(bytes).is_ok_and(|s| (s.width as u64) * (s.height as u64) <= limits.image_pixels);
    match mime {
        Some(mime) if fits && bytes.len() <= limits.image_bytes => {
            vec![ContentBlock::image(base64::engine::general_purpose::STANDARD.encode(bytes), mime)]
        }
        _ => vec![
            ContentBlock::text(format!(
                "/work/{path}: {} bytes of binary data{}",
                bytes.len(),
                mime.map(|m| format!(" ({m}, too large to show)")).unwrap_or_default()
            )),
            ContentBlock::resource_link(Resource::new(content::file_uri(session, path), path.to_owned()).with_size(bytes.len() as u64)),
        ],
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Sandq {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().enable_resources().enable_tasks().build()).with_instructions(
            "sandq runs code in isolated sandboxes. Use run_code to execute Python or JavaScript; create a session first \
             when the work spans several steps (variables and files persist in it), upload the user's files into it with \
             upload_file, and read what the code wrote with list_files and read_file. Charts come back as images.",
        )
    }

    async fn get_task(&self, request: GetTaskParams, context: RequestContext<RoleServer>) -> Result<GetTaskResult, ErrorData> {
        let rest = self.rest(&context.extensions)?;
        let result = rest.job(&request.task_id, None).await.map_err(|e| no_task(&request.task_id, &e))?;
        Ok(GetTaskResult::new(job_task(&rest, &result, &self.limits).await))
    }

    async fn cancel_task(&self, request: CancelTaskParams, context: RequestContext<RoleServer>) -> Result<(), ErrorData> {
        let rest = self.rest(&context.extensions)?;
        // Cooperative, as the extension asks: a job already over stays as it ended.
        rest.cancel_existing(&request.task_id).await.map(|_| ()).map_err(|e| no_task(&request.task_id, &e))
    }

    async fn list_resources(
        &self,
        _request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, ErrorData> {
        let rest = self.rest(&context.extensions)?;
        let sessions = rest.sessions().await.map_err(|e| ErrorData::internal_error(with_causes(&e), None))?;
        let mut resources = Vec::new();
        'sessions: for session in sessions.into_iter().take(MAX_LISTED_SESSIONS) {
            let Ok((files, _)) = rest.session_files(&session.name).await else { continue };
            for f in files {
                if resources.len() >= MAX_RESOURCES {
                    break 'sessions;
                }
                resources.push(
                    Resource::new(content::file_uri(&session.name, &f.path), format!("{}:{}", session.name, f.path))
                        .with_description(format!("/work/{} in session {}", f.path, session.name))
                        .with_size(f.size),
                );
            }
        }
        Ok(ListResourcesResult::with_all_items(resources))
    }

    async fn list_resource_templates(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourceTemplatesResult, ErrorData> {
        Ok(ListResourceTemplatesResult::with_all_items(vec![
            ResourceTemplate::new("sandq://sessions/{session}/files/{path}", "session file")
                .with_description("A file under /work of a session"),
            ResourceTemplate::new("sandq://jobs/{job_id}/stdout", "job stdout")
                .with_description("Everything a job printed to stdout (up to 8 MiB)"),
            ResourceTemplate::new("sandq://jobs/{job_id}/stderr", "job stderr")
                .with_description("Everything a job printed to stderr (up to 8 MiB)"),
        ]))
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        let rest = self.rest(&context.extensions)?;
        let uri = request.uri.as_str();
        let not_found = |e: HttpError| {
            if e.is_not_found() || e.is_bad_request() {
                ErrorData::resource_not_found(format!("{uri}: {e}"), None)
            } else {
                ErrorData::internal_error(with_causes(&e), None)
            }
        };
        let rest_of =
            uri.strip_prefix("sandq://").ok_or_else(|| ErrorData::resource_not_found(format!("{uri}: not a sandq:// URI"), None))?;
        let bytes = if let Some(rest_of) = rest_of.strip_prefix("sessions/") {
            let (session, path) =
                rest_of.split_once("/files/").ok_or_else(|| ErrorData::resource_not_found(format!("{uri}: not a session file"), None))?;
            rest.read_file(session, path, MAX_READ_BYTES).await.map_err(not_found)?
        } else if let Some(rest_of) = rest_of.strip_prefix("jobs/") {
            let (job, what) =
                rest_of.split_once('/').ok_or_else(|| ErrorData::resource_not_found(format!("{uri}: not a job resource"), None))?;
            match what.split_once('/') {
                None if what == "stdout" || what == "stderr" => rest.log(job, what, MAX_READ_BYTES).await.map_err(not_found)?,
                Some(("artifacts", path)) => rest.artifact(job, path, MAX_READ_BYTES).await.map_err(not_found)?,
                Some(("outputs", name)) => rest.output(job, name, MAX_READ_BYTES).await.map_err(not_found)?,
                _ => return Err(ErrorData::resource_not_found(format!("{uri}: not a job resource"), None)),
            }
        } else {
            return Err(ErrorData::resource_not_found(format!("{uri}: unknown"), None));
        };
        let contents = match String::from_utf8(bytes) {
            Ok(text) => ResourceContents::text(text, uri),
            Err(e) => ResourceContents::blob(base64::engine::general_purpose::STANDARD.encode(e.into_bytes()), uri),
        };
        Ok(ReadResourceResult::new(vec![contents]).into())
    }
}
