"""Live events (docs/protocol.md "Live events") against the config's real Redis, no worker: each
test writes a job's stream itself (XADD, with the vectors' ids where it replays
schemas/vectors/events.json) and the job hash's `status`, then reads it back with the SDK
(`events`, `follow`, `Transcript`). Expected values come from the vectors file or from what the
test wrote."""
from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from pathlib import Path

import pytest

import sandq
from sandq import Event, Transcript
from sandq.aio import AsyncClient

VECTORS = Path(__file__).resolve().parents[3] / "schemas" / "vectors" / "events.json"
CASES = json.loads(VECTORS.read_text())["cases"]
NAMESPACE = "sandq-test-sdk-python-events"


@pytest.fixture
def events_config(config: sandq.Config) -> sandq.Config:
    return config.with_namespace(NAMESPACE)


@pytest.fixture
def client(events_config: sandq.Config):
    with sandq.Client(events_config) as c:
        yield c


@pytest.fixture
def job(client: sandq.Client):
    """A fresh job id; its hash and stream are deleted after the test."""
    job_id = f"events-{uuid.uuid4()}"
    yield job_id
    client.redis.delete(client.names.job(job_id), client.names.events(job_id))


def write(client: sandq.Client, job_id: str, entries: list[dict], status: str) -> None:
    """The job's hash `status` and its stream's entries (with their ids when they have one)."""
    client.redis.hset(client.names.job(job_id), "status", status)
    for entry in entries:
        client.redis.xadd(client.names.events(job_id), entry["fields"], id=entry.get("id", "*"))
    # Gone within the hour even when the tests stop before their end.
    client.redis.expire(client.names.job(job_id), 3600)
    client.redis.expire(client.names.events(job_id), 3600)


def reading(transcript: Transcript) -> dict:
    """A transcript in the vectors' `expect` shape."""
    def image_key(output):
        png = output.data.get("image/png") if output else None
        return png.artifact.key if png and png.artifact else None

    return {
        "attempts": transcript.attempts, "final_attempt": transcript.attempt,
        "stdout": transcript.stdout, "stderr": transcript.stderr,
        "displays": [{"index": i, "output_type": o.output_type if o else None, "image_key": image_key(o)}
                     for i, o in transcript.displays],
        "missing": [{"attempt": a, "seq": s} for a, s in transcript.missing],
        "truncated": transcript.truncated, "status": transcript.status, "last_id": transcript.last_id,
    }


