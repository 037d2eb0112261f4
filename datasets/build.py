#!/usr/bin/env python3
"""Builds the whole dataset into the store and registers it in the catalog.

The Debian base (registered alone as datasets/debian), the toolkits (pytest by pip, Rust by
apt, in build steps over it), and one workspace layer per entry of
workspaces/workspaces.toml: the project's source release fetched from PyPI or the crate
registry into cache/sources/ (checked against the recorded sha256, never downloaded
twice), unpacked, and built into a layer at /work.
Each is registered as datasets/<name>@<version> with the project's test command.

  build.py [--strata BIN] [--only NAME] [--baseline]

--baseline also runs every workspace's test suite in a container and writes
baselines/<name>-<version>.txt: one line per test, PASSED / FAILED / ERROR / SKIPPED
(upstream failures are recorded, not hidden). The store is the CLI's (STRATA_STORE).
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE = os.path.join(HERE, "cache")
PYPI_SIMPLE = "https://pypi.org/simple/{}/"
CRATES = "https://static.crates.io/crates/{}/{}"

# Per toolkit: its definition and the environment its workspaces run with.
TOOLKITS = {
    "pytest": {
        "definition": os.path.join(HERE, "toolkits", "pytest", "toolkit.toml"),
        "env": {
            "LANG": "C.UTF-8",
            "PYTHONPATH": "/opt/strata-toolkit/site-packages:/work:/work/src",
            "PATH": "/opt/strata-toolkit/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "PYTHONDONTWRITEBYTECODE": "1",
        },
        "test": "test",
        "layer_prefix": "pypi",
    },
    "rust": {
        "definition": os.path.join(HERE, "toolkits", "rust", "toolkit.toml"),
        "env": {"LANG": "C.UTF-8", "CARGO_NET_OFFLINE": "true", "CARGO_TERM_COLOR": "never"},
        "test": "rust_test",
        "layer_prefix": "crates",
    },
}


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def strata(bin_, *args, capture=True):
    r = subprocess.run([bin_, *args], stdout=subprocess.PIPE if capture else None, text=True)
    if r.returncode != 0:
        sys.exit(f"strata {' '.join(args)} failed with status {r.returncode}")
    return r.stdout if capture else ""


def last_line(text):
    return text.strip().splitlines()[-1].strip()


def fetch(ws):
    """The release tarball, from the cache or PyPI, checked against its sha256."""
    sources = os.path.join(CACHE, "sources")
    os.makedirs(sources, exist_ok=True)
    filename = ws.get("pypi") or ws["crate"]
    path = os.path.join(sources, filename)
    if os.path.exists(path):
        data = open(path, "rb").read()
    elif "crate" in ws:
        log(f"fetching {filename}")
        url = CRATES.format(ws["name"], filename)
        data = urllib.request.urlopen(url, timeout=300).read()
    else:
        req = urllib.request.Request(
            PYPI_SIMPLE.format(ws["name"]),
            headers={"Accept": "application/vnd.pypi.simple.v1+json"},
        )
        index = json.load(urllib.request.urlopen(req, timeout=60))
        files = [f for f in index["files"] if f["filename"] == ws["pypi"]]
        if not files:
            sys.exit(f"{ws['pypi']} is not on PyPI's index for {ws['name']}")
        log(f"fetching {ws['pypi']}")
        data = urllib.request.urlopen(files[0]["url"], timeout=300).read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != ws["sha256"]:
        sys.exit(
            f"{filename}: sha256 {digest} differs from the recorded {ws['sha256']} "
            f"(delete {path} to fetch it again)"
        )
    if not os.path.exists(path):
        with open(path + ".partial", "wb") as f:
            f.write(data)
        os.replace(path + ".partial", path)
    return path


def unpack(ws, tarball):
    """The release's tree without its top directory, unpacked once."""
    dest = os.path.join(CACHE, "workspaces", f"{ws['name']}-{ws['version']}")
    if os.path.exists(os.path.join(dest, ".complete")):
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    partial = dest + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    with tarfile.open(tarball) as tar:
        members = tar.getmembers()
        for m in members:
            # What tarfile's "data" filter refuses (Debian 12's Python 3.11.2 lacks it).
            if m.name.startswith("/") or ".." in m.name.split("/") or m.isdev():
                sys.exit(f"{tarball}: refusing member {m.name!r}")
            if (m.issym() or m.islnk()) and (
                m.linkname.startswith("/") or ".." in m.linkname.split("/")
            ):
                sys.exit(f"{tarball}: refusing link {m.name!r} -> {m.linkname!r}")
        tar.extractall(partial, members=members)
    tops = os.listdir(partial)
    if len(tops) != 1:
        sys.exit(f"{tarball}: expected one top directory, found {tops}")
    normalize(partial, max((m.mtime for m in members), default=0))
    os.rename(os.path.join(partial, tops[0]), dest)
    os.rmdir(partial)
    open(os.path.join(dest, ".complete"), "w").close()
    return dest


