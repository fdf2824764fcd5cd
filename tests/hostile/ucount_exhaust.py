# Exhaust the per-user kernel counters a sandbox can reach (inotify instances and watches,
# queued signals, POSIX message queues), then hold them. Right: the
# sandbox hits its own limits; host root and other sandboxes are unaffected (the kernel
# charges these to the user namespace's owner, a uid of this sandbox's slot).
import ctypes, errno, os, signal, time
libc = ctypes.CDLL(None, use_errno=True)
def err():
    return errno.errorcode.get(ctypes.get_errno(), "?")
fds = []
while True:
    fd = libc.inotify_init1(0)
    if fd < 0:
        print("inotify instances", len(fds), err())
        break
    fds.append(fd)
os.makedirs("/tmp/w", exist_ok=True)
for i in range(2000):
    open("/tmp/w/%d" % i, "w").close()
watches = 0
done = False
for fd in fds:
    for i in range(2000):
        if libc.inotify_add_watch(fd, ("/tmp/w/%d" % i).encode(), 0x2) < 0:
            done = True
            break
        watches += 1
    if done or watches >= 300000:
        break
print("inotify watches", watches, err() if done else "cap")
class sigval(ctypes.Union):
    _fields_ = [("i", ctypes.c_int), ("p", ctypes.c_void_p)]
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])
queued = 0
while libc.sigqueue(os.getpid(), signal.SIGRTMIN, sigval(0)) == 0:
    queued += 1
print("queued signals", queued, err())
rt = ctypes.CDLL("librt.so.1", use_errno=True)
rt.mq_open.restype = ctypes.c_int
queues = 0
while rt.mq_open(("/q%d" % queues).encode(), os.O_CREAT | os.O_RDWR, 0o600, None) >= 0:
    queues += 1
print("message queues", queues, err())
print("holding", flush=True)
time.sleep(10)
