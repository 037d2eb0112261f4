#!/usr/bin/env bash
# A throwaway one-node S3 server for integration tests: Ceph (Debian 12 packages) with one
# mon, one memstore OSD and radosgw, all bound to 127.0.0.1 and all state under one DIR.
#
#   scripts/s3-server.sh start  DIR [PORT]   # PORT: radosgw HTTP port, default 7480
#   scripts/s3-server.sh stop   DIR
#   scripts/s3-server.sh status DIR
#
# `start` prints shell-sourceable exports on stdout (eval "$(scripts/s3-server.sh start D)")
# and progress on stderr. Env: S3_ACCESS_KEY, S3_SECRET_KEY, S3_BUCKET, S3_MON_PORT (default:
# a free port, so servers in different DIRs don't collide), S3_START_TIMEOUT (seconds per
# wait, default 120).
#
# The OSD uses memstore: objects live in RAM and vanish when the OSD stops, so a stopped
# server is always started again from scratch. Needs no systemd: the daemons fork on their
# own and are tracked by the pid files in DIR/run. Tested as root on Debian 12 (Ceph 16.2).
set -euo pipefail

ACCESS_KEY=${S3_ACCESS_KEY:-strata}
SECRET_KEY=${S3_SECRET_KEY:-strata-secret}
BUCKET=${S3_BUCKET:-strata-test}
# rgw's default zonegroup is "default" and it does not check the region in the signature
# scope, so the SDKs' usual default works.
REGION=us-east-1
TIMEOUT=${S3_START_TIMEOUT:-120}
# Daemon names double as pid/asok/log file names; the order is the stop order.
DAEMONS=(client.rgw.a osd.0 mon.a)

log() { echo "s3-server: $*" >&2; }
die() { log "error: $*"; exit 1; }