def normalize(root, mtime):
    """Owner root, directories 0755 with the release's newest time, files 0755 or 0644 by
    their owner's execute bit: the tree (and so the layer ID) must not depend on the
    release's recorded owners, the umask, when it was unpacked (releases often list no
    directory entries, so their directories are made at unpack time) or the Python
    version that unpacked it."""
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
            os.lchown(name, 0, 0)
            st = os.lstat(name)
            if os.path.islink(name):
                continue
            if os.path.isdir(name):
                os.chmod(name, 0o755)
                os.utime(name, (mtime, mtime))
            else:
                os.chmod(name, 0o755 if st.st_mode & 0o100 else 0o644)


def registered(bin_, ref):
    r = subprocess.run([bin_, "catalog", "show", ref, "--json"], capture_output=True, text=True)
    if r.returncode != 0:
        return None
    return json.loads(r.stdout)["entry"]


def toml_value(v):
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, (int, float)):
        return str(v)
    return json.dumps(v)


def layers_of(entry):
    return (entry.get("base"), tuple(entry.get("toolkits") or ()), entry.get("workspace"))


def register(bin_, entry, tables):
    """Registers an entry unless it is already there with the same layers: the given
    version, or for an unversioned entry the latest. Entries are immutable, so when a
    toolkit or the base changed, the workspace's environment gets the next revision,
    `<version>-r2`, `-r3`, ... (the unversioned ID resolves to the newest)."""
    if "version" in entry:
        base_version = entry["version"]
        for revision in range(1, 1000):
            version = base_version if revision == 1 else f"{base_version}-r{revision}"
            existing = registered(bin_, f"{entry['id']}@{version}")
            if existing is None:
                entry = dict(entry, version=version)
                break
            if layers_of(existing) == layers_of(entry):
                return f"{entry['id']}@{version}"
    else:
        existing = registered(bin_, entry["id"])
        if existing and layers_of(existing) == layers_of(entry):
            return f"{entry['id']}@{existing['version']}"
    lines = [f"{k} = {toml_value(v)}" for k, v in entry.items()]
    for name, table in tables.items():
        lines.append(f"\n[{name}]")
        lines += [f"{json.dumps(k)} = {toml_value(v)}" for k, v in table.items()]
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write("\n".join(lines) + "\n")
    try:
        return last_line(strata(bin_, "catalog", "register", f.name))
    finally:
        os.unlink(f.name)


def build_layer(bin_, definition):
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False, dir=CACHE) as f:
        f.write(definition)
    try:
        return json.loads(strata(bin_, "layer", "build", f.name, "--json"))["id"]
    finally:
        os.unlink(f.name)


