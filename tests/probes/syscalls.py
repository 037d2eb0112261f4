#!/usr/bin/env python3
"""Asks the kernel for what the sandbox policy refuses, and prints each answer (`ok` or
the errno's name) as JSON: {"denied": {...}, "unlisted": {...}, "ioctls": {...},
"allowed": {...}}.

    syscalls.py all        every section (inside a sandbox: the denied calls would act)
    syscalls.py control    only what is harmless unconfined (unlisted calls, ioctls on a
                           scratch file of its own, allowed calls), to run on the host:
                           there none of them may answer EPERM or ENOSYS, so the test
                           shows the sandbox's answers come from its policy
"""

import ctypes
import errno
import json
import os
import socket
import struct
import sys
import tempfile

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
buf = ctypes.create_string_buffer(4096)


def answer(r):
    return "ok" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")


def call(nr, *args):
    ctypes.set_errno(0)
    return answer(libc.syscall(ctypes.c_long(nr), *args))


def ioctl(fd, request, arg):
    ctypes.set_errno(0)
    return answer(libc.ioctl(ctypes.c_int(fd), ctypes.c_ulong(request), arg))


def denied():
    """The dangerous set (x86_64 numbers): refused with EPERM whatever the arguments."""
    return {
        "io_uring_setup": call(425, 8, buf),
        "bpf": call(321, 0, buf, 128),
        "perf_event_open": call(298, buf, 0, -1, -1, 0),
        "keyctl": call(250, 0, 0),
        "add_key": call(248, b"user", b"k", b"v", 1, -2),
        "unshare": call(272, 0x10000000),
        "setns": call(308, 0, 0),
        "mount": call(165, b"none", b"/tmp", b"tmpfs", 0, None),
        "open_by_handle_at": call(304, -100, buf, 0),
        "name_to_handle_at": call(303, -100, b"/", buf, buf, 0),
        "userfaultfd": call(323, 0),
        "kexec_load": call(246, 0, 0, None, 0),
        "fsopen": call(430, b"tmpfs", 0),
        "clone_newuser": call(56, 0x10000000 | 17, 0, 0, 0, 0),
        "socket_vsock": sock(40),
    }


def sock(family):
    try:
        socket.socket(family, socket.SOCK_STREAM).close()
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, "?")


def unlisted():
    """Harmless calls no sandbox needs: outside the allowlist, answered ENOSYS."""
    pid = os.getpid()
    return {
        "kcmp": call(312, pid, pid, 1, 0, 0),  # KCMP_VM of itself with itself
        "move_pages": call(279, 0, 0, None, None, None, 0),
        "modify_ldt": call(154, 0, buf, 16),  # read the (empty) LDT
    }


def ioctls(scratch):
    """File system ioctls on files of the writable layer: refused with EPERM."""
    a = os.open(os.path.join(scratch, "a"), os.O_RDWR | os.O_CREAT, 0o600)
    b = os.open(os.path.join(scratch, "b"), os.O_RDWR | os.O_CREAT, 0o600)
    os.write(a, b"x" * 65536)
    os.fsync(a)
    flags = ctypes.c_long(0)
    # struct fiemap with room for no extents: start, length, flags, mapped, count, reserved.
    fiemap = ctypes.create_string_buffer(struct.pack("QQIIII", 0, 2**64 - 1, 0, 0, 0, 0))
    # struct file_dedupe_range with one destination.
    dedupe = ctypes.create_string_buffer(
        struct.pack("QQHHI", 0, 4096, 1, 0, 0) + struct.pack("qQqii", b, 0, 0, 0, 0)
    )
    # struct move_extent: reserved, donor_fd, orig_start, donor_start, len, moved_len.
    move = ctypes.create_string_buffer(struct.pack("IIQQQQ", 0, b, 0, 0, 1, 0))
    ioctl(a, 0x80086601, ctypes.byref(flags))  # FS_IOC_GETFLAGS: set what is there
    r, w = os.pipe()
    out = {
        "FICLONE": ioctl(b, 0x40049409, ctypes.c_long(a)),
        "FIDEDUPERANGE": ioctl(a, 0xC0189436, dedupe),
        "FS_IOC_FIEMAP": ioctl(a, 0xC020660B, fiemap),
        "FS_IOC_SETFLAGS": ioctl(a, 0x40086602, ctypes.byref(flags)),
        "EXT4_IOC_MOVE_EXT": ioctl(a, 0xC028660F, move),
        "XFS_IOC_SWAPEXT": ioctl(a, 0xC0C0586D, buf),
        "TIOCSTI": ioctl(r, 0x5412, b"x"),
    }
    for fd in (a, b, r, w):
        os.close(fd)
    return out


def allowed(scratch):
    """Calls the policy keeps: they must reach the kernel."""
    a = os.open(os.path.join(scratch, "a"), os.O_RDONLY)
    flags = ctypes.c_long(0)
    out = {
        "FS_IOC_GETFLAGS": ioctl(a, 0x80086601, ctypes.byref(flags)),
        "FIONREAD": ioctl(a, 0x541B, ctypes.byref(flags)),
        "socket_unix": sock(socket.AF_UNIX),
        "getrandom": call(318, buf, 16, 0),
    }
    os.close(a)
    return out


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "all"
    # /var/tmp is on the writable layer in a sandbox (not a tmpfs: ioctls reach its fs).
    scratch = tempfile.mkdtemp(dir="/var/tmp")
    report = {"unlisted": unlisted(), "ioctls": ioctls(scratch), "allowed": allowed(scratch)}
    if mode == "all":
        report["denied"] = denied()
    for name in os.listdir(scratch):
        os.unlink(os.path.join(scratch, name))
    os.rmdir(scratch)
    print(json.dumps(report))


main()
