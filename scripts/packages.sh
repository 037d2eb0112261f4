# Sourced by the setup scripts: `ensure_packages WHO PACKAGE...` installs the Debian
# packages of the list that are not installed yet (nothing, and no apt call, when all are).
ensure_packages() {
  local who="$1" p missing=()
  shift
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "$who: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}
