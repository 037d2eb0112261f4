#!/usr/bin/env bash
# Makes the Debian base rootfs tar (minbase + python3 + git) with mmdebstrap against the
# machine's configured Debian mirror. SOURCE_DATE_EPOCH pins timestamps so reruns give the
# same tree; the tar is cached under datasets/cache/ and reused if present.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/../cache/debian-bookworm-python.tar}
mkdir -p "$(dirname "$out")"
if [ -s "$out" ]; then
  echo "$out" && exit 0
fi
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-1747699200}   # 2025-05-20, the mirror snapshot
tmp="${out%.tar}.partial.tar"
mmdebstrap --quiet --variant=minbase --include=python3,git,ca-certificates \
  --aptopt='Acquire::Retries "3"' bookworm "$tmp"
mv "$tmp" "$out"
sha256sum "$out" | tee "$out.sha256" >&2
echo "$out"
