import json
import os
import socket
import struct

import pytest

from sandq_nb import template


def test_tmp_snapshot_is_copied_into_an_empty_tmp(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "matplotlib").mkdir(parents=True)
    (src / ".ipython" / "profile_default").mkdir(parents=True)
    (src / "matplotlib" / "fontlist.json").write_bytes(b'{"fonts": []}')
    os.chmod(src / "matplotlib", 0o700)
    os.symlink("/etc/passwd", src / "link")  # never copied
    dst.mkdir()
    template._restore_tmp(str(dst), template._snapshot_tmp(str(src)))
    found = sorted(str(p.relative_to(dst)) for p in dst.rglob("*"))
    assert found == [".ipython", ".ipython/profile_default", "matplotlib", "matplotlib/fontlist.json"]
    assert (dst / "matplotlib" / "fontlist.json").read_bytes() == b'{"fonts": []}'
    assert (dst / "matplotlib").stat().st_mode & 0o777 == 0o700


def test_restore_never_follows_a_planted_link(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src).mkdir()
    (src / "f").write_bytes(b"x")
    dst.mkdir()
    target = tmp_path / "outside"
    os.symlink(target, dst / "f")
    with pytest.raises(FileExistsError):
        template._restore_tmp(str(dst), template._snapshot_tmp(str(src)))
    assert not target.exists()


def test_snapshot_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(template, "MAX_TMP_BYTES", 10)
    (tmp_path / "a").write_bytes(b"123456")
    (tmp_path / "b").write_bytes(b"123456")
    entries = template._snapshot_tmp(str(tmp_path))
    assert sum(len(data) for _, _, data in entries if data is not None) <= 10
    assert len([e for e in entries if e[2] is not None]) == 1


def test_request_is_read_with_its_descriptors():
    left, right = socket.socketpair()
    r, w = os.pipe()
    body = json.dumps({"namespaces": [], "uid": 1000}).encode()
    socket.send_fds(left, [struct.pack("<I", len(body)) + body[:5]], [r])
    left.sendall(body[5:])
    request, fds = template._recv_request(right)
    assert request == {"namespaces": [], "uid": 1000}
    assert len(fds) == 1
    os.write(w, b"z")
    assert os.read(fds[0], 1) == b"z"
    for fd in (r, w, fds[0]):
        os.close(fd)
    left.close()
    right.close()


def test_oversize_request_is_refused():
    left, right = socket.socketpair()
    left.sendall(struct.pack("<I", template.MAX_REQUEST + 1))
    with pytest.raises(ValueError):
        template._recv_request(right)
    left.close()
    right.close()
