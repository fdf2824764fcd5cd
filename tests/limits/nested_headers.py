#!/usr/bin/env python3
"""Probe of the AMQP header parser's depth: publishes one message whose AMQP `headers` property nests field
tables DEPTH deep (7 bytes a level; the whole content header must fit one frame), with a raw
AMQP 0-9-1 client (no library: an encoder that recurses would overflow first). A worker must
survive it (limits::a_message_with_deeply_nested_headers_does_not_stop_the_worker runs it).

Usage: nested_headers.py HOST PORT EXCHANGE ROUTING_KEY DEPTH [BODY_FILE]
"""
import socket, struct, sys

host, port, exchange, key, depth = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
body = open(sys.argv[6], "rb").read() if len(sys.argv) > 6 else b"x"

def shortstr(s): b = s.encode(); return bytes([len(b)]) + b
def longstr(b): return struct.pack(">I", len(b)) + b
def frame(kind, channel, payload): return struct.pack(">BHI", kind, channel, len(payload)) + payload + b"\xce"
def method(channel, cls, mth, args=b""): return frame(1, channel, struct.pack(">HH", cls, mth) + args)

sock = socket.create_connection((host, port))
buf = b""
def read_frame():
    global buf
    while True:
        if len(buf) >= 7:
            kind, ch, size = struct.unpack(">BHI", buf[:7])
            if len(buf) >= 7 + size + 1:
                payload = buf[7:7 + size]; buf = buf[8 + size:]
                return kind, ch, payload
        data = sock.recv(65536)
        if not data: raise SystemExit("connection closed by the broker")
        buf += data
def expect(cls, mth):
    while True:
        kind, ch, payload = read_frame()
        if kind == 1:
            c, m = struct.unpack(">HH", payload[:4])
            if (c, m) == (cls, mth): return payload[4:]
            if (c, m) in ((10, 50), (20, 40)): raise SystemExit(f"closed by the broker: {payload[6:6+payload[6]+1]!r}")

sock.sendall(b"AMQP\x00\x00\x09\x01")
expect(10, 10)
sock.sendall(method(0, 10, 11, struct.pack(">I", 0) + shortstr("PLAIN") + longstr(b"\0guest\0guest") + shortstr("en_US")))
tune = expect(10, 30)
channel_max, frame_max, _ = struct.unpack(">HIH", tune[:8])
sock.sendall(method(0, 10, 31, struct.pack(">HIH", channel_max, frame_max, 0)))
sock.sendall(method(0, 10, 40, shortstr("/") + shortstr("") + b"\x00"))
expect(10, 41)
sock.sendall(method(1, 20, 10, shortstr("")))
expect(20, 11)

table = struct.pack(">I", 0)  # the innermost, empty table
for _ in range(depth):
    entry = shortstr("a") + b"F" + table
    table = struct.pack(">I", len(entry)) + entry
import os
if os.environ.get("RAW_TABLE_HEX"):  # a table's content given as hex (its length is added)
    raw = bytes.fromhex(os.environ["RAW_TABLE_HEX"])
    table = struct.pack(">I", len(raw)) + raw
props = table + b"\x02"  # headers, then delivery-mode 2
header = struct.pack(">HHQH", 60, 0, len(body), 0x2000 | 0x1000) + props
if len(header) + 8 > frame_max:
    raise SystemExit(f"depth {depth}: a content header of {len(header)} bytes does not fit a frame of {frame_max}")
sock.sendall(method(1, 60, 40, struct.pack(">H", 0) + shortstr(exchange) + shortstr(key) + b"\x00"))
sock.sendall(frame(2, 1, header))
for at in range(0, len(body), frame_max - 8):
    sock.sendall(frame(3, 1, body[at:at + frame_max - 8]))
sock.sendall(method(0, 10, 50, struct.pack(">H", 200) + shortstr("bye") + struct.pack(">HH", 0, 0)))
try:
    expect(10, 51)
    print(f"published: depth {depth}, content header {len(header)} bytes (frame_max {frame_max})")
except SystemExit as e:
    print(f"depth {depth}: {e}")
