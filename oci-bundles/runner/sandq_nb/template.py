"""Forked start (`sandq_runner.py --template`): one pre-imported runner per SKU, outside any
sandbox, from which each job's process is forked and then moved into a sandbox the worker
made (docs/threat-model.md, "Forked sandboxes").

The template (T) preloads like a warm runner, makes its shell, and then serves forks on the
listening socket it was given as fd 3 until its stdin (a pipe from the worker) closes. Per
connection it forks a child (C) that owns the connection:

    helper -> C   one message: a 4-byte length, JSON, and with it (SCM_RIGHTS) the sandbox
                  init's namespaces (user first) then the job's stdin, stdout and stderr
    C             sets the spec's rlimits (still host root), joins every namespace, forks
                  the job's process (G), the first in the sandbox's pid namespace after its
                  init
    C -> helper   "pid <G's host pid>\\n"; the helper moves G into the job's cgroup
    helper -> C   "go\\n"; C lets G go on, waits for it, and sends
    C -> helper   "exit <code>\\n" or "signal <number>\\n", or "error <text>\\n"

G, before any job data: its own session, the job's stdio and no other descriptor, the spec's
umask, groups, gid and uid, an empty bounding set and no capabilities, no_new_privs, and the
seccomp filter read back from the sandbox's init (byte for byte the cold start's), then the
job's working directory. It then waits for its job as a warm runner does (`.ready`, the FIFO);
only then does it read the handover and run the cell.
"""

import ctypes
import json
import os
import select
import signal
import socket
import struct

from .common import note as _note

# linux/prctl.h, linux/capability.h, linux/seccomp.h
_PR_CAPBSET_DROP = 24
_PR_SET_DUMPABLE = 4
_PR_SET_SECCOMP = 22
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_SECCOMP_MODE_FILTER = 2
_CAP_VERSION_3 = 0x20080522

#: The listening socket the template was started with.
LISTEN_FD = 3
#: Largest request the template reads, bytes (the seccomp program is the bulk: ~8 KiB).
MAX_REQUEST = 1 << 20
#: Most descriptors one request carries: 8 namespaces and 3 stdio.
MAX_FDS = 16

_libc = ctypes.CDLL(None, use_errno=True)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def _check(ret, what):
    if ret != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, "%s: %s" % (what, os.strerror(errno)))


def _recv_request(conn):
    """Reads the length-prefixed JSON request and the descriptors sent with it."""
    data, fds, _flags, _addr = socket.recv_fds(conn, 65536, MAX_FDS)
    if len(data) < 4:
        raise ValueError("short request")
    (size,) = struct.unpack("<I", data[:4])
    if size > MAX_REQUEST:
        raise ValueError("request of %d bytes" % size)
    body = bytearray(data[4:])
    while len(body) < size:
        chunk = conn.recv(min(65536, size - len(body)))
        if not chunk:
            raise ValueError("request cut short")
        body += chunk
    return json.loads(bytes(body[:size])), fds


def _drop_privileges(req):
    """As libcontainer's init does before exec: groups, gid, uid, capabilities, no_new_privs,
    seccomp. Raises OSError on any failure (the caller exits: the job never runs half-dropped)."""
    # As libcontainer: an umask or groups only when the spec names them (else inherited, the
    # worker's, as a cold start's init inherits the helper's).
    if req.get("umask") is not None:
        os.umask(req["umask"])
    if req.get("groups"):
        os.setgroups(req["groups"])
    last = int(open("/proc/sys/kernel/cap_last_cap").read())
    for cap in range(last + 1):
        _check(_libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0), "PR_CAPBSET_DROP")
    os.setresgid(req["gid"], req["gid"], req["gid"])
    os.setresuid(req["uid"], req["uid"], req["uid"])
    header = _CapHeader(_CAP_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), data), "capset")
    _check(_libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "PR_CAP_AMBIENT")
    # The uid change made the process non-dumpable; the exec of a cold start makes it
    # dumpable again (its /proc/self owned by itself, ptrace by its own uid as any process).
    _check(_libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0), "PR_SET_DUMPABLE")
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
    program = bytes.fromhex(req["seccomp"]) if req.get("seccomp") else b""
    if program:
        if len(program) % 8:
            raise OSError(0, "seccomp program of %d bytes" % len(program))
        prog = _SockFprog(len(program) // 8, program)
        _check(_libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0),
               "PR_SET_SECCOMP")


#: Most bytes of the template's /tmp copied into each job's (matplotlib's and IPython's dirs:
#: a few KiB).
MAX_TMP_BYTES = 4 << 20