usage() {
  sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# ---- process bookkeeping ------------------------------------------------------------------

# Prints the pid of daemon $1 if it is alive *and* was started with this DIR's conf; a pid
# file left by a dead daemon could otherwise name an unrelated process that reused the pid.
daemon_pid() {
  local pidfile="$RUN/$1.pid" pid
  [ -s "$pidfile" ] || return 1
  pid=$(cat "$pidfile")
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  is_alive "$pid" || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$CONF" || return 1
  echo "$pid"
}

# A zombie counts as gone: it has exited, only its parent (PID 1 here) has yet to reap it.
is_alive() {
  local state
  # The state follows the parenthesised command name, which may itself contain spaces.
  state=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1
  [ -n "$state" ] && [ "$state" != Z ]
}

running_count() {
  local n=0 d
  for d in "${DAEMONS[@]}"; do daemon_pid "$d" >/dev/null && n=$((n + 1)); done
  echo "$n"
}

print_env() {
  # shellcheck disable=SC1091
  . "$DIR/s3.env"
  cat <<EOF
export AWS_ACCESS_KEY_ID=$(printf %q "$ACCESS_KEY")
export AWS_SECRET_ACCESS_KEY=$(printf %q "$SECRET_KEY")
export AWS_REGION=$REGION
export AWS_ENDPOINT_URL=http://127.0.0.1:$PORT
export AWS_ALLOW_HTTP=true
export STRATA_TEST_S3_URL='s3://$BUCKET?endpoint=http://127.0.0.1:$PORT'
EOF
}

# ---- waiting ------------------------------------------------------------------------------

# wait_for WHAT LOGFILE DAEMON CMD...: retries CMD once a second for $TIMEOUT seconds; on
# timeout shows the log that most likely says why, since the command's own failure rarely
# does. Returns 1 early if DAEMON (unless "-") dies meanwhile, so the caller can retry it.
wait_for() {
  local what=$1 logfile=$2 daemon=$3 start=$SECONDS
  shift 3
  until "$@" >/dev/null 2>&1; do
    # The grace period covers the moment before a forking daemon has written its pid file.
    if [ "$daemon" != - ] && ((SECONDS - start >= 3)) && ! daemon_pid "$daemon" >/dev/null; then
      log "$daemon exited while waiting for $what"
      return 1
    fi
    if ((SECONDS - start >= TIMEOUT)); then
      log "timed out after ${TIMEOUT}s waiting for $what; last lines of $logfile:"
      tail -n 40 "$logfile" >&2 2>/dev/null || true
      die "$what not ready (state and logs kept in $DIR)"
    fi
    sleep 1
  done
  log "$what ready after $((SECONDS - start))s"
}

# launch DAEMON READY_CMD LAUNCH_CMD...: starts a daemon (they fork into the background
# themselves and write their pid files) and waits until READY_CMD succeeds. A daemon that
# dies on the way is started again, up to 3 times: see ceph_cli for the race that kills them.
launch() {
  local daemon=$1 ready=$2 try
  shift 2
  for try in 1 2 3; do
    ((try == 1)) || log "starting $daemon again (try $try of 3)"
    if "$@" >>"$LOGS/setup.log" 2>&1; then
      wait_for "$daemon" "$LOGS/$daemon.log" "$daemon" "$ready" && return 0
    else
      log "$daemon failed to start"
    fi
    sleep 1
  done
  log "last lines of $LOGS/$daemon.log:"
  tail -n 40 "$LOGS/$daemon.log" >&2 2>/dev/null || true
  die "$daemon did not start"
}

# SO_REUSEADDR as the daemons use it: a port with only TIME_WAIT leftovers of a previous
# server counts as free, one with a listener does not.
port_free() {
  python3 -c '
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))' "$1" 2>/dev/null
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# s3 METHOD PATH [BODY [HEADER...]]: one SigV4-signed path-style request with only python's
# standard library: Debian 12's curl 7.88 --aws-sigv4 omits x-amz-content-sha256, which rgw
# rejects with SignatureDoesNotMatch unless the caller adds that header by hand. Prints the HTTP
# status on the first line, then the response body; status 000 means no connection.
s3() {
  S3_ENDPOINT="http://127.0.0.1:$PORT" S3_AK="$ACCESS_KEY" S3_SK="$SECRET_KEY" \
    S3_REGION="$REGION" python3 - "$@" <<'PY'
import datetime, hashlib, hmac, os, sys, urllib.error, urllib.parse, urllib.request

method, path = sys.argv[1], sys.argv[2]
body = sys.argv[3].encode() if len(sys.argv) > 3 else b""
extra = dict(h.split(":", 1) for h in sys.argv[4:])
endpoint, region = os.environ["S3_ENDPOINT"], os.environ["S3_REGION"]
ak, sk = os.environ["S3_AK"], os.environ["S3_SK"]

host = urllib.parse.urlsplit(endpoint).netloc
now = datetime.datetime.now(datetime.timezone.utc)
amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
payload = hashlib.sha256(body).hexdigest()
uri = urllib.parse.quote(path, safe="/-_.~")
signed = {"host": host, "x-amz-content-sha256": payload, "x-amz-date": amz_date}
names = ";".join(sorted(signed))
canonical = "\n".join([method, uri, "", *(f"{k}:{signed[k]}" for k in sorted(signed)), "",
                       names, payload])
scope = f"{day}/{region}/s3/aws4_request"
to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope,
                     hashlib.sha256(canonical.encode()).hexdigest()])
key = ("AWS4" + sk).encode()
for part in (day, region, "s3", "aws4_request"):
    key = hmac.new(key, part.encode(), hashlib.sha256).digest()
sig = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()

headers = {k: v for k, v in signed.items() if k != "host"}
headers["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={ak}/{scope}, "
                            f"SignedHeaders={names}, Signature={sig}")
headers.update({k.strip(): v.strip() for k, v in extra.items()})
req = urllib.request.Request(endpoint + uri, data=body if method in ("PUT", "POST") else None,
                             method=method, headers=headers)
try:
    with urllib.request.urlopen(req, timeout=15) as r:
        status, out = r.status, r.read()
except urllib.error.HTTPError as e:
    status, out = e.code, e.read()
except OSError:
    status, out = 0, b""
