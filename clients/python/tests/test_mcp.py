"""sandq's MCP server (docs/mcp.md) driven by the official Python MCP SDK (`mcp`), over both
transports (streamable HTTP at the gateway's /mcp, and stdio through `sandq mcp`), against the
real gateway, worker and services: tools listed with valid schemas, a CSV uploaded and summed
by pandas into a markdown table, a chart as an image whose PNG decodes, files read back,
variables kept in a session, a long job cancelled, tracebacks, keys and tenants refused, and
malformed or oversized requests answered with JSON-RPC errors while the server stays up."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import random
import uuid
from collections import defaultdict
from typing import AsyncIterator

import httpx2
import jsonschema
import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from PIL import Image

from conftest import binary, new_key

TOOLS = {"run_code", "create_session", "delete_session", "upload_file", "list_files", "read_file", "get_job", "cancel_job"}


@contextlib.asynccontextmanager
async def http_session(url: str, key: str | None) -> AsyncIterator[ClientSession]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(120.0)) as http:
        async with streamable_http_client(f"{url}/mcp", http_client=http) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                yield session


@contextlib.asynccontextmanager
async def stdio_session(url: str, key: str) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(command=str(binary("sandq")), args=["mcp"],
                                   env={**os.environ, "SANDQ_URL": url, "SANDQ_API_KEY": key, "RUST_LOG": "warn"})
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            yield session


@pytest.fixture(params=["http", "stdio"])
def connect(request, gateway_url: str):
    """Opens an MCP session over the transport under test with a key of a new tenant."""
    tenant = f"mcp{uuid.uuid4().hex[:10]}"
    key = new_key(tenant)

    def opener(key_override: str | None = key):
        if request.param == "http":
            return http_session(gateway_url, key_override)
        return stdio_session(gateway_url, key_override or "")
    opener.key = key
    opener.transport = request.param
    return opener


def texts(result) -> str:
    return "\n".join(c.text for c in result.content if c.type == "text")


async def test_tools_are_listed_with_valid_schemas(connect):
    async with connect() as mcp:
        listed = await mcp.list_tools()
    names = {t.name for t in listed.tools}
    assert TOOLS <= names, names
    for tool in listed.tools:
        assert tool.description and len(tool.description) > 20, tool.name
        jsonschema.Draft202012Validator.check_schema(tool.input_schema)
        assert tool.input_schema.get("type") == "object"
    run_code = next(t for t in listed.tools if t.name == "run_code")
    assert run_code.input_schema["required"] == ["code"]
    assert {"code", "language", "session", "sku", "timeout", "network"} <= set(run_code.input_schema["properties"])


async def test_a_csv_uploaded_to_a_session_is_summed_by_pandas_into_a_table_and_charted(connect):
    rng = random.Random(7)
    rows = [(rng.choice(["east", "west", "north"]), rng.randint(1, 99)) for _ in range(5000)]
    expected = defaultdict(int)
    for region, qty in rows:
        expected[region] += qty
    csv = "region,qty\n" + "".join(f"{r},{q}\n" for r, q in rows)
    async with connect() as mcp:
        created = await mcp.call_tool("create_session", {})
        session = texts(created).split("session: ")[1].strip()
        up = await mcp.call_tool("upload_file", {"session": session, "path": "data/sales.csv", "content": csv})
        assert not up.is_error, texts(up)
        code = ("import pandas as pd, matplotlib.pyplot as plt\n"
                "df = pd.read_csv('data/sales.csv')\n"
                "totals = df.groupby('region').qty.sum()\n"
                "fig, ax = plt.subplots(figsize=(4, 3), dpi=100)\n"
                "totals.plot.bar(ax=ax)\n"
                "plt.show()\n"
                "totals.to_frame()\n")
        result = await mcp.call_tool("run_code", {"code": code, "session": session})
        await mcp.call_tool("delete_session", {"session": session})
    assert not result.is_error, texts(result)
    text = texts(result)
    assert "succeeded" in text
    # The markdown table pandas wrote: one row per region with its sum (computed above).
    table = next(c.text for c in result.content if c.type == "text" and "| region" in c.text)
    assert "3 rows x 1 columns" in table
    for region, total in expected.items():
        line = next(l for l in table.splitlines() if l.startswith(f"| {region}"))
        assert line.split("|")[2].strip() == str(total), (line, total)
    images = [c for c in result.content if c.type == "image"]
    assert len(images) == 1
    assert images[0].mime_type == "image/png"
    picture = Image.open(io.BytesIO(base64.b64decode(images[0].data)))
    picture.load()  # decodes every pixel
    assert picture.size == (400, 300)


async def test_a_file_the_code_wrote_is_listed_and_read_back_and_is_a_resource(connect):
    payload = "\n".join(f"line {i} {i * i}" for i in range(100)) + "\n"
    async with connect() as mcp:
        session = texts(await mcp.call_tool("create_session", {})).split("session: ")[1].strip()
        code = f"import os\nos.makedirs('out', exist_ok=True)\nopen('out/report.txt', 'w').write({payload!r})\nprint('wrote')"
        ran = await mcp.call_tool("run_code", {"code": code, "session": session})
        assert not ran.is_error, texts(ran)
        links = [c for c in ran.content if c.type == "resource_link"]
        assert any(str(l.name) == "out/report.txt" and l.size == len(payload) for l in links), links
        listed = texts(await mcp.call_tool("list_files", {"session": session, "path": "out"}))
        assert f"out/report.txt\t{len(payload)}" in listed
        read = await mcp.call_tool("read_file", {"session": session, "path": "out/report.txt"})
        assert texts(read) == payload
        resources = await mcp.list_resources()
        uri = f"sandq://sessions/{session}/files/out/report.txt"
        assert uri in {str(r.uri) for r in resources.resources}
        contents = await mcp.read_resource(uri)
        assert contents.contents[0].text == payload
        await mcp.call_tool("delete_session", {"session": session})


async def test_a_variable_is_kept_between_two_runs_of_a_session(connect):
    async with connect() as mcp:
        session = texts(await mcp.call_tool("create_session", {"name": f"s{uuid.uuid4().hex[:8]}"})).split("session: ")[1].strip()
        first = await mcp.call_tool("run_code", {"code": "rate = 0.5\ndef scaled(x):\n    return x * rate\n", "session": session})
        assert not first.is_error, texts(first)
        second = await mcp.call_tool("run_code", {"code": "rate = 3\nprint(scaled(14))", "session": session})
        await mcp.call_tool("delete_session", {"session": session})
    assert not second.is_error, texts(second)
    assert "stdout:\n42\n" in texts(second)


async def test_a_long_job_reports_progress_and_is_cancelled(connect):
    seen: list[str] = []
    started = asyncio.Event()

    async def on_progress(progress, total, message):
        seen.append(message or "")
        if message and message.startswith("started job "):
            started.set()

    code = "import time\nfor i in range(600):\n    print('tick', i, flush=True)\n    time.sleep(0.1)\n"
    async with connect() as mcp, connect() as other:
        call = asyncio.create_task(mcp.call_tool("run_code", {"code": code, "timeout": 120}, progress_callback=on_progress))
        await asyncio.wait_for(started.wait(), 60)
        # A few lines of output arrive as progress while the job runs.
        for _ in range(100):
            if any(m.startswith("stdout: tick") for m in seen):
                break
            await asyncio.sleep(0.1)
        job_id = next(m for m in seen if m.startswith("started job ")).split()[2]
        cancelled = await other.call_tool("cancel_job", {"job_id": job_id})
        assert not cancelled.is_error, texts(cancelled)
        result = await asyncio.wait_for(call, 60)
    assert any(m.startswith("stdout: tick") for m in seen), seen
    assert result.is_error
    assert f"job {job_id}: cancelled" in texts(result)


async def test_an_exception_is_an_error_result_with_its_traceback(connect):
    async with connect() as mcp:
        result = await mcp.call_tool("run_code", {"code": "def divide(a, b):\n    return a / b\n\ndivide(1, 0)\n"})
    assert result.is_error
    text = texts(result)
    assert "error: ZeroDivisionError: division by zero" in text
    assert "line 2, in divide" in text


async def test_another_tenants_session_and_job_are_not_found(connect):
    async with connect() as mcp:
        session = texts(await mcp.call_tool("create_session", {})).split("session: ")[1].strip()
        ran = await mcp.call_tool("run_code", {"code": "print('mine')", "session": session})
        job_id = texts(ran).split()[1].rstrip(":")
        stranger = new_key(f"mcp{uuid.uuid4().hex[:10]}")
        async with connect(stranger) as theirs:
            for name, args in [("list_files", {"session": session}), ("read_file", {"session": session, "path": "x"}),
                               ("get_job", {"job_id": job_id}), ("cancel_job", {"job_id": job_id})]:
                refused = await theirs.call_tool(name, args)
                assert refused.is_error, (name, texts(refused))
                assert "not-found" in texts(refused), texts(refused)
        await mcp.call_tool("delete_session", {"session": session})


def test_a_missing_or_wrong_key_is_refused_over_http(gateway_url):
    body = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
    headers = {"Accept": "application/json, text/event-stream"}
    for auth in [None, "Bearer sq_nope_nope", "Bearer " + "x" * 50]:
        h = dict(headers, **({"Authorization": auth} if auth else {}))
        response = httpx2.post(f"{gateway_url}/mcp", json=body, headers=h)
        assert response.status_code == 401, (auth, response.status_code, response.text)
        assert response.headers.get("www-authenticate") == "Bearer"


def test_malformed_unknown_and_oversized_requests_get_json_rpc_errors_and_the_server_stays_up(gateway_url):
    key = new_key(f"mcp{uuid.uuid4().hex[:10]}")
    headers = {"Authorization": f"Bearer {key}", "Accept": "application/json, text/event-stream",
               "Content-Type": "application/json", "MCP-Protocol-Version": "2025-06-18"}
    post = lambda body: httpx2.post(f"{gateway_url}/mcp", content=body if isinstance(body, bytes) else json.dumps(body).encode(),
                                    headers=headers, timeout=60)

    def call(name, arguments, id_=2):
        return {"jsonrpc": "2.0", "id": id_, "method": "tools/call", "params": {"name": name, "arguments": arguments}}

    def error_of(response):
        """The JSON-RPC error of an answer (plain JSON or one SSE event), None if it has none."""
        assert response.status_code in (200, 400), (response.status_code, response.text)
        text = response.text
        if text.startswith("data:") or "\ndata:" in text:
            text = next(l[5:] for l in text.splitlines() if l.startswith("data:"))
        return json.loads(text).get("error")

    def refused_arguments(response):
        """Arguments a tool cannot take: a tool error result naming them (MCP's rule for input
        validation, so the model can correct the call); a JSON-RPC error is accepted too."""
        error = error_of(response)
        if error is not None:
            return error["message"]
        text = response.text if response.text.startswith("{") else next(l[5:] for l in response.text.splitlines() if l.startswith("data:"))
        result = json.loads(text)["result"]
        assert result["isError"] is True, result
        return result["content"][0]["text"]

    assert error_of(post(b"{not json"))["code"] == -32700
    assert error_of(post(call("no_such_tool", {}))) is not None
    assert "expected a string" in refused_arguments(post(call("run_code", {"code": 42})))
    assert "surprise" in refused_arguments(post(call("run_code", {"code": "print(1)", "surprise": True})))
    assert "invalid type" in refused_arguments(post(call("get_job", {"job_id": ["not", "a", "string"]})))
    # An argument past the tool's limit (code over 1 MiB) is refused before anything runs.
    assert "at most" in refused_arguments(post(call("run_code", {"code": "#" * ((1 << 20) + 1)})))
    # A body past the gateway's limit is refused outright.
    assert post(b"[" + b" " * (3 << 20) + b"]").status_code == 413
    # Still up: a good call works.
    good = post(call("run_code", {"code": "print(6 * 7)"}, id_=9))
    assert good.status_code == 200
    text = good.text if good.text.startswith("{") else next(l[5:] for l in good.text.splitlines() if l.startswith("data:"))
    result = json.loads(text)["result"]
    assert "stdout:\n42\n" in "\n".join(c.get("text", "") for c in result["content"])


# MCP Tasks (SEP-2663, the `io.modelcontextprotocol/tasks` extension of the 2026-07-28 protocol):
# a client that declares it gets run_code as a task whose id is the job id. The official SDK
# carries no tasks client; this is one on its extension API (a result claim for
# `resultType: "task"` and the extension's `tasks/get` and `tasks/cancel` requests).
from typing import Any, Literal

import mcp_types
from mcp import Client
from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim
from mcp.shared.exceptions import MCPError

TASKS = "io.modelcontextprotocol/tasks"


class TaskHandle(mcp_types.Result):
    result_type: Literal["task"]
    task_id: str
    status: str
    status_message: str | None = None
    created_at: str
    last_updated_at: str
    ttl_ms: int | None = None
    poll_interval_ms: int | None = None


class TaskIdParams(mcp_types.RequestParams):
    task_id: str


class GetTask(mcp_types.Request[TaskIdParams, Literal["tasks/get"]]):
    method: Literal["tasks/get"] = "tasks/get"
    name_param = "taskId"


class CancelTask(mcp_types.Request[TaskIdParams, Literal["tasks/cancel"]]):
    method: Literal["tasks/cancel"] = "tasks/cancel"
    name_param = "taskId"


class TaskState(mcp_types.Result):
    result_type: str | None = None
    task_id: str
    status: str
    status_message: str | None = None
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


class AnyResult(mcp_types.Result):
    result_type: str | None = None


class Tasks(ClientExtension):
    """Resolves a task by polling tasks/get at the server's interval; `cancel_after` polls in
    working state, it sends tasks/cancel first. Records every handle and state it saw."""
    identifier = TASKS

    def __init__(self, cancel_after: int | None = None):
        self.cancel_after = cancel_after
        self.handles: list[TaskHandle] = []
        self.states: list[TaskState] = []

    def claims(self):
        return [ResultClaim(result_type="task", model=TaskHandle, resolve=self.resolve)]

    async def resolve(self, handle: TaskHandle, ctx: ClaimContext) -> mcp_types.CallToolResult:
        self.handles.append(handle)
        working = 0
        for _ in range(1200):
            state = await ctx.session.send_request(GetTask(params=TaskIdParams(task_id=handle.task_id)), TaskState)
            self.states.append(state)
            if state.status in ("completed", "failed", "cancelled"):
                break
            working += 1
            if self.cancel_after is not None and working == self.cancel_after:
                await ctx.session.send_request(CancelTask(params=TaskIdParams(task_id=handle.task_id)), AnyResult)
            await asyncio.sleep((handle.poll_interval_ms or 500) / 1000)
        if state.status == "completed":
            return mcp_types.CallToolResult.model_validate(state.result)
        return mcp_types.CallToolResult(content=[mcp_types.TextContent(type="text", text=f"task {state.status}")], is_error=True)


@contextlib.asynccontextmanager
async def task_client(transport: str, url: str, key: str, tasks: Tasks) -> AsyncIterator[Client]:
    if transport == "http":
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=httpx2.Timeout(120.0)) as http:
            async with Client(streamable_http_client(f"{url}/mcp", http_client=http), extensions=[tasks]) as client:
                yield client
    else:
        params = StdioServerParameters(command=str(binary("sandq")), args=["mcp"],
                                       env={**os.environ, "SANDQ_URL": url, "SANDQ_API_KEY": key, "RUST_LOG": "warn"})
        async with Client(params, extensions=[tasks]) as client:
            yield client


async def test_a_client_declaring_tasks_gets_run_code_as_a_task_named_by_its_job_id(connect, gateway_url):
    tasks = Tasks()
    code = "import time\nprint('working', flush=True)\ntime.sleep(2)\n6 * 7\n"
    async with task_client(connect.transport, gateway_url, connect.key, tasks) as client:
        assert client.session.protocol_version == "2026-07-28"
        result = await client.call_tool("run_code", {"code": code})
        [handle] = tasks.handles
        # The task id is the job's: get_job (no tasks involved) reads the same job.
        job = await client.call_tool("get_job", {"job_id": handle.task_id})
    assert not result.is_error, texts(result)
    assert "stdout:\nworking\n" in texts(result)
    assert "42" in texts(result)
    assert f"job {handle.task_id}: succeeded" in texts(job)
    assert handle.status == "working" and handle.ttl_ms == 3_600_000 and handle.poll_interval_ms == 500
    # Polled while the job ran (2 s at most every 0.5 s), then completed once.
    statuses = [s.status for s in tasks.states]
    assert statuses.count("working") >= 2, statuses
    assert statuses[-1] == "completed" and statuses.count("completed") == 1, statuses
    assert {s.status_message for s in tasks.states if s.status == "working"} <= {"queued", "running"}


async def test_a_task_is_cancelled_with_its_job_and_an_unknown_or_strangers_task_is_an_error(connect, gateway_url):
    tasks = Tasks(cancel_after=2)
    code = "import time\nfor i in range(600):\n    print('tick', i, flush=True)\n    time.sleep(0.1)\n"
    async with task_client(connect.transport, gateway_url, connect.key, tasks) as client:
        result = await client.call_tool("run_code", {"code": code, "timeout": 120})
        [handle] = tasks.handles
        job = await client.call_tool("get_job", {"job_id": handle.task_id})
        with pytest.raises(MCPError):
            await client.session.send_request(GetTask(params=TaskIdParams(task_id=str(uuid.uuid4()))), TaskState)
    assert result.is_error and texts(result) == "task cancelled"
    assert tasks.states[-1].status == "cancelled"
    assert f"job {handle.task_id}: cancelled" in texts(job)
    # Another tenant cannot read or cancel the task.
    stranger = new_key(f"mcp{uuid.uuid4().hex[:10]}")
    async with task_client(connect.transport, gateway_url, stranger, Tasks()) as theirs:
        for request in (GetTask(params=TaskIdParams(task_id=handle.task_id)), CancelTask(params=TaskIdParams(task_id=handle.task_id))):
            with pytest.raises(MCPError) as refused:
                await theirs.session.send_request(request, TaskState if isinstance(request, GetTask) else AnyResult)
            assert "no task" in str(refused.value), refused.value
