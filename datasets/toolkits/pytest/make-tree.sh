#!/usr/bin/env bash
# Makes the pytest toolkit's tree: pytest and its (pure-Python) dependencies installed from
# PyPI into datasets/cache/toolkit-pytest/opt/strata-toolkit, pinned by version, with
# timestamps fixed so the layer built from it is the same on every machine. Reused if present.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/../../cache/toolkit-pytest}
if [ -s "$out/.complete" ]; then
  echo "$out" && exit 0
fi
rm -rf "$out.partial"
mkdir -p "$out.partial/opt/strata-toolkit"
python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-compile --no-deps \
  --target "$out.partial/opt/strata-toolkit/site-packages" \
  pytest==8.3.4 pluggy==1.5.0 iniconfig==2.0.0 packaging==24.2
# Console scripts written by pip name the host's interpreter: write our own.
rm -rf "$out.partial/opt/strata-toolkit/site-packages/bin"
mkdir -p "$out.partial/opt/strata-toolkit/bin"
cat > "$out.partial/opt/strata-toolkit/bin/pytest" <<'PY'
#!/bin/sh
exec python3 -m pytest "$@"
PY
chmod 755 "$out.partial/opt/strata-toolkit/bin/pytest"
find "$out.partial" -exec touch -h -d @1747699200 {} +
touch "$out.partial/.complete"
rm -rf "$out"
mv "$out.partial" "$out"
echo "$out"