sys.stdout.write(f"{status:03d}\n{out.decode(errors='replace')}")
PY
}

s3_status() { s3 "$@" | sed -n 1p; }

# ---- ceph pieces --------------------------------------------------------------------------

write_conf() {
  local fsid=$1 mon_port=$2
  cat >"$CONF" <<EOF
# Generated by scripts/s3-server.sh; throwaway single-node cluster.
[global]
fsid = $fsid
mon host = [v1:127.0.0.1:$mon_port]
mon initial members = a
# Without cluster addr the OSD's replication/heartbeat ports would listen on 0.0.0.0.
public addr = 127.0.0.1
cluster addr = 127.0.0.1
# Only v1 is in the monmap; without this the mon would also grab the fixed msgr2 port 3300
# and a second server in another DIR would fail to start.
ms bind msgr2 = false
auth cluster required = none
auth service required = none
auth client required = none
# Keep clients from reading /etc/ceph: everything this cluster needs is here.
keyring = $DIR/keyring
run dir = $RUN
crash dir = $DIR/crash
osd pool default size = 1
osd pool default min size = 1
mon allow pool size one = true
mon warn on pool no redundancy = false
# The mon refuses to start below 5 % free space on the disk holding DIR, which on a large
# build disk can still be gigabytes; this throwaway cluster keeps its objects in RAM.
mon data avail crit = 0
mon data avail warn = 0
osd crush chooseleaf type = 0
osd objectstore = memstore
memstore device bytes = 2147483648
# No mgr runs, so nothing would autoscale; fixed small PG counts keep pool creation quick.
osd pool default pg autoscale mode = off
osd pool default pg num = 8
osd pool default pgp num = 8
mon max pg per osd = 1000

[mon.a]
mon data = $DIR/mon
public addr = 127.0.0.1:$mon_port
pid file = $RUN/\$name.pid
admin socket = $RUN/\$name.asok
log file = $LOGS/\$name.log

[osd.0]
osd data = $DIR/osd
# On start the OSD would place itself in the CRUSH map with a mon command that can lose the
# 'wrong fsid' race (see ceph_cli in scripts/s3-server.sh) and abort the OSD; the script
# places it beforehand instead.
osd crush update on start = false
osd class update on start = false
pid file = $RUN/\$name.pid
admin socket = $RUN/\$name.asok
log file = $LOGS/\$name.log

[client.rgw.a]
# tcp_nodelay: without it radosgw sends a small response's second write only once the
# client acknowledges the first, which a kept-alive connection delays by 40 ms (a small GET
# measured 44 ms instead of ~1 ms).
rgw frontends = beast endpoint=127.0.0.1:$PORT tcp_nodelay=1
rgw data = $DIR/rgw
rgw dns name = localhost
pid file = $RUN/\$name.pid
admin socket = $RUN/\$name.asok
log file = $LOGS/\$name.log
EOF
}

# Ceph 16 clients (the CLI, radosgw-admin, the daemons' own monitor clients) build their
# second monitor map (from the addresses cached by the first) without the fsid, and with auth
# none their first monitor command can go out before the real map arrives; the mon then
# rejects it as 'wrong fsid' (EPERM, "problem getting command descriptions from mon"). Measured here: ~5%
# of CLI calls with three running at once, none when run one at a time. Retrying is the fix;
# every command retried below is idempotent.
ceph_cli() {
  local try
  for try in 1 2 3 4 5; do
    timeout 30 ceph -c "$CONF" --connect-timeout 10 "$@" && return 0
    sleep 1
  done
  return 1
}

# The user may exist already when an earlier try created it but lost the reply.
create_user() {
  local try
  for try in 1 2 3 4 5; do
    timeout 60 radosgw-admin -c "$CONF" user create --uid "$ACCESS_KEY" \
      --display-name "$ACCESS_KEY" --access-key "$ACCESS_KEY" --secret-key "$SECRET_KEY" &&
      return 0
    timeout 60 radosgw-admin -c "$CONF" user info --uid "$ACCESS_KEY" && return 0
    sleep 1
  done
  return 1
}

