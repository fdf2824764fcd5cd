"""Session state: the user's namespace saved after a cell and loaded back before the next cell
of the session. Written and read only inside sandboxes of the session.

The namespace is saved as one object graph: one cloudpickle pickler writes every variable, each
as a record of its own, so that

- two names for one object (`fig, ax = plt.subplots()`, `alias = rows`) come back as one object
  (the pickler's memo spans the records);
- a function or class defined in a cell gets the restored namespace itself as its globals, not
  a private copy of what it used (cloudpickle's globals for the namespace are a `_Namespace`,
  which unpickles as the namespace being restored into);
- modules, and functions and classes of importable modules, are re-imported by name; what the
  cells defined goes by value;
- numpy buffers of any size are kept (pickle protocol 5; the size cap counts them);
- one value that cannot be saved is left out alone, listed with its reason.

Loading reads the records in order, each under a time limit and, where the kernel allows, an
address-space limit: a record that raises, hangs or allocates past what the job has left is
dropped and listed, and the rest still load (a record that shared objects with a dropped one may
be dropped with it, and says so). A state that cannot be read at all leaves the namespace empty,
and the report says why. The format (`docs/protocol.md`, "Sessions"):

    b"SANDQ-STATE-2\\n", then per variable: name length (u32 LE), name (UTF-8),
    payload length (u64 LE), payload (one pickle of the shared pickler)

The first format (a pickle of `{"version": 1, "variables": {name: pickle}}`) is still read.
"""

import os
import struct

from .common import safe_str as _safe_str


_STATE_SKIP = {"In", "Out", "get_ipython", "exit", "quit", "open"}
_STATE_MAX_LISTED = 1000
_STATE_MAX_UNSAVED_LISTED = 100

MAGIC = b"SANDQ-STATE-2\n"
_NAME = struct.Struct("<I")
_LENGTH = struct.Struct("<Q")
_MAX_NAME_BYTES = 4096

# The namespace a state is being loaded into (see _Namespace).
_LOADING_INTO = None


def loading_namespace():
    """The namespace a state is being loaded into: what a saved `_Namespace` unpickles as."""
    return _LOADING_INTO


class _Namespace(dict):
    """Stands for the user's namespace in a saved state: cloudpickle saves the globals of the
    functions a cell defined as this object, which unpickles as the namespace being restored
    into, so that a restored function reads and writes the session's live variables."""

    def __reduce__(self):
        return (loading_namespace, ())


class _StateTooLarge(Exception):
    pass


class _RestoreTimeout(Exception):
    pass


class _CappedFile:
    """A write-only file that raises _StateTooLarge past `limit` bytes, so that a huge object
    is abandoned while it is being pickled rather than after it filled the memory. Large
    buffers arrive as `PickleBuffer`s (protocol 5), counted by their byte size."""

    def __init__(self, f, limit):
        self.f = f
        self.left = limit

    def write(self, data):
        n = memoryview(data).nbytes
        if n > self.left:
            raise _StateTooLarge()
        self.left -= n
        return self.f.write(data)


class _Records:
    """The reader one unpickler keeps across records: it reads the current record only (no
    `peek`, so the C unpickler reads exactly what it needs and never past a record)."""

    def __init__(self, f):
        self.f = f
        self.left = 0

    def read(self, n=-1):
        n = self.left if n is None or n < 0 else min(n, self.left)
        data = self.f.read(n)
        self.left -= len(data)
        return data

    def readinto(self, buf):
        view = memoryview(buf).cast("B")
        n = min(len(view), self.left)
        got = self.f.readinto(view[:n])
        self.left -= got
        return got

    def readline(self):
        data = self.f.readline(self.left)
        self.left -= len(data)
        return data

    def skip_rest(self):
        self.f.seek(self.left, os.SEEK_CUR)
        self.left = 0


def _pickler_module():
    try:
        import cloudpickle
        return cloudpickle
    except ImportError:
        pass
    try:
        from joblib.externals import cloudpickle
        return cloudpickle
    except ImportError:
        import pickle
        return pickle


