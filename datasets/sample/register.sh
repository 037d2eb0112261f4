#!/usr/bin/env bash
# Builds the sample environment's three layers into the store and registers it in the
# catalog: the Debian base (also registered alone as datasets/debian), the pytest toolkit
# (built by pip in a build step over that base) and the wordfreq workspace. Prints the
# catalog reference (datasets/sample@vN) as the last line. Usage: register.sh [STRATA_BIN]
# (store from STRATA_STORE / --store defaults, like the CLI).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
strata=${1:-strata}
bash "$here/../base/make-rootfs.sh" >/dev/null
entry=$(mktemp --suffix=.toml)
trap 'rm -f "$entry"' EXIT

base=$("$strata" layer build "$here/../base/debian.toml" | tail -1)
sed -e "s/@BASE@/$base/" "$here/../base/entry.toml.in" > "$entry"
"$strata" catalog register "$entry" >/dev/null
toolkit=$("$strata" layer build "$here/../toolkits/pytest/toolkit.toml" | tail -1)
workspace=$("$strata" layer build "$here/workspace.toml" | tail -1)
sed -e "s/@BASE@/$base/" -e "s/@TOOLKIT@/$toolkit/" -e "s/@WORKSPACE@/$workspace/" \
  "$here/entry.toml.in" > "$entry"
"$strata" catalog register "$entry" | tail -1
