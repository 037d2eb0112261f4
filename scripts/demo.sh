#!/usr/bin/env bash
# The main job on the embedded default (a local store, no services): install what is
# needed, build Strata, build the sample environment from datasets/ (Debian base + pytest
# toolkit + wordfreq workspace) into the store, register it in the catalog, and run its
# test suite in a container sandbox started by catalog ID.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release -p strata -p strata-agent
CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-C target-feature=+crt-static" \
  cargo build --release -p strata-agent --target x86_64-unknown-linux-gnu
bin=$PWD/target/release/strata
ref=$(bash datasets/sample/register.sh "$bin" | tail -1)
echo "registered $ref"
"$bin" catalog show "$ref"
echo "running the test suite of $ref in a container:"
set +e
"$bin" run --backend container "$ref" --command test
status=$?
set -e
echo "exit status $status"
"$bin" store stats
exit $status