def _reason(exc):
    return ("%s: %s" % (type(exc).__name__, _safe_str(exc)))[:200]


def _memory_headroom():
    """Bytes the job may still allocate: the SKU's memory (`SANDQ_STATE_MEMORY_LIMIT`, set by
    the worker) less this process's resident size, else its cgroup's limit less its usage
    (v2, then v1) where the sandbox can read them; None when unknown."""
    limit = _env_number("SANDQ_STATE_MEMORY_LIMIT", 0)
    if limit > 0:
        try:
            with open("/proc/self/statm") as f:
                resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            return max(0, limit - resident)
        except (OSError, ValueError, IndexError):
            return None
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
            return None
        return max(0, int(limit) - usage)
    return None


class _Bounds:
    """While loading: SIGALRM interrupts a record past its time, and RLIMIT_AS stops an
    allocation past what the job has left (MemoryError) instead of an OOM kill of the cell."""

    def __init__(self):
        self.alarm = None
        self.rlimit = None

    def __enter__(self):
        import signal
        try:
            self.alarm = signal.signal(signal.SIGALRM, self._expired)
        except (ValueError, OSError):  # not the main thread
            self.alarm = None
        headroom = _memory_headroom()
        if headroom is not None:
            try:
                import resource
                soft, hard = resource.getrlimit(resource.RLIMIT_AS)
                with open("/proc/self/statm") as f:
                    vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
                cap = vm + headroom
                if hard == resource.RLIM_INFINITY or cap < hard:
                    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
                    self.rlimit = (soft, hard)
            except (ImportError, OSError, ValueError):
                self.rlimit = None
        return self

    @staticmethod
    def _expired(signum, frame):
        raise _RestoreTimeout()

    def limit(self, seconds):
        if self.alarm is not None:
            import signal
            signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))

    def clear(self):
        if self.alarm is not None:
            import signal
            signal.setitimer(signal.ITIMER_REAL, 0)

    def __exit__(self, *exc):
        self.clear()
        if self.alarm is not None:
            import signal
            signal.signal(signal.SIGALRM, self.alarm)
        if self.rlimit is not None:
            import resource
            resource.setrlimit(resource.RLIMIT_AS, self.rlimit)
        return False


def _load_v1(ns, f):
    """The first format: each variable pickled on its own."""
    import pickle
    saved = pickle.load(f)
    variables = saved["variables"]
    restored, not_restored = 0, []
    for name, blob in variables.items():
        try:
            ns[name] = pickle.loads(blob)
            restored += 1
        except Exception as exc:
            not_restored.append({"name": name, "reason": _reason(exc)})
    return restored, not_restored


