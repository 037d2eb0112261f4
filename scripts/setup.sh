#!/usr/bin/env bash
# Installs what Strata needs on a fresh Debian 12 machine: build tools, the kernel-side
# userspace (FUSE, erofs-utils for fsck), the container engines (crun, runc, catatonit as
# init), the VM engine (QEMU) and the guest kernel for microVMs and VMs, the S3 test
# server (Ceph radosgw), Node.js and npm and openssl for the E2B tests, and the Rust
# toolchain's components, and CRIU (scripts/criu.sh). Idempotent: a second run
# only checks.
set -euo pipefail

PKGS=(
  build-essential pkg-config git zstd xz-utils ca-certificates curl
  fuse3 libfuse3-dev erofs-utils attr acl
  ceph-mon ceph-osd radosgw ceph-common
  python3 python3-venv
  mmdebstrap docker-registry skopeo
  crun runc catatonit e2fsprogs util-linux python3-pip nftables iproute2 podman
  qemu-system-x86 prometheus openssl nodejs
)

. "$(dirname "$0")/packages.sh"
ensure_packages setup "${PKGS[@]}"

# The E2B tests' Node SDK needs npm: Debian ships it apart from nodejs (other nodejs
# builds, e.g. NodeSource's, carry their own).
if ! command -v npm >/dev/null 2>&1; then
  echo "setup: installing npm" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends npm >/dev/null
fi

# The guest kernel (Debian's, as an uncompressed vmlinux) and its modules for VM sandboxes.
bash "$(dirname "$0")/guest-kernel.sh"

# CRIU 4.1 (built from Debian 13's source, patched) for container hibernation.
bash "$(dirname "$0")/criu.sh"

if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo not found; install the Rust toolchain (rustup) first" >&2
  exit 1
fi
rustup component add rustfmt clippy >/dev/null 2>&1 || true
echo "setup: ok" >&2