mon_up() { ceph_cli mon stat; }

osd_up() { ceph_cli osd dump 2>/dev/null | grep -qE '^osd\.0 up +in'; }

rgw_http() {
  [ "$(s3_status GET /)" != 000 ]
}

# Bucket creation and the first PUT fail (or hang) for a while after rgw answers HTTP, while
# the OSD peers the placement groups of rgw's freshly created pools.
put_get_ok() {
  local st out
  st=$(s3_status PUT "/$BUCKET")
  [ "$st" = 200 ] || [ "$st" = 409 ] || return 1
  st=$(s3_status PUT "/$BUCKET/.s3-server-probe" "probe-$$") && [ "$st" = 200 ] || return 1
  out=$(s3 GET "/$BUCKET/.s3-server-probe")
  [ "$out" = $'200\n'"probe-$$" ] || return 1
}

# Strata's catalog relies on atomic create-if-absent; refuse to hand out a store without it.
conditional_put_ok() {
  [ "$(s3_status PUT "/$BUCKET/.s3-server-probe" "again" "If-None-Match: *")" = 412 ]
}

# ---- commands -----------------------------------------------------------------------------

cmd_start() {
  local n
  n=$(running_count)
  if [ "$n" = "${#DAEMONS[@]}" ]; then
    log "already running in $DIR"
    print_env
    return 0
  elif [ "$n" != 0 ]; then
    die "only $n of ${#DAEMONS[@]} daemons are running in $DIR; run '$0 stop $DIR' first"
  fi

  # All of DIR's old contents get deleted below, so make sure they are ours.
  if [ -n "$(ls -A "$DIR")" ] && [ ! -f "$DIR/s3.env" ]; then
    die "$DIR is neither empty nor an s3-server directory; refusing to use it"
  fi
  local tool
  for tool in ceph-mon ceph-osd radosgw radosgw-admin ceph monmaptool python3; do
    command -v "$tool" >/dev/null ||
      die "$tool not found (apt-get install ceph-mon ceph-osd radosgw ceph-common python3)"
  done
  # Unix socket paths are limited to 107 bytes; the longest is the rgw admin socket.
  local asok="$RUN/client.rgw.a.asok"
  [ "${#asok}" -lt 108 ] || die "DIR path too long for admin sockets ($asok)"
  [[ $PORT =~ ^[0-9]+$ ]] || die "PORT must be a number, got '$PORT'"
  port_free "$PORT" || die "port $PORT on 127.0.0.1 is busy (another server? pass a PORT)"
  local mon_port=${S3_MON_PORT:-$(free_port)}
  port_free "$mon_port" || die "mon port $mon_port on 127.0.0.1 is busy (set S3_MON_PORT)"

  # memstore lost the objects when the OSD stopped, and the old mon still remembers that OSD
  # and the pools: reuse neither, start clean.
  rm -rf "$DIR/mon" "$DIR/osd" "$DIR/rgw" "$RUN" "$LOGS" "$DIR/crash" "$DIR/monmap" "$CONF"
  mkdir -p "$DIR/mon" "$DIR/osd" "$DIR/rgw" "$RUN" "$LOGS" "$DIR/crash"
  cat >"$DIR/s3.env" <<EOF
PORT=$PORT
ACCESS_KEY=$ACCESS_KEY
SECRET_KEY=$SECRET_KEY
BUCKET=$BUCKET
EOF

  # A half-started cluster is of no use to anyone: stop whatever did start, keep the
  # state and logs for a look.
  trap 'if [ "$?" != 0 ]; then log "start failed, stopping what did start"; cmd_stop; fi' EXIT

  local fsid t0=$SECONDS
  fsid=$(cat /proc/sys/kernel/random/uuid)
  write_conf "$fsid" "$mon_port"
  log "starting in $DIR (rgw 127.0.0.1:$PORT, mon 127.0.0.1:$mon_port)"

  {
    monmaptool --create --clobber --fsid "$fsid" --addv a "[v1:127.0.0.1:$mon_port]" "$DIR/monmap"
    ceph-mon --mkfs -i a --monmap "$DIR/monmap" -c "$CONF"
  } >>"$LOGS/setup.log" 2>&1 || { tail -n 20 "$LOGS/setup.log" >&2; die "mon mkfs failed"; }
  launch mon.a mon_up ceph-mon -i a -c "$CONF"

  # Registering the OSD under a fixed uuid keeps `osd create` idempotent across retries.
  local osd_uuid
  osd_uuid=$(cat /proc/sys/kernel/random/uuid)
  {
    [ "$(ceph_cli osd create "$osd_uuid")" = 0 ] &&
      ceph_cli osd crush add osd.0 1.0 root=default &&
      ceph-osd -i 0 --mkfs --osd-uuid "$osd_uuid" -c "$CONF"
  } >>"$LOGS/setup.log" 2>&1 || { tail -n 20 "$LOGS/setup.log" >&2; die "OSD setup failed"; }
  launch osd.0 osd_up ceph-osd -i 0 -c "$CONF"

  launch client.rgw.a rgw_http radosgw -n client.rgw.a -c "$CONF"

  create_user >>"$LOGS/setup.log" 2>&1 ||
    { tail -n 20 "$LOGS/setup.log" >&2; die "creating the S3 user failed"; }
  wait_for "S3 PUT+GET in bucket $BUCKET" "$LOGS/client.rgw.a.log" client.rgw.a put_get_ok ||
    die "radosgw died (see $LOGS/client.rgw.a.log)"
  conditional_put_ok || die "rgw ignored If-None-Match: * on an existing key (expected 412)"
  s3_status DELETE "/$BUCKET/.s3-server-probe" >/dev/null || true

  trap - EXIT
  log "up in $((SECONDS - t0))s"
  print_env
}

