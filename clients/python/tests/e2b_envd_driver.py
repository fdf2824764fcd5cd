"""E2B's own SDK (e2b-code-interpreter on e2b, tests/e2b/requirements.txt) driving a sandbox's
files and commands through the gateway, as an E2B user's program would: run by test_e2b.py
with the E2B suite's interpreter ($SANDQ_E2B_PYTHON), pointed at the gateway by E2B_API_URL,
E2B_SANDBOX_URL and E2B_API_KEY. Every expected value is computed here from the data written,
not read from sandq. Exits non-zero (an AssertionError) at the first difference; prints one
line per check."""
from __future__ import annotations

import os
import random
import sys
import time

import httpx
from e2b import CommandExitException, FileType, InvalidArgumentException, NotFoundException, SandboxException
from e2b_code_interpreter import Sandbox


def check(what: str, ok: bool, detail: object = "") -> None:
    assert ok, f"{what}: {detail}"
    print(f"ok: {what}", flush=True)


def main() -> None:
    rng = random.Random(20261206)
    rows = [(i, rng.randint(-1000, 1000)) for i in range(5000)]
    csv_text = "i,x\n" + "".join(f"{i},{x}\n" for i, x in rows)
    expected_sum = sum(x for _, x in rows)
    blob = bytes(rng.getrandbits(8) for _ in range(300_000))  # not UTF-8: bytes must come back as they went

    sbx = Sandbox.create(timeout=300)
    try:
        # Writes: multipart (the SDK's default for str), octet-stream, several in one call.
        info = sbx.files.write("data/nums.csv", csv_text)
        check("a relative write lands under /home/user", info.path == "/home/user/data/nums.csv" and info.name == "nums.csv", info)
        info = sbx.files.write("/home/user/blob.bin", blob, use_octet_stream=True)
        check("an octet-stream write", info.path == "/home/user/blob.bin", info)
        infos = sbx.files.write_files([{"path": "/work/multi/a.txt", "data": "alpha"}, {"path": "multi/b.txt", "data": b"beta"}])
        check("two files in one multipart write", sorted(i.path for i in infos) == ["/home/user/multi/a.txt", "/home/user/multi/b.txt"], infos)

        # Past axum's default 2 MiB body limit, in E2B's default multipart form; a compressed
        # upload is refused, not stored compressed.
        big = "".join(f"{i:07d}\n" for i in range(700_000))  # 5.6 MB
        sbx.files.write("big.txt", big)
        check("a 5.6 MB multipart write reads back whole", sbx.files.read("big.txt") == big)
        try:
            sbx.files.write("zipped.txt", "x" * 1000, gzip=True)
            check("a gzip upload is refused", False, "stored")
        except SandboxException as e:
            check("a gzip upload is refused", "uncompressed" in str(e), e)

        # Reads, as text and as bytes.
        check("a text read is the text written", sbx.files.read("/home/user/data/nums.csv") == csv_text)
        back = sbx.files.read("blob.bin", format="bytes")
        check("a binary read is the bytes written", bytes(back) == blob, (len(back), len(blob)))
        check("the other multipart file", sbx.files.read("multi/b.txt") == "beta")

        # A cell sees the files, and a file a cell writes is read back.
        execution = sbx.run_code("import pandas as pd\ndf = pd.read_csv('data/nums.csv')\nprint(int(df['x'].sum()))\n"
                                 "open('out.txt', 'w').write(f'{len(df)} rows')")
        check("a cell reads the written CSV", execution.error is None and "".join(execution.logs.stdout).strip() == str(expected_sum),
              (execution.error, execution.logs))
        check("a file a cell wrote is read", sbx.files.read("out.txt") == f"{len(rows)} rows")

        # Listing, exists, get_info.
        top = {e.name: e for e in sbx.files.list("/home/user")}
        check("the home directory's entries", set(top) == {"data", "blob.bin", "multi", "out.txt", "big.txt"}, sorted(top))
        check("directories and files are typed", top["data"].type == FileType.DIR and top["blob.bin"].type == FileType.FILE
              and top["blob.bin"].size == len(blob), (top["data"], top["blob.bin"]))
        deep = sorted(e.path for e in sbx.files.list("/home/user", depth=2))
        check("a listing two levels deep", deep == sorted(["/home/user/data", "/home/user/data/nums.csv", "/home/user/blob.bin", "/home/user/big.txt",
                                                          "/home/user/multi", "/home/user/multi/a.txt", "/home/user/multi/b.txt",
                                                          "/home/user/out.txt"]), deep)
        check("exists: a file, a directory", sbx.files.exists("data/nums.csv") and sbx.files.exists("/home/user/multi"))
        check("exists: nothing there", not sbx.files.exists("nope.txt"))
        check("get_info of a file", sbx.files.get_info("data/nums.csv").size == len(csv_text.encode()))
        try:
            sbx.files.read("missing.txt")
            check("a missing file is not found", False, "no error")
        except NotFoundException as e:  # FileNotFoundException is one
            check("a missing file is not found", True, e)
        try:
            sbx.files.write("/etc/evil", "x")
            check("a path outside /home/user is refused", False, "no error")
        except (InvalidArgumentException, SandboxException) as e:
            check("a path outside /home/user is refused", "/home/user" in str(e), e)

        # Commands: output, exit code, env, cwd, quoting.
        result = sbx.commands.run("echo hello; echo oops >&2; ls data")
        check("a command's stdout, stderr and exit code", (result.stdout, result.stderr, result.exit_code) == ("hello\nnums.csv\n", "oops\n", 0),
              result)
        tricky = "a'b \"q\" $x \\n {}"
        result = sbx.commands.run(f"printf '%s|' \"$GREETING\" \"$(pwd)\"; printf '%s' {shell_quote(tricky)}",
                                  envs={"GREETING": "hi there"}, cwd="/home/user/multi")
        check("a command's env, cwd and quoting", result.stdout == f"hi there|/home/user/multi|{tricky}", result.stdout)
        try:
            sbx.commands.run("echo before; exit 3")
            check("a failing command raises with its code", False, "no error")
        except CommandExitException as e:
            check("a failing command raises with its code", e.exit_code == 3 and e.stdout == "before\n", e)
        sbx.commands.run("seq 1 100 | paste -sd+ | bc > sum.txt || python3 -c 'print(sum(range(101)))' > sum.txt")
        check("a file a command wrote is read", sbx.files.read("sum.txt").strip() == str(sum(range(1, 101))))

        # Live: the first line arrives while the command still runs.
        seen: list[float] = []
        started = time.monotonic()
        sbx.commands.run("echo first; sleep 3; echo second", on_stdout=lambda line: seen.append(time.monotonic() - started))
        ended = time.monotonic() - started
        check("a command's output comes as it prints", len(seen) >= 2 and seen[0] < ended - 2, (seen, ended))

        # A background command killed through its handle.
        handle = sbx.commands.run("sleep 120", background=True)
        time.sleep(1)
        check("kill finds the command", handle.kill() is True)
        try:
            handle.wait()
            check("a killed command ends killed", False, "no error")
        except CommandExitException as e:
            check("a killed command ends killed", e.exit_code != 0, e)

        # Another tenant's key reaches nothing of this sandbox's files.
        other = os.environ.get("SANDQ_OTHER_KEY")
        if other:
            headers = {"X-Access-Token": other, "E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}
            with httpx.Client(base_url=os.environ["E2B_SANDBOX_URL"], timeout=30) as http:
                r = http.get("/files", params={"path": "data/nums.csv"}, headers=headers)
                check("another tenant cannot read the file", r.status_code == 502 and "i,x" not in r.text, r.status_code)
                r = http.post("/files", params={"path": "x.txt"}, content=b"x", headers={**headers, "Content-Type": "application/octet-stream"})
                check("another tenant cannot write", r.status_code == 502, r.status_code)
                r = http.post("/process.Process/Start", json={"process": {"cmd": "/bin/true"}},
                              headers={**headers, "Content-Type": "application/connect+json"})
                check("another tenant cannot run a command", r.status_code == 502, r.status_code)
            check("their write did not land", not sbx.files.exists("x.txt"))
    finally:
        sbx.kill()
    # Killed: the files are gone with it.
    try:
        sbx.files.read("data/nums.csv")
        check("a killed sandbox's files are gone", False, "read after kill")
    except Exception as e:  # the SDK's error for a sandbox that is gone (502)
        check("a killed sandbox's files are gone", True, e)


def shell_quote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


if __name__ == "__main__":
    main()
    sys.exit(0)
