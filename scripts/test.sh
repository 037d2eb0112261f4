#!/usr/bin/env bash
# The whole test suite: install what the tests need, build the binaries the CLI tests call,
# run every test. Tests that need root, FUSE, mounts or KVM fail (rather than skip) when
# STRATA_REQUIRE_PRIVILEGED=1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --workspace --bins
cargo test --workspace -- --test-threads="${STRATA_TEST_THREADS:-2}"