# stop_daemon NAME: TERM, then KILL if it is still alive 10 s later. Prints the pid.
stop_daemon() {
  local pid i
  pid=$(daemon_pid "$1") || return 0
  log "stopping $1 (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 50; i++)); do
    is_alive "$pid" || { echo "$pid"; return 0; }
    sleep 0.2
  done
  log "$1 still alive 10s after TERM, sending KILL"
  kill -KILL "$pid" 2>/dev/null || true
  for ((i = 0; i < 25; i++)); do
    is_alive "$pid" || { echo "$pid"; return 0; }
    sleep 0.2
  done
  die "$1 (pid $pid) survived SIGKILL"
}

cmd_stop() {
  local d pid pids=() deadline
  # One at a time, clients before servers: an OSD whose mon is already gone spends ~5 s
  # trying to report its own shutdown.
  for d in "${DAEMONS[@]}"; do
    pid=$(stop_daemon "$d") || exit 1
    [ -z "$pid" ] || pids+=("$pid")
  done
  # The daemons were reparented to PID 1, which reaps zombies only every couple of seconds;
  # wait for that so that a `pgrep ceph` right after is clean.
  deadline=$((SECONDS + 5))
  for pid in "${pids[@]}"; do
    while [ -d "/proc/$pid" ] && ((SECONDS < deadline)); do sleep 0.2; done
  done
  rm -f "$RUN"/*.pid
  log "stopped"
}

cmd_status() {
  local d pid n=0
  for d in "${DAEMONS[@]}"; do
    if pid=$(daemon_pid "$d"); then
      echo "$d: running (pid $pid)"
      n=$((n + 1))
    else
      echo "$d: not running"
    fi
  done
  if [ "$n" = "${#DAEMONS[@]}" ]; then
    # shellcheck disable=SC1091
    . "$DIR/s3.env"
    echo "running: s3://$BUCKET?endpoint=http://127.0.0.1:$PORT"
  else
    echo "not running"
    return 1
  fi
}

[ $# -ge 2 ] || usage
CMD=$1
DIR=$(realpath -m -- "$2")
PORT=${3:-7480}
CONF=$DIR/ceph.conf
RUN=$DIR/run
LOGS=$DIR/log

case $CMD in
  start) mkdir -p "$DIR"; cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  *) usage ;;
esac
