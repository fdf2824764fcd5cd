# expect: statx asking for the unique mount id (STATX_MNT_ID_UNIQUE, 0x4000: a host-wide counter
# that rises with every mount of every other sandbox) fails with EINVAL, alone or with other
# bits; os.stat, and statx with the basic mask or the reused mount id (STATX_MNT_ID), work.
import ctypes, errno, os

libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100
STATX_BASIC_STATS, STATX_MNT_ID, STATX_MNT_ID_UNIQUE = 0x7FF, 0x1000, 0x4000
buf = ctypes.create_string_buffer(256)


def statx(mask):
    ctypes.set_errno(0)
    r = libc.statx(AT_FDCWD, b"/work", 0, mask, buf)
    got = int.from_bytes(buf.raw[0:4], "little")  # stx_mask: what the kernel filled in
    return r, errno.errorcode.get(ctypes.get_errno(), "-") if r else bool(got & mask == mask)


print("os.stat", os.stat("/work").st_ino > 0, os.lstat("/proc/self").st_mode != 0)
print("statx basic", *statx(STATX_BASIC_STATS))
print("statx mnt_id", *statx(STATX_BASIC_STATS | STATX_MNT_ID))
print("statx mnt_id_unique", *statx(STATX_MNT_ID_UNIQUE))
print("statx basic+mnt_id_unique", *statx(STATX_BASIC_STATS | STATX_MNT_ID_UNIQUE))
