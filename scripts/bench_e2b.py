"""Issue 25's benchmark (docs/benchmarks.md "E2B's SDK"): a trivial cell through E2B's Python
SDK against sandq (one sandbox: `run_code("1")`), side by side with the same cell through
sandq's own Python SDK in HTTP mode (`HttpClient.run("1", session=...)`), alternated in one run
against the same gateway and worker. Prints p50, p99 and max of each and their ratio.
Usage: python bench_e2b.py URL KEY CELLS (run by scripts/bench-e2b.sh)."""
import statistics
import sys
import time
import uuid

from e2b_code_interpreter import Sandbox
from sandq.http import HttpClient


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def main():
    url, key, cells = sys.argv[1], sys.argv[2], int(sys.argv[3])
    import os
    os.environ.update({"E2B_API_KEY": "e2b_" + key.encode().hex(), "E2B_API_URL": url, "E2B_SANDBOX_URL": url})
    sandq = HttpClient(url=url, api_key=key)
    session = f"bench-{uuid.uuid4().hex[:12]}"
    e2b_ms, sandq_ms = [], []
    with Sandbox.create(timeout=1800) as sandbox:
        # One cell each first: the sessions exist and hold a state before timing.
        assert sandbox.run_code("1").text == "1"
        sandq.run("1", session=session, sku="S")
        for _ in range(cells):
            t = time.perf_counter()
            result = sandbox.run_code("1")
            e2b_ms.append((time.perf_counter() - t) * 1000)
            assert result.text == "1", result
            t = time.perf_counter()
            job = sandq.run("1", session=session, sku="S")
            sandq_ms.append((time.perf_counter() - t) * 1000)
            assert job.outputs, job
    sandq.close()
    print(f"cells: {cells} each, alternated")
    for name, ms in (("E2B SDK -> gateway /execute", e2b_ms), ("sandq SDK (HTTP) -> gateway /v1/jobs", sandq_ms)):
        print(f"{name}: p50 {pct(ms, 0.5):.0f} ms, p99 {pct(ms, 0.99):.0f} ms, max {max(ms):.0f} ms, mean {statistics.mean(ms):.0f} ms")
    print(f"ratio E2B / sandq: p50 {pct(e2b_ms, 0.5) / pct(sandq_ms, 0.5):.2f}, p99 {pct(e2b_ms, 0.99) / pct(sandq_ms, 0.99):.2f}")


if __name__ == "__main__":
    main()
