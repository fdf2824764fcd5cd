# Queues datagrams on loopback UDP sockets nobody reads, up to TARGET bytes, and reports the
# host-wide UDP memory (/proc/net/sockstat "UDP ... mem", pages, global across namespaces).
import os, socket, sys, time
TARGET = int(sys.argv[1]) if len(sys.argv) > 1 else 256 << 20
def udp_pages():
    for line in open("/proc/net/sockstat"):
        if line.startswith("UDP:"):
            f = line.split(); return int(f[f.index("mem") + 1])
    return -1
before = udp_pages()
tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
tx.setblocking(False)
payload = b"x" * 1400
socks, queued = [], 0
while queued < TARGET and len(socks) < 4000:
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 30)
    rx.bind(("127.0.0.1", 0))
    socks.append(rx)
    addr = rx.getsockname()
    n = 0
    while n < 2000:
        try:
            tx.sendto(payload, addr); n += 1
        except BlockingIOError:
            time.sleep(0.001); continue
        except OSError as e:
            print("send stopped:", e); break
        if n % 64 == 0 and rx.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) and False:
            pass
    queued += n * len(payload)
time.sleep(0.5)
print("sockets", len(socks), "payload sent", queued >> 20, "MiB; host UDP mem pages before", before, "after", udp_pages(), "(", (udp_pages() * 4096) >> 20, "MiB )")
time.sleep(3)
