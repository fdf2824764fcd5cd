# Holds N open files (struct file) of the host's global file table (fs.file-max) without
# holding their descriptors: each is mapped, then its descriptor closed (the mapping keeps the
# file). RLIMIT_NOFILE (4096) does not count them; vm.max_map_count (65530) is per process,
# so a few processes share the work. Prints the host-wide count (fs.file-nr) before and after.
import ctypes, os, sys, time
N = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
PER_PROC = 60_000
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
open("/tmp/f", "wb").write(b"x" * 4096)
def nr():
    return int(open("/proc/sys/fs/file-nr").read().split()[0])
before = nr()
r, w = os.pipe()
kids = []
left = N
while left > 0:
    n = min(PER_PROC, left); left -= n
    pid = os.fork()
    if pid == 0:
        os.close(r)
        held = 0
        for _ in range(n):
            fd = os.open("/tmp/f", os.O_RDONLY)
            if libc.mmap(None, 4096, 1, 2, fd, 0) in (None, ctypes.c_void_p(-1).value):
                break
            os.close(fd)
            held += 1
        os.write(w, b"%d\n" % held)
        time.sleep(5)
        os._exit(0)
    kids.append(pid)
os.close(w)
held = sum(int(x) for x in os.fdopen(r).read().split())
print("files held", held, "host file-nr before", before, "after", nr(), "file-max", open("/proc/sys/fs/file-max").read().strip())
for k in kids:
    os.waitpid(k, 0)