def load_state(ns, path, seconds=30.0, variable_seconds=10.0):
    """Loads the state at `path` into `ns`, within `seconds` in all and `variable_seconds` a
    variable; returns (restored count, [{name, reason} not restored])."""
    import pickle
    import time
    global _LOADING_INTO
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return 0, []
    except OSError as exc:
        return 0, [{"name": "*", "reason": "the saved state cannot be read: " + _reason(exc)}]
    with f:
        try:
            head = f.read(len(MAGIC))
            if head != MAGIC:
                f.seek(0)
                return _load_v1(ns, f)
        except Exception as exc:
            return 0, [{"name": "*", "reason": "the saved state cannot be read: " + _reason(exc)}]
        restored, not_restored = 0, []
        records = _Records(f)
        unpickler = pickle.Unpickler(records)
        deadline = time.monotonic() + seconds
        _LOADING_INTO = ns
        try:
            with _Bounds() as bounds:
                while True:
                    size = f.read(_NAME.size)
                    if not size:
                        break
                    try:
                        (name_len,) = _NAME.unpack(size)
                        if name_len > _MAX_NAME_BYTES:
                            raise ValueError("a record name of %d bytes" % name_len)
                        name = f.read(name_len).decode("utf-8")
                        (payload_len,) = _LENGTH.unpack(f.read(_LENGTH.size))
                    except Exception as exc:
                        not_restored.append({"name": "*", "reason": "the rest of the saved state is unreadable: " + _reason(exc)})
                        break
                    left = deadline - time.monotonic()
                    records.left = payload_len
                    if left <= 0:
                        not_restored.append({"name": name, "reason": "over the restore time limit of %gs" % seconds})
                        records.skip_rest()
                        continue
                    this_limit = min(variable_seconds, left)
                    try:
                        bounds.limit(this_limit)
                        try:
                            value = unpickler.load()
                        finally:
                            bounds.clear()
                        if records.left:
                            raise ValueError("the record has %d bytes past its pickle" % records.left)
                    except BaseException as exc:
                        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                            raise
                        if isinstance(exc, _RestoreTimeout):
                            reason = "restoring it took over %gs" % max(round(this_limit, 1), 0.1)
                        elif isinstance(exc, MemoryError):
                            reason = "restoring it needed more memory than the job has left"
                        elif isinstance(exc, pickle.UnpicklingError) and "Memo value not found" in str(exc):
                            reason = "it shares objects with a variable that could not be restored"
                        else:
                            reason = _reason(exc)
                        not_restored.append({"name": name, "reason": reason})
                        records.skip_rest()
                        # A failed load may leave part of a frame in the unpickler: a new one,
                        # with what the records before made (shared objects).
                        memo = unpickler.memo
                        unpickler = pickle.Unpickler(records)
                        unpickler.memo = memo
                        continue
                    ns[name] = value
                    restored += 1
        finally:
            _LOADING_INTO = None
        return restored, not_restored


def _saveable(ns, baseline):
    for name in sorted(ns):
        if name.startswith("_") or name in _STATE_SKIP:
            continue
        if name in baseline and baseline[name] is ns[name]:
            continue
        yield name


def save_state(ns, baseline, path, limit, seconds):
    """Pickles the user's variables in `ns` (not the shell's own: `baseline`) to `path` as one
    object graph (see the module doc), within `limit` bytes and `seconds`. Returns the report
    (names saved, left out with reasons, bytes, ms)."""
    import io
    import pickle
    import time
    t0 = time.monotonic()
    module = _pickler_module()
    saved, unsaved = [], []
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(MAGIC)
        capped = _CappedFile(f, limit - len(MAGIC))
        pickler = module.Pickler(capped, protocol=pickle.HIGHEST_PROTOCOL)
        if hasattr(pickler, "globals_ref"):
            pickler.globals_ref[id(ns)] = _Namespace()
        for name in _saveable(ns, baseline):
            value = ns[name]
            if time.monotonic() - t0 > seconds:
                unsaved.append({"name": name, "reason": "over the time cap of %gs" % seconds})
                continue
            if isinstance(value, io.IOBase):
                # cloudpickle would save a file's content and bring back a copy: not the open file.
                unsaved.append({"name": name, "reason": "an open file cannot be saved"})
                continue
            encoded = name.encode("utf-8", "surrogatepass")
            start = f.tell()
            try:
                capped.write(_NAME.pack(len(encoded)) + encoded + _LENGTH.pack(0))
                body = f.tell()
                pickler.dump(value)
            except BaseException as exc:  # anything the object's __reduce__ raises
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                reason = ("over the size cap of %d bytes" % limit) if isinstance(exc, _StateTooLarge) else _reason(exc)
                unsaved.append({"name": name, "reason": reason})
                f.seek(start)
                f.truncate()
                capped.left = limit - start
                # What the failed record memoized was cut with it.
                pickler.clear_memo()
                continue
            end = f.tell()
            f.seek(body - _LENGTH.size)
            f.write(_LENGTH.pack(end - body))
            f.seek(end)
            saved.append(name)
    os.replace(tmp, path)
    return {
        "variables": saved[:_STATE_MAX_LISTED],
        "unsaved": unsaved[:_STATE_MAX_UNSAVED_LISTED],
        "bytes": os.path.getsize(path),
        "save_ms": int((time.monotonic() - t0) * 1000),
    }


def _env_number(name, default, kind=int):
    value = os.environ.get(name, "").strip()
    try:
        return kind(value) if value else default
    except ValueError:
        return default
