#!/usr/bin/env bash
# Builds the sample environment's three layers (Debian base, pytest toolkit, wordfreq
# workspace) into the store and registers it in the catalog. Prints the catalog reference
# (datasets/sample@vN) as the last line. Usage: register.sh [STRATA_BIN] (store from
# STRATA_STORE / --store defaults, like the CLI).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
strata=${1:-strata}
bash "$here/../base/make-rootfs.sh" >/dev/null
bash "$here/../toolkits/pytest/make-tree.sh" >/dev/null
base=$("$strata" layer build "$here/../base/debian.toml" | tail -1)
toolkit=$("$strata" layer build "$here/../toolkits/pytest/toolkit.toml" | tail -1)
workspace=$("$strata" layer build "$here/workspace.toml" | tail -1)
entry=$(mktemp --suffix=.toml)
trap 'rm -f "$entry"' EXIT
sed -e "s/@BASE@/$base/" -e "s/@TOOLKIT@/$toolkit/" -e "s/@WORKSPACE@/$workspace/" \
  "$here/entry.toml.in" > "$entry"
"$strata" catalog register "$entry" | tail -1
