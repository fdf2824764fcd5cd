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

    b"SANDQ-STATE-2\\n", then per variable: name length (u32 LE), name (UTF-8), payload
    length (u64 LE), memo positions the pickler had used after it (u64 LE), payload (one
    pickle of the shared pickler); a record with an empty name and payload resets the memo
    (the pickler cleared its own after a value failed to save)

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
_RECORD = struct.Struct("<QQ")  # payload length, memo positions used after the record
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


class _Lost:
    """Stands in the unpickler's memo for what a record that could not be restored would have
    put there, so that the records after it keep their memo positions. No record that refers
    to one is ever loaded (see _refers_to)."""


_GETS = {"GET", "BINGET", "LONG_BINGET"}
_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}
# Opcodes that push a plain value given in the opcode itself (a string, bytes, a number).
_LITERALS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING",
             "SHORT_BINBYTES", "BINBYTES", "BINBYTES8", "BININT", "BININT1", "BININT2", "INT", "LONG", "LONG1",
             "BINFLOAT", "FLOAT"}


def _resolve_global(module, name):
    """The global `module.name` (dotted names walked), as pickle's find_class finds it."""
    import importlib
    value = importlib.import_module(module)
    for part in name.split("."):
        value = getattr(value, part)
    return value


def _memo_of(payload, start, memo):
    """What a record that is not restored would have put in the memo, from its opcodes:
    {position: value} for plain values (strings such as module and class names, numbers) and
    for globals fetched by name (`builtins.int`, a module's function), which later records may
    fetch without sharing anything with the lost variable; and the set of the other positions
    (objects it would have built: lost). `memo`: the values already known, by position."""
    import pickletools
    known, lost, position = {}, set(), start
    recent = []  # the top of the stack, as far as these opcodes tell it (None: unknown)
    missing = object()
    try:
        for op, arg, _ in pickletools.genops(payload):
            name = op.name
            if name == "MEMOIZE" or name in _PUTS:
                index = position if name == "MEMOIZE" else int(arg)
                value = recent[-1] if recent else missing
                if value is missing:
                    lost.add(index)
                else:
                    known[index] = value
                position = max(position, index + 1)
            elif name in _LITERALS:
                recent.append(arg)
            elif name in _GETS:
                index = int(arg)
                recent.append(known[index] if index in known else memo.get(index, missing) if index not in lost else missing)
            elif name == "STACK_GLOBAL" and len(recent) >= 2 and all(isinstance(v, str) for v in recent[-2:]):
                module, qualname = recent[-2:]
                del recent[-2:]
                try:
                    recent.append(_resolve_global(module, qualname))
                except Exception:
                    recent.append(missing)
            elif name == "GLOBAL" and isinstance(arg, str) and " " in arg:
                try:
                    recent.append(_resolve_global(*arg.split(" ", 1)))
                except Exception:
                    recent.append(missing)
            elif name in ("PROTO", "FRAME"):
                continue
            else:
                recent = [missing]
    except Exception:
        pass
    return known, lost


def _no_persistent_ids(pid):
    import pickle
    raise pickle.UnpicklingError("a saved state has no persistent ids")


def _fresh_unpickler(records, memo, size):
    """A new unpickler on `records` whose memo holds `memo` at positions 0..size-1 (all
    present), its next MEMOIZE at `size`. (Assigning `Unpickler.memo` does not do this: the C
    unpickler keeps writing from its own count.) A tiny pickle fetches each value by a
    persistent id and memoizes it, in order."""
    import io
    import pickle
    import struct as _struct
    unpickler = pickle.Unpickler(records)
    if size:
        values = [memo[index] for index in range(size)]
        unpickler.persistent_load = values.__getitem__
        prime = b"\x80\x05" + b"".join(b"J" + _struct.pack("<i", i) + b"Q\x940" for i in range(size)) + b"N."
        saved_file, saved_left = records.f, records.left
        records.f, records.left = io.BytesIO(prime), len(prime)
        try:
            unpickler.load()
        finally:
            records.f, records.left = saved_file, saved_left
            unpickler.persistent_load = _no_persistent_ids
    return unpickler


def _refers_to(payload, lost):
    """Whether the pickle `payload` (one record) fetches a memo position in `lost`."""
    import pickletools
    try:
        for op, arg, _ in pickletools.genops(payload):
            if op.name in _GETS and int(arg) in lost:
                return True
    except Exception:
        return True
    return False


