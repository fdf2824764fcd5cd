"""Anchor (c) of scripts/bench-anchors.sh: a warm Jupyter kernel running the benchmark's cells.

Starts an ipykernel with jupyter_client's KernelManager (in the image's rootfs, like the other
anchors), waits until it is ready, then times, from `execute` sent to the kernel's reply and
its `idle` status (what a notebook front end waits for):
  - the trivial cell `pass`, --runs times, in the warm kernel;
  - the main job's script run as a cell (`%run`), first in that kernel (pandas and matplotlib
    not imported yet), then a second time (imported).
Prints one JSON object: milliseconds (median, p90, min, max, runs) per cell.
"""
import argparse
import json
import math
import os
import statistics
import time

from jupyter_client.manager import start_new_kernel


def run_cell(client, code, timeout=120):
    started = time.perf_counter()
    msg_id = client.execute(code, store_history=False)
    reply = client.get_shell_msg(timeout=timeout)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = client.get_shell_msg(timeout=timeout)
    while True:
        msg = client.get_iopub_msg(timeout=timeout)
        if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"):
            break
    elapsed = (time.perf_counter() - started) * 1000
    if reply["content"]["status"] != "ok":
        raise SystemExit("cell failed: %r" % (reply["content"],))
    return elapsed


def summary(times):
    ordered = sorted(times)
    return {"median_ms": round(statistics.median(ordered), 2),
            "p90_ms": round(ordered[math.ceil(len(ordered) * 0.9) - 1], 2),
            "min_ms": round(ordered[0], 2), "max_ms": round(ordered[-1], 2), "runs": len(ordered)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--main", required=True)
    parser.add_argument("--cwd", required=True)
    args = parser.parse_args()
    os.chdir(args.cwd)
    result = {}
    t0 = time.perf_counter()
    manager, client = start_new_kernel(kernel_name="python3", cwd=args.cwd)
    result["kernel_start_ms"] = round((time.perf_counter() - t0) * 1000, 1)
    try:
        run_cell(client, "pass")  # the first cell after start-up
        result["trivial"] = summary([run_cell(client, "pass") for _ in range(args.runs)])
        # The main job, in a fresh kernel: first run, then again in the same kernel.
        firsts, seconds = [], []
        for _ in range(max(1, args.runs // 4)):
            client.stop_channels()
            manager.shutdown_kernel(now=True)
            manager, client = start_new_kernel(kernel_name="python3", cwd=args.cwd)
            run_cell(client, "pass")
            firsts.append(run_cell(client, "%%run %s" % args.main))
            seconds.append(run_cell(client, "%%run %s" % args.main))
        result["main_first"] = summary(firsts)
        result["main_second"] = summary(seconds)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
