#!/usr/bin/env bash
# The whole test suite: install what the tests need, build the binaries the CLI tests call,
# run every test. Tests that need root, FUSE, mounts or KVM fail (rather than skip) when
# STRATA_REQUIRE_PRIVILEGED=1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --workspace --bins
# The agent again, statically linked: the init of every container (see README, design).
CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-C target-feature=+crt-static" \
  cargo build -p strata-agent --target x86_64-unknown-linux-gnu
cargo test --workspace --no-fail-fast -- --test-threads="${STRATA_TEST_THREADS:-2}"
# Every fuzz target under AFL++ for a bounded time (fuzz/, scripts/fuzz.sh).
bash scripts/fuzz.sh "${STRATA_FUZZ_SECONDS:-20}"