def load_state(ns, path, seconds=30.0, variable_seconds=10.0):
    """Loads the state at `path` into `ns`, within `seconds` in all and `variable_seconds` a
    variable; returns (restored count, [{name, reason} not restored]).

    The records share one unpickler (and so its memo: shared objects stay shared). Each record
    says how many memo entries the pickler had after it; when a record cannot be restored, the
    entries it would have made are marked lost, and a later record that refers to one is
    dropped too (it shared an object with the lost one), never loaded with a wrong object."""
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
        memo_len, lost = 0, set()
        deadline = time.monotonic() + seconds
        _LOADING_INTO = ns

        def skip(name, reason, memo_after, payload):
            """Drops this record and goes on after it: the memo gets the plain values the record
            would have made, and its other positions are lost (a later record that fetches one
            is dropped too, never loaded with a wrong object)."""
            nonlocal unpickler, memo_len
            not_restored.append({"name": name, "reason": reason})
            records.skip_rest()
            memo = unpickler.memo.copy()
            known, gone = _memo_of(payload, memo_len, memo)
            for index in range(memo_len, memo_after):
                if index in known:
                    memo[index] = known[index]
                else:
                    memo[index] = _Lost
                    lost.add(index)
            lost.update(index for index in gone if index >= memo_after)
            for index in range(memo_after):
                memo.setdefault(index, _Lost)
            unpickler = _fresh_unpickler(records, memo, memo_after)
            memo_len = memo_after

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
                        payload_len, memo_after = _RECORD.unpack(f.read(_RECORD.size))
                    except Exception as exc:
                        not_restored.append({"name": "*", "reason": "the rest of the saved state is unreadable: " + _reason(exc)})
                        break
                    records.left = payload_len
                    if not name:
                        # A reset: the pickler cleared its memo here (a value failed while saved).
                        records.skip_rest()
                        unpickler = pickle.Unpickler(records)
                        memo_len, lost = 0, set()
                        continue
                    start = f.tell()

                    def payload():
                        """The record's bytes (read again only when a record is dropped)."""
                        here = f.tell()
                        f.seek(start)
                        data = f.read(payload_len)
                        f.seek(here)
                        return data

                    left = deadline - time.monotonic()
                    if left <= 0:
                        skip(name, "over the restore time limit of %gs" % seconds, memo_after, payload())
                        continue
                    if lost and _refers_to(payload(), lost):
                        skip(name, "it shares objects with a variable that could not be restored", memo_after, payload())
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
                        else:
                            reason = _reason(exc)
                        skip(name, reason, memo_after, payload())
                        continue
                    memo_len = memo_after
                    _share_code_names(value)
                    ns[name] = value
                    restored += 1
        finally:
            _LOADING_INTO = None
        return restored, not_restored


def _share_code_names(value):
    """Points a restored function's `__name__` and `__qualname__` (and those of a restored
    class's functions) back at its code's `co_name` and `co_qualname`, as `def` leaves them.

    cloudpickle sets them from strings of their own while the code object interns its copies;
    the pickler's memo goes by identity, so an untouched function saved again would write its
    name twice where the first save wrote it once, and an unchanged state would not compare
    equal (test: test_a_restored_state_saved_again_untouched_is_the_same_bytes)."""
    import types

    functions = [value]
    if isinstance(value, type):
        functions = list(vars(value).values())
    for function in functions:
        if not isinstance(function, types.FunctionType):
            continue
        code = function.__code__
        if function.__name__ == code.co_name:
            function.__name__ = code.co_name
        qualname = getattr(code, "co_qualname", None)
        if qualname is not None and function.__qualname__ == qualname:
            function.__qualname__ = qualname


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
                capped.write(_NAME.pack(len(encoded)) + encoded + _RECORD.pack(0, 0))
                body = f.tell()
                pickler.dump(value)
                # The memo positions the pickler has used so far (the loader keeps them aligned
                # when a record cannot be restored): one more than the newest.
                memo_after = 1 + max((index for index, _ in pickler.memo.copy().values()), default=-1)
            except BaseException as exc:  # anything the object's __reduce__ raises
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                reason = ("over the size cap of %d bytes" % limit) if isinstance(exc, _StateTooLarge) else _reason(exc)
                unsaved.append({"name": name, "reason": reason})
                f.seek(start)
                f.truncate()
                capped.left = limit - start
                # What the failed record memoized was cut with it: the pickler starts a new memo,
                # and a reset record (no name) tells the loader to do the same.
                pickler.clear_memo()
                try:
                    capped.write(_NAME.pack(0) + _RECORD.pack(0, 0))
                except _StateTooLarge:
                    f.seek(start)
                    f.truncate()
                    capped.left = limit - start
                    break
                continue
            end = f.tell()
            f.seek(body - _RECORD.size)
            f.write(_RECORD.pack(end - body, memo_after))
            f.seek(end)
            saved.append(name)
    os.replace(tmp, path)
    return {
        "variables": saved[:_STATE_MAX_LISTED],
        "unsaved": unsaved[:_STATE_MAX_UNSAVED_LISTED],
        "bytes": os.path.getsize(path),
        "save_ms": int((time.monotonic() - t0) * 1000),
    }


def same_file(a, b, chunk=1 << 20):
    """Whether the files `a` and `b` hold the same bytes (sizes first, then 1 MiB at a time)."""
    try:
        if os.path.getsize(a) != os.path.getsize(b):
            return False
        with open(a, "rb") as fa, open(b, "rb") as fb:
            while True:
                x, y = fa.read(chunk), fb.read(chunk)
                if x != y:
                    return False
                if not x:
                    return True
    except OSError:
        return False


def _env_number(name, default, kind=int):
    value = os.environ.get(name, "").strip()
    try:
        return kind(value) if value else default
    except ValueError:
        return default