def _snapshot_tmp(tmp):
    """What the preload and the shell left in the template's /tmp (a cold start makes the
    same in its own: matplotlib's config dir, IPython's): [(path, mode, bytes or None)]."""
    entries, total = [], 0
    for top, dirs, files in os.walk(tmp):
        dirs.sort()
        for name in dirs:
            path = os.path.join(top, name)
            entries.append((os.path.relpath(path, tmp), os.lstat(path).st_mode & 0o7777, None))
        for name in sorted(files):
            path = os.path.join(top, name)
            st = os.lstat(path)
            if not os.path.isfile(path) or os.path.islink(path) or total + st.st_size > MAX_TMP_BYTES:
                continue
            with open(path, "rb") as f:
                data = f.read(MAX_TMP_BYTES - total)
            total += len(data)
            entries.append((os.path.relpath(path, tmp), st.st_mode & 0o7777, data))
    return entries


def _restore_tmp(tmp, entries):
    """Makes the snapshot in the job's own /tmp, as the job's user (never following a link:
    the /tmp is new and empty)."""
    for rel, mode, data in entries:
        path = os.path.join(tmp, rel)
        if data is None:
            os.mkdir(path, mode)
        else:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)


def _job_streams():
    """The job's own process keeps everything it prints, a partial line included: its stdout
    and stderr write through (the image's sitecustomize made the template's, not pid 1, and
    every forked child line-buffered; a cold start's program is pid 1 and keeps them as
    PYTHONUNBUFFERED made them)."""
    import sys
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=False, write_through=True)


def _child(conn, tmp_entries):
    """C: joins the sandbox, forks G, reports. Returns in G only (with G's setup done)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    req, fds = _recv_request(conn)
    ns_count = len(req["namespaces"])
    if len(fds) != ns_count + 3:
        raise ValueError("%d descriptors for %d namespaces and stdio" % (len(fds), ns_count))
    import resource
    # Still host root here: limits above the template's own can be set (CAP_SYS_RESOURCE of
    # the initial user namespace), as libcontainer sets them before joining.
    for name, soft, hard in req["rlimits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))
    for fd in fds[:ns_count]:
        os.setns(fd, 0)
        os.close(fd)
    stdio = fds[ns_count:]
    gate_r, gate_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(gate_w)
        try:
            go = os.read(gate_r, 1)
            if go != b"g":
                os._exit(125)
            os.close(gate_r)
            os.setsid()
            conn.detach()  # closed below; the object must not close a reused number later
            for target, fd in enumerate(stdio):
                os.dup2(fd, target)
            os.closerange(3, 1 << 20)
            _drop_privileges(req)
            _restore_tmp(os.environ.get("TMPDIR") or "/tmp", tmp_entries)
            _job_streams()
            os.chdir(req["cwd"])
        except BaseException as exc:  # never run the job half set up
            try:
                os.write(2, ("sandq: cannot enter the sandbox: %s\n" % exc).encode())
            finally:
                os._exit(125)
        return
    for fd in stdio:
        os.close(fd)
    os.close(gate_r)
    conn.sendall(b"pid %d\n" % pid)
    reply = b""
    while not reply.endswith(b"\n") and len(reply) < 64:
        chunk = conn.recv(64)
        if not chunk:
            break
        reply += chunk
    if reply != b"go\n":
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os._exit(0)
    os.write(gate_w, b"g")
    os.close(gate_w)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        conn.sendall(b"signal %d\n" % os.WTERMSIG(status))
    else:
        conn.sendall(b"exit %d\n" % os.waitstatus_to_exitcode(status))
    os._exit(0)


def serve():
    """T: serves forks until the worker's pipe (stdin) closes. Returns in each job's process G,
    inside its sandbox, after which the caller reads the handover as a warm start does."""
    import warnings
    # Python 3.12+ warns on fork with threads (numpy's BLAS pool): the child is single-
    # threaded and the pool restarts in it on first use.
    warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*fork.*")
    tmp_entries = _snapshot_tmp(os.environ.get("TMPDIR") or "/tmp")
    listener = socket.socket(fileno=LISTEN_FD)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # C's are reaped by the kernel
    os.write(1, b"ready\n")
    while True:
        readable, _, _ = select.select([listener, 0], [], [])
        if 0 in readable:
            if not os.read(0, 1):
                os._exit(0)  # the worker is gone
            continue
        try:
            conn, _ = listener.accept()
        except OSError:
            continue
        pid = os.fork()
        if pid != 0:
            conn.close()
            continue
        # C (and, on return, G).
        try:
            listener.close()
            os.close(0)
            _child(conn, tmp_entries)
        except BaseException as exc:
            try:
                conn.sendall(b"error %s\n" % str(exc).replace("\n", " ").encode()[:1000])
            finally:
                os._exit(1)
        # G: reseed what a fork copies (random reseeds itself at fork).
        try:
            import numpy
            numpy.random.seed()
        except Exception as exc:
            _note("could not reseed numpy: %s" % exc)
        return
