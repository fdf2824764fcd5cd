"""sandq: run code in sandq's sandboxes from Python (docs/protocol.md).

    import sandq
    with sandq.Client() as client:              # $SANDQ_CONFIG, else /etc/sandq/sandq.toml
        data = client.upload("data.csv")
        result = client.run("import pandas as pd\\npd.read_csv('data.csv').describe()", inputs=[data])
        print(result.stdout.text, result.outputs[0].text)
        # Output as it happens (docs/protocol.md "Live events"), then the stored result:
        result = client.run("for i in range(3): print(i)", on_stdout=lambda text: print(text, end=""))
        for event in client.events(result.job_id):  # the events themselves (sandq.Event)
            print(event.type, event.data)

`sandq.aio.AsyncClient` is the asyncio twin.

Through sandq-gateway over HTTP (docs/gateway.md), the same API with an API key instead of the
services' credentials (a `sandq.HttpClient`; `sandq.gateway` says which mode is taken when):

    with sandq.Client(url="https://sandq.example.com", api_key="sq_...") as client:  # or $SANDQ_URL, $SANDQ_API_KEY
        print(client.run("print(6 * 7)", sku="S").stdout.text)

Each client is a facade over a transport (`sandq.transport`): direct (`_direct`, `_aio_direct`)
or through the gateway (`_gateway`, `_aio_gateway`), imported when a client of that mode is made.
"""
from .client import Client, HttpClient, Session
from .events import Callbacks, Transcript
from .errors import (Conflict, ForbiddenByQuota, GatewayError, InvalidRequest, JobCancelled, JobError, JobExpired, JobFailed,
                     JobInternalError, JobNotFound, JobOOMKilled, JobRejected, JobTimedOut, NotFound, Problem, QuotaExceeded,
                     SandqError, SubmitError, Unauthorized, Unavailable, UnservedSku, UnservedSkuWarning, WaitTimeout)
from .protocol import Config, load_config
from .types import (TERMINAL, Artifact, ErrorInfo, Event, ImageInfo, InputFile, JobResult, MimeValue, Output, SandboxInfo,
                    SessionInfo, SessionState, SkippedArtifact, Stream, TableInfo, Usage)


def __getattr__(name: str):
    # The asyncio client on first use (it imports asyncio).
    if name in ("AsyncClient", "AsyncSession", "AsyncHttpClient"):
        from . import aio
        return getattr(aio, name)
    raise AttributeError(name)


__all__ = [
    "Client", "Session", "AsyncClient", "AsyncSession", "HttpClient", "AsyncHttpClient", "Config", "load_config", "TERMINAL",
    "Artifact", "ErrorInfo", "Event", "Transcript", "Callbacks", "ImageInfo", "InputFile", "JobResult", "MimeValue", "Output", "SandboxInfo", "SessionInfo",
    "SessionState", "SkippedArtifact", "Stream", "TableInfo", "Usage",
    "SandqError", "SubmitError", "WaitTimeout", "JobNotFound", "JobError", "JobFailed", "JobTimedOut", "JobOOMKilled",
    "JobRejected", "JobCancelled", "JobExpired", "JobInternalError", "Problem", "GatewayError", "Unauthorized",
    "ForbiddenByQuota", "QuotaExceeded", "InvalidRequest", "NotFound", "Conflict", "Unavailable", "UnservedSku",
    "UnservedSkuWarning",
]
