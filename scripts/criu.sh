#!/usr/bin/env bash
# Builds CRIU 4.1.1, the process checkpointer container and fncall hibernation needs, into
# /usr/local/lib/strata/criu/criu (override with STRATA_CRIU_DIR). Debian 12's own criu
# (3.17) cannot run on current kernels ("vdso: Unexpected rt vDSO area bounds") and
# Debian 13's binary package needs glibc 2.38, so this builds Debian 13's source package:
# its upstream tarball, fetched with apt from a trixie deb-src entry kept in a private apt
# configuration (the host's own sources are not touched) and checked against the digest
# below, plus our patches in scripts/criu/: landlock-children.patch (restored process trees
# keep a Landlock domain of their own; see README, hibernation, and SECURITY.md) and
# sockopt-eopnotsupp.patch (Linux 6.16+ refuses SO_PASSCRED/SO_PASSSEC on TCP and UDP
# sockets, which made CRIU 4.1.1 refuse any process holding one) and empty-tmpfs.patch (an
# empty tmpfs, such as a masked directory, is saved and restored without tar and gzip).
# Idempotent: a built binary of this version and these patches is kept.
set -euo pipefail

VERSION=4.1.1
SHA256=f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe
HERE="$(cd "$(dirname "$0")" && pwd)"
PATCHES=("$HERE"/criu/*.patch)
DEST="${STRATA_CRIU_DIR:-/usr/local/lib/strata/criu}"
# CRIU caches what it probes of the kernel (30-70 ms a run) only on a tmpfs, in RUNDIR:
# /run is not a tmpfs on every host, /dev/shm is. The runtime keeps this directory root's
# own (KDAT_DIR in runtime/src/checkpoint.rs).
RUNDIR=/dev/shm/strata-criu
TAG="$VERSION rundir=$RUNDIR $(cat "${PATCHES[@]}" | sha256sum | cut -d' ' -f1)"

if [ -x "$DEST/criu" ] && [ "$(cat "$DEST/build-tag" 2>/dev/null)" = "$TAG" ]; then
  exit 0
fi

BUILD_DEPS=(libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler
  python3-protobuf libnl-3-dev libnet1-dev libcap-dev libaio-dev libbsd-dev
  libgnutls28-dev uuid-dev libnftables-dev pkg-config gcc make xz-utils patch)
. "$HERE/packages.sh"
ensure_packages "criu (build dependencies)" "${BUILD_DEPS[@]}"

work="$(mktemp -d /tmp/strata-criu.XXXXXX)"
trap 'rm -rf "$work"' EXIT
tarball="$work/criu_$VERSION.orig.tar.xz"
cache="${STRATA_CRIU_CACHE:-/var/cache/strata}/criu_$VERSION.orig.tar.xz"
if [ -f "$cache" ] && echo "$SHA256  $cache" | sha256sum -c --status; then
  cp "$cache" "$tarball"
else
  echo "criu: fetching criu_$VERSION.orig.tar.xz (Debian 13 source package)" >&2
  apt_dir="$work/apt"
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"
  echo "deb-src http://deb.debian.org/debian trixie main" > "$apt_dir/sources.list"
  apt_opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache" -o APT::Sandbox::User=root)
  apt-get "${apt_opts[@]}" update -qq >/dev/null
  # Only the upstream tarball is needed (the Debian packaging is not built); the mirror
  # may not carry the .dsc of this exact revision, so a partial download is fine.
  (cd "$work" && apt-get "${apt_opts[@]}" source --download-only -qq "criu=$VERSION-*" >/dev/null 2>&1 ||
    apt-get "${apt_opts[@]}" source --download-only -qq criu >/dev/null 2>&1 || true)
  if [ ! -f "$tarball" ] || ! echo "$SHA256  $tarball" | sha256sum -c --status; then
    echo "criu: could not fetch criu_$VERSION.orig.tar.xz with the expected digest from the Debian 13 sources" >&2
    exit 1
  fi
  mkdir -p "$(dirname "$cache")" && cp "$tarball" "$cache"
fi

echo "criu: building CRIU $VERSION (about a minute)" >&2
tar -xf "$tarball" -C "$work"
src="$work/criu-$VERSION"
for p in "${PATCHES[@]}"; do
  patch -d "$src" -p1 --quiet < "$p"
done
make -C "$src" -j"$(nproc)" RUNDIR="$RUNDIR" criu >"$work/build.log" 2>&1 || { tail -30 "$work/build.log" >&2; exit 1; }
"$src/criu/criu" --version >/dev/null
mkdir -p "$DEST"
install -m 0755 "$src/criu/criu" "$DEST/criu.new"
mv "$DEST/criu.new" "$DEST/criu"
echo "$TAG" > "$DEST/build-tag"
echo "criu: $DEST/criu ready" >&2
