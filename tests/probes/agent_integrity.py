#!/usr/bin/env python3
"""A hostile sandbox command: tries every way we know to take over the in-sandbox agent
(the process that reports each exec's output and exit status to the host) or another
exec's processes, and reports what worked.

    agent_integrity.py scan               one pass; the JSON report on stdout
    agent_integrity.py attack SECS FILE   keep attacking (while the host runs its execs)
                                          until FILE.stop exists or SECS seconds pass;
                                          the JSON report into FILE
    agent_integrity.py selftest           the control: ptrace of its own child works

A finding is an attack that worked. The report also carries what the probe could read
(/proc/1/cmdline, its own mountinfo, cgroup, environment), so the test can check that
nothing of the host's layout shows.
"""

import ctypes
import json
import os
import signal
import socket
import stat
import sys
import time

# First, before this script opens anything: the descriptors it inherited.
INHERITED = []
for name in os.listdir("/proc/self/fd"):
    fd = int(name)
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        continue  # the directory listing's own descriptor, already closed
    if fd > 2:
        INHERITED.append((fd, target))

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
LIBC.ptrace.restype = ctypes.c_long
PTRACE_SEIZE = 0x4206
PTRACE_DETACH = 17

findings = []
seen = set()


def finding(kind, detail):
    key = (kind, detail)
    if key not in seen:
        seen.add(key)
        findings.append({"kind": kind, "detail": detail})


def read(path, limit=65536):
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError as e:
        return e


def stat_fields(pid):
    data = read(f"/proc/{pid}/stat")
    if isinstance(data, Exception):
        return None
    text = data.decode(errors="replace")
    return text[text.rfind(")") + 2:].split()


def ppid_of(pid):
    f = stat_fields(pid)
    return int(f[1]) if f else None


def mine(pid):
    """The probe itself, or one of its descendants."""
    me = os.getpid()
    seen_chain = set()
    while pid and pid not in seen_chain:
        if pid == me:
            return True
        seen_chain.add(pid)
        pid = ppid_of(pid)
    return False


def pids():
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def cmdline(pid):
    data = read(f"/proc/{pid}/cmdline", 200)
    return "" if isinstance(data, Exception) else data.replace(b"\0", b" ").decode(errors="replace").strip()


def attack_processes():
    for pid in pids():
        if mine(pid):
            continue
        who = f"pid {pid} ({cmdline(pid) or '?'})"
        if LIBC.ptrace(PTRACE_SEIZE, pid, None, None) == 0:
            finding("ptrace", who)
            LIBC.ptrace(PTRACE_DETACH, pid, None, None)
        env = read(f"/proc/{pid}/environ")
        if not isinstance(env, Exception) and len(env) > 0:
            finding("environ", who)
        fields = stat_fields(pid)
        # startcode: 0 for a kernel thread, 1 to whoever may not ptrace-read the process
        # (Linux 5.6+), the real address otherwise.
        start = int(fields[24]) if fields and len(fields) > 24 and fields[24].isdigit() else 0
        if start > 1:
            finding("stat-startcode", who)
        try:
            fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
            os.close(fd)
            if start:
                finding("mem", who)
        except OSError:
            pass
        try:
            for name in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{name}")
                finding("fd-readlink", f"{who}: {name} -> {target}")
                break
        except OSError:
            pass


def attack_init():
    """Signals to the agent: a stopped or dead agent answers no host."""
    for sig in (signal.SIGSTOP, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL):
        try:
            os.kill(1, sig)
        except OSError:
            continue
        fields = stat_fields(1)
        if fields is None or fields[0] in ("T", "t", "Z", "X"):
            finding("signal-init", f"signal {int(sig)} stopped or ended pid 1")
    try:
        os.kill(1, signal.SIGCONT)
    except OSError:
        pass


def attack_descriptors():
    for fd, target in INHERITED:
        finding("inherited-fd", f"{fd} -> {target}")
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            s.setblocking(False)
            conn, _ = s.accept()
            finding("accepted", f"a connection on inherited fd {fd}")
            # Answer like a forged agent would, then drop it.
            try:
                body = b'{"op":"welcome","version":2,"proof":""}'
                conn.sendall(b"\x00" + len(body).to_bytes(4, "little") + body)
            except OSError:
                pass
            conn.close()
        except OSError:
            pass
        finally:
            s.detach()


def reachable_sockets():
    """Unix sockets visible anywhere in the sandbox's usual places, and whether they
    accept a connection."""
    out = []
    for top in ("/", "/run", "/tmp", "/var/run", "/dev", "/.strata", "/etc", "/work"):
        try:
            entries = os.scandir(top)
        except OSError:
            continue
        for e in entries:
            try:
                if stat.S_ISSOCK(e.stat(follow_symlinks=False).st_mode):
                    out.append(e.path)
            except OSError:
                pass
    for path in out:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(1)
        try:
            s.connect(path)
            finding("socket-connect", path)
        except OSError:
            pass
        finally:
            s.close()


def devices():
    try:
        names = os.listdir("/dev")
    except OSError:
        return
    for name in names:
        path = f"/dev/{name}"
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISBLK(st.st_mode):
            finding("block-device", path)
        if name.startswith(("vport", "hvc", "mem", "kmem", "port", "kmsg", "console")):
            finding("host-channel-device", path)


def readable():
    def text(path):
        data = read(path)
        return f"<{data.strerror}>" if isinstance(data, OSError) else data.decode(errors="replace")

    return {
        "/proc/1/cmdline": text("/proc/1/cmdline").replace("\0", " "),
        "/proc/1/environ": text("/proc/1/environ").replace("\0", " "),
        "/proc/1/maps": text("/proc/1/maps")[:2000],
        "/proc/self/mountinfo": text("/proc/self/mountinfo"),
        "/proc/self/cgroup": text("/proc/self/cgroup"),
        "/proc/self/environ": text("/proc/self/environ").replace("\0", " "),
        "/proc/cmdline": text("/proc/cmdline"),
    }


def one_pass():
    attack_descriptors()
    attack_processes()
    attack_init()
    reachable_sockets()
    devices()


def report(passes):
    return {
        "pid": os.getpid(),
        "uid": os.getuid(),
        "passes": passes,
        "findings": findings,
        "readable": readable(),
    }


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "scan":
        one_pass()
        json.dump(report(1), sys.stdout)
        return
    if len(sys.argv) == 4 and sys.argv[1] == "attack":
        until = time.monotonic() + float(sys.argv[2])
        passes = 0
        while time.monotonic() < until and not os.path.exists(sys.argv[3] + ".stop"):
            one_pass()
            passes += 1
            time.sleep(0.01)
        tmp = sys.argv[3] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report(passes), f)
        os.rename(tmp, sys.argv[3])
        return
    if len(sys.argv) == 2 and sys.argv[1] == "selftest":
        # What the probe's attacks do is allowed on a process of the command's own: a
        # debugger or strace keeps working, and the probe's machinery is sound.
        child = os.fork()
        if child == 0:
            time.sleep(30)
            os._exit(0)
        try:
            ok = LIBC.ptrace(PTRACE_SEIZE, child, None, None) == 0
            err = ctypes.get_errno()
            fields = stat_fields(child)
            env = read(f"/proc/{child}/environ")
            readable = not isinstance(env, Exception) and len(env) > 0
            print(json.dumps({"ptrace": ok, "errno": err, "environ": readable,
                              "startcode": int(fields[24]) if fields else 0}))
        finally:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
        return
    sys.exit(__doc__)


if __name__ == "__main__":
    main()
