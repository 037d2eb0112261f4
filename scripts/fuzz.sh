#!/usr/bin/env bash
# Fuzzes every target of fuzz/ (or those named) with AFL++ through cargo-afl, for a bounded
# time each, from the seed corpus in fuzz/corpus/. Prints a line per target (seconds,
# executions, distinct paths, crashes) and fails if any target crashed; a crashing input
# is copied to fuzz/regressions/<target>/, where the crate's tests replay it once fixed.
# Built with the dev profile, so overflow checks and debug assertions count as crashes.
# Usage: scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]   (default: 20 s, every target)
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-${STRATA_FUZZ_SECONDS:-20}}
shift || true

AFL_VERSION=0.18.2
if ! cargo afl --version 2>/dev/null | grep -q "$AFL_VERSION"; then
  echo "fuzz: installing cargo-afl $AFL_VERSION (AFL++ with it)" >&2
  cargo install cargo-afl --version "$AFL_VERSION" --locked >&2
fi
# AFL++ itself, built once per Rust toolchain (`cargo afl --version` names it once built).
if ! cargo afl --version 2>/dev/null | grep -q "AFL++ version"; then
  echo "fuzz: building AFL++ for this toolchain" >&2
  cargo afl config --build >&2
fi
# Its own target directory: the instrumented build would otherwise invalidate the plain one.
export CARGO_TARGET_DIR=target/afl
cargo afl build -p strata-fuzz --features afl >&2
bin=$CARGO_TARGET_DIR/debug/strata-fuzz
if [ $# -gt 0 ]; then targets=("$@"); else mapfile -t targets < <("$bin" --list); fi

export AFL_NO_UI=1 AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 \
  AFL_NO_AFFINITY=1 AFL_QUIET=1
failed=0
printf '%-14s %8s %12s %8s %8s\n' target seconds executions paths crashes
for t in "${targets[@]}"; do
  out=$CARGO_TARGET_DIR/fuzz-out/$t
  rm -rf "$out"; mkdir -p "$(dirname "$out")"
  cargo afl fuzz -V "$secs" -m none -i "fuzz/corpus/$t" -o "$out" "$bin" "$t" \
    > "$CARGO_TARGET_DIR/fuzz-$t.log" 2>&1 || {
      echo "fuzz: afl-fuzz failed on $t:" >&2; tail -20 "$CARGO_TARGET_DIR/fuzz-$t.log" >&2; exit 1; }
  stats=$out/default/fuzzer_stats
  execs=$(awk -F' *: *' '$1=="execs_done"{print $2}' "$stats")
  paths=$(awk -F' *: *' '$1=="corpus_count"{print $2}' "$stats")
  crashes=$(find "$out/default/crashes" -type f -name 'id:*' | wc -l)
  printf '%-14s %8s %12s %8s %8s\n' "$t" "$secs" "$execs" "$paths" "$crashes"
  if [ "$crashes" -gt 0 ]; then
    failed=1
    mkdir -p "fuzz/regressions/$t"
    for c in "$out"/default/crashes/id:*; do
      cp "$c" "fuzz/regressions/$t/crash-$(sha256sum "$c" | cut -c1-16)"
    done
    echo "fuzz: $t crashed; inputs copied to fuzz/regressions/$t/ (replay: $bin $t < FILE)" >&2
  fi
done
exit $failed