def baseline(bin_, ref, out_path):
    r = subprocess.run([bin_, "run", ref, "--command", "test"], capture_output=True, text=True)
    results = []
    cargo = {"ok": "PASSED", "FAILED": "FAILED", "ignored": "SKIPPED"}
    for line in r.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS") and rest:
            results.append(f"{word} {rest.split(' - ')[0]}")
        elif word == "test" and " ... " in rest:
            # cargo test: `test path::name ... ok`
            name, _, outcome = rest.rpartition(" ... ")
            if outcome.split(" ")[0] in cargo:
                results.append(f"{cargo[outcome.split(' ')[0]]} {name}")
    if not results:
        sys.exit(f"{ref}: the test command reported no tests (status {r.returncode}):\n"
                 f"{r.stdout[-2000:]}{r.stderr[-2000:]}")
    results.sort(key=lambda l: l.split(" ", 1)[1])
    with open(out_path, "w") as f:
        f.write(f"# {ref}: test outcomes (exit status {r.returncode})\n")
        f.write("\n".join(results) + "\n")
    counts = {}
    for l in results:
        counts[l.split(" ")[0]] = counts.get(l.split(" ")[0], 0) + 1
    return counts


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strata", default="strata")
    p.add_argument("--only", help="only workspaces of this project")
    p.add_argument("--baseline", action="store_true")
    args = p.parse_args()
    bin_ = args.strata
    os.makedirs(CACHE, exist_ok=True)
    manifest = tomllib.load(open(os.path.join(HERE, "workspaces", "workspaces.toml"), "rb"))

    subprocess.run(["bash", os.path.join(HERE, "base", "make-rootfs.sh")], check=True,
                   stdout=subprocess.DEVNULL)
    base = last_line(strata(bin_, "layer", "build", os.path.join(HERE, "base", "debian.toml")))
    register(bin_, {"id": "datasets/debian", "base": base, "backend": "container",
                    "workdir": "/"}, {"env": {"LANG": "C.UTF-8"}})
    wanted = [ws for ws in manifest["workspace"] if not args.only or ws["name"] == args.only]
    toolkit_ids = {}
    for name in sorted({ws.get("toolkit", "pytest") for ws in wanted} | {"pytest"}):
        toolkit_ids[name] = last_line(strata(bin_, "layer", "build", TOOLKITS[name]["definition"]))
    rows = []
    for ws in wanted:
        kit_name = ws.get("toolkit", "pytest")
        kit = TOOLKITS[kit_name]
        toolkit = toolkit_ids[kit_name]
        tree = unpack(ws, fetch(ws))
        layer = build_layer(bin_, f"""kind = "workspace"
name = "{kit['layer_prefix']}/{ws['name']}"
version = "{ws['version']}"
prefix = "work"
exclude = [".complete", "**/__pycache__", "**/*.pyc"]
[source]
dir = {json.dumps(tree)}
""")
        ref = register(
            bin_,
            {"id": f"datasets/{ws['name']}", "version": ws["version"], "base": base,
             "toolkits": [toolkit], "workspace": layer, "backend": "container",
             "workdir": "/work"},
            {"budgets": {"memory": "1G", "cpus": 1, "disk": "1G", "pids": 512,
                         "timeout": "600s", "idle_ttl": "30m"},
             "env": kit["env"],
             "commands": {"test": ws.get("test", manifest["defaults"][kit["test"]])}},
        )
        row = {"ref": ref, "layer": layer}
        if args.baseline:
            os.makedirs(os.path.join(HERE, "baselines"), exist_ok=True)
            out = os.path.join(HERE, "baselines", f"{ws['name']}-{ws['version']}.txt")
            row["tests"] = baseline(bin_, ref, out)
        rows.append(row)
        log(f"{ref}: layer {layer[:16]}" + (f", {row['tests']}" if "tests" in row else ""))
    print(json.dumps({"base": base, "toolkits": toolkit_ids, "workspaces": rows}, indent=2))


if __name__ == "__main__":
    main()
