# Opens N pseudo-terminals through the sandbox's own devpts instance and reports the host-wide
# count (kernel.pty.nr): every devpts instance but the host's shares pty.max - pty.reserve.
import os, sys, time
N = int(sys.argv[1]) if len(sys.argv) > 1 else 500
nr = lambda: open("/proc/sys/kernel/pty/nr").read().strip()
before = nr()
held = []
try:
    for _ in range(N):
        held.append(os.openpty())
except OSError as e:
    print("stopped:", e)
print("ptys held", len(held), "host pty.nr before", before, "after", nr(), "max", open("/proc/sys/kernel/pty/max").read().strip(), "reserve", open("/proc/sys/kernel/pty/reserve").read().strip())
time.sleep(3)