def fold(events) -> Transcript:
    transcript = Transcript()
    for event in events:
        transcript.push(event)
    return transcript


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_vectors(client: sandq.Client, job: str, case: dict) -> None:
    write(client, job, case["entries"], case["expect"]["status"])
    events = list(client.events(job, block=0.5))
    assert [e.id for e in events] == [e["id"] for e in case["entries"]], "every entry, in order, up to the end"
    for event, entry in zip(events, case["entries"]):
        assert event.fields == entry["fields"] and event.type == entry["fields"]["type"]
        assert event.attempt == int(entry["fields"]["attempt"])
        assert event.seq == (int(entry["fields"]["seq"]) if "seq" in entry["fields"] else None)
    assert reading(fold(events)) == case["expect"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_follow_calls_back_with_the_newest_attempt(client: sandq.Client, job: str, case: dict) -> None:
    """`follow` (what `run` does with callbacks): every event to on_event, the chunks and
    displays of the attempt under way to the others; after the last `attempt` event, they are
    the final attempt's, which the vectors give."""
    write(client, job, case["entries"], case["expect"]["status"])
    calls: list[tuple[str, object]] = []
    transcript = client.follow(job, block=0.5, on_event=lambda e: calls.append(("event", e)),
                               on_stdout=lambda t: calls.append(("stdout", t)),
                               on_stderr=lambda t: calls.append(("stderr", t)),
                               on_display=lambda o: calls.append(("display", o)))
    assert reading(transcript) == case["expect"]
    assert [e.id for kind, e in calls if kind == "event"] == [e["id"] for e in case["entries"]]
    last_attempt = max(i for i, (kind, e) in enumerate(calls) if kind == "event" and e.type == "attempt")
    final = calls[last_attempt:]
    assert "".join(t for kind, t in final if kind == "stdout") == case["expect"]["stdout"]
    assert "".join(t for kind, t in final if kind == "stderr") == case["expect"]["stderr"]
    assert [o.output_type for kind, o in final if kind == "display"] == [
        d["output_type"] for d in case["expect"]["displays"]]
    all_stdout = [e["fields"]["data"] for e in case["entries"] if e["fields"]["type"] == "stdout"]
    assert [t for kind, t in calls if kind == "stdout"] == all_stdout, "earlier attempts' chunks came too, in order"


def test_resume_from_an_events_id(client: sandq.Client, job: str) -> None:
    entries = CASES[0]["entries"]
    write(client, job, entries, "succeeded")
    first = list(itertools.islice(client.events(job, block=0.5), 3))
    rest = list(client.events(job, first[-1].id, block=0.5))
    assert [e.id for e in first + rest] == [e["id"] for e in entries], "no gap, no duplicate"


def test_events_arrive_while_they_are_written(client: sandq.Client, job: str) -> None:
    """A producer appends an entry every 100 ms: the reader gets the first one long before the
    producer is done, and every one, in order."""
    client.redis.hset(client.names.job(job), "status", "running")
    chunks = [f"line {i}\n" for i in range(10)]
    done = threading.Event()
    finished_at: list[float] = []

    def produce() -> None:
        key = client.names.events(job)
        client.redis.xadd(key, {"type": "attempt", "attempt": "1", "seq": "0", "attempt_id": "a0000000000000001"})
        for seq, chunk in enumerate(chunks, start=1):
            time.sleep(0.1)
            client.redis.xadd(key, {"type": "stdout", "attempt": "1", "seq": str(seq), "data": chunk})
        client.redis.hset(client.names.job(job), "status", "succeeded")
        client.redis.xadd(key, {"type": "end", "attempt": "1", "status": "succeeded"})
        finished_at.append(time.monotonic())
        done.set()

    producer = threading.Thread(target=produce)
    arrivals: list[tuple[float, Event]] = []
    producer.start()
    try:
        for event in client.events(job, block=0.5):
            arrivals.append((time.monotonic(), event))
    finally:
        producer.join()
    assert done.is_set()
    assert [e.type for _, e in arrivals] == ["attempt"] + ["stdout"] * len(chunks) + ["end"]
    assert "".join(e.data or "" for _, e in arrivals if e.type == "stdout") == "".join(chunks)
    first_chunk_at = next(t for t, e in arrivals if e.type == "stdout")
    assert finished_at[0] - first_chunk_at > 0.5, "the first chunk came while the producer was still writing"


def test_a_stream_without_end_stops_once_the_job_is_over(client: sandq.Client, job: str) -> None:
    """No `end` (the stream of an older worker, or one that expired): the reader stops at the
    first read that times out with the job's status terminal, after what is left."""
    entries = [e for e in CASES[0]["entries"] if e["fields"]["type"] != "end"]
    write(client, job, entries, "succeeded")
    started = time.monotonic()
    events = list(client.events(job, block=0.5))
    assert time.monotonic() - started < 2.0, "within about one block"
    assert [e.id for e in events] == [e["id"] for e in entries]

    # A running job: the reader waits, and stops once the status turns terminal.
    other = f"events-{uuid.uuid4()}"
    try:
        write(client, other, entries[:2], "running")
        turned: list[float] = []

        def finish() -> None:
            time.sleep(1.0)
            client.redis.xadd(client.names.events(other), entries[2]["fields"])
            client.redis.hset(client.names.job(other), "status", "failed")
            turned.append(time.monotonic())

        thread = threading.Thread(target=finish)
        thread.start()
        events = list(client.events(other, block=0.5))
        stopped = time.monotonic()
        thread.join()
        assert [e.type for e in events] == [e["fields"]["type"] for e in entries[:3]]
        assert stopped - turned[0] < 2.0, "within about one block of the status turning terminal"
    finally:
        client.redis.delete(client.names.job(other), client.names.events(other))


def test_an_unknown_job_has_no_events(client: sandq.Client) -> None:
    assert list(client.events(f"events-{uuid.uuid4()}", block=0.2)) == []


def test_timeout_stops_a_reader_without_error(client: sandq.Client, job: str) -> None:
    write(client, job, CASES[0]["entries"][:2], "running")
    started = time.monotonic()
    assert len(list(client.events(job, block=0.5, timeout=1.0))) == 2
    assert 0.9 < time.monotonic() - started < 2.0
    with pytest.raises(ValueError):
        next(client.events(job, block=0))


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
async def test_async_vectors_and_resume(events_config: sandq.Config, case: dict) -> None:
    job_id = f"events-{uuid.uuid4()}"
    async with AsyncClient(events_config) as client:
        try:
            await client.redis.hset(client.names.job(job_id), "status", case["expect"]["status"])
            for entry in case["entries"]:
                await client.redis.xadd(client.names.events(job_id), entry["fields"], id=entry["id"])
            events = [e async for e in client.events(job_id, block=0.5)]
            assert reading(fold(events)) == case["expect"]
            assert [e.id for e in events] == [e["id"] for e in case["entries"]]

            rest = [e async for e in client.events(job_id, events[2].id, block=0.5)]
            assert [e.id for e in events[:3] + rest] == [e["id"] for e in case["entries"]], "no gap, no duplicate"

            # follow's callbacks: plain functions and coroutines alike.
            stdout: list[str] = []

            async def on_stderr(text: str) -> None:
                stdout.append(f"stderr:{text}")

            transcript = await client.follow(job_id, block=0.5, on_stdout=stdout.append, on_stderr=on_stderr)
            assert reading(transcript) == case["expect"]
            wrote = [(e["fields"]["type"], e["fields"]["data"]) for e in case["entries"]
                     if e["fields"]["type"] in ("stdout", "stderr")]
            assert stdout == [d if t == "stdout" else f"stderr:{d}" for t, d in wrote]
        finally:
            await client.redis.delete(client.names.job(job_id), client.names.events(job_id))
