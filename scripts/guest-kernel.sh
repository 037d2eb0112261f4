#!/usr/bin/env bash
# Prepares the guest kernel for microVM and VM sandboxes: Debian's own kernel package
# (whatever linux-image-amd64 depends on now), as an uncompressed PVH `vmlinux` (boots
# seconds faster under TCG than the bzImage) plus the modules a guest needs, their
# dependencies first, listed in load order in `modules.load`. The runtime packs them with
# the static strata-agent into the initramfs.
#
#   scripts/guest-kernel.sh [DIR]     DIR defaults to $STRATA_GUEST_DIR or /usr/local/lib/strata/guest
#
# Idempotent: a second run with the same kernel version only checks.
set -euo pipefail

DEST="${1:-${STRATA_GUEST_DIR:-/usr/local/lib/strata/guest}}"
# What guests need: the virtio transports (mmio for microvm, pci for q35), disks, the
# host channel, networking when allowed, entropy, and the filesystems of a sandbox root.
# crc32c_generic comes first: libcrc32c asks the crypto API for it, and a guest has no
# modprobe to load it on demand. fuse and loop are for privileged guests that run Strata
# itself (a stock-host test).
WANTED=(crc32c_generic virtio_mmio virtio_pci virtio_console virtio_blk virtio_net virtio-rng erofs overlay ext4 fuse loop)

pkg="$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-/ {print $2; exit}')"
if [ -z "$pkg" ]; then
  echo "guest-kernel: apt does not know linux-image-amd64; run apt-get update" >&2
  exit 1
fi
version="${pkg#linux-image-}"
have_all() {
  local m
  for m in "${WANTED[@]}"; do
    grep -qx -- "${m//-/_}" <(tr - _ < "$DEST/modules.load") || return 1
  done
}
if [ -f "$DEST/kernel.version" ] && [ "$(cat "$DEST/kernel.version")" = "$version" ] \
  && [ -s "$DEST/vmlinux" ] && [ -s "$DEST/modules.load" ] && [ -s "$DEST/modules.display" ] \
  && have_all; then
  echo "guest-kernel: $version ready in $DEST" >&2
  exit 0
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "guest-kernel: fetching $pkg" >&2
(cd "$work" && apt-get download "$pkg" >/dev/null 2>&1 || apt-get download "$pkg")
dpkg-deb -x "$work"/"$pkg"_*.deb "$work/x"
vmlinuz="$work/x/boot/vmlinuz-$version"
moddir="$work/x/lib/modules/$version"

# The bzImage carries the kernel as an XZ stream; the first XZ magic starts it.
offset="$(grep -abo -m1 $'\xfd7zXZ\x00' "$vmlinuz" | head -1 | cut -d: -f1)"
if [ -z "$offset" ]; then
  echo "guest-kernel: no XZ stream in $vmlinuz (not a Debian amd64 kernel?)" >&2
  exit 1
fi
tail -c +"$((offset + 1))" "$vmlinuz" | xz -dc > "$work/vmlinux" 2>/dev/null || true
if ! head -c 4 "$work/vmlinux" | grep -q $'\x7fELF'; then
  echo "guest-kernel: extracting vmlinux from $vmlinuz failed" >&2
  exit 1
fi

# Module dependencies come from each .ko's modinfo `depends=` (the .deb has no modules.dep).
declare -A path_of=()
while IFS= read -r ko; do
  name="$(basename "$ko" .ko)"
  path_of["$name"]="$ko"
  path_of["${name//-/_}"]="$ko"
done < <(find "$moddir" -name '*.ko')
order=()
declare -A seen=()
visit() {
  local name="$1" ko deps dep
  [ -n "${seen[$name]:-}" ] && return
  seen["$name"]=1
  ko="${path_of[$name]:-}"
  if [ -z "$ko" ]; then
    echo "guest-kernel: module $name is not in $pkg" >&2
    exit 1
  fi
  deps="$(grep -a -o 'depends=[A-Za-z0-9_,-]*' "$ko" | head -1 | cut -d= -f2)"
  for dep in ${deps//,/ }; do visit "${dep//-/_}"; done
  order+=("$(basename "$ko" .ko)")
}
for m in "${WANTED[@]}"; do visit "${m//-/_}"; done
base_count=${#order[@]}
# A full VM with a display also gets the bochs-display DRM driver (loaded only then).
visit bochs
display=("${order[@]:$base_count}")
order=("${order[@]:0:$base_count}")

mkdir -p "$DEST.new/modules"
for m in "${order[@]}" "${display[@]}"; do cp "${path_of[$m]}" "$DEST.new/modules/$m.ko"; done
printf '%s\n' "${order[@]}" > "$DEST.new/modules.load"
printf '%s\n' "${display[@]}" > "$DEST.new/modules.display"
mv "$work/vmlinux" "$DEST.new/vmlinux"
cp "$work/x/boot/config-$version" "$DEST.new/config"
echo "$version" > "$DEST.new/kernel.version"
rm -rf "$DEST"
mkdir -p "$(dirname "$DEST")"
mv "$DEST.new" "$DEST"
echo "guest-kernel: $version ready in $DEST (${#order[@]} modules)" >&2
