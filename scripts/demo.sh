#!/usr/bin/env bash
# The main job on the embedded default (a local store, no services): install what is
# needed, build Strata, build the sample layer from datasets/ and print the store's stats.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release -p strata
bin=target/release/strata
id=$("$bin" layer build datasets/sample/workspace.toml)
echo "built layer $id"
"$bin" layer inspect "$id"
"$bin" store stats
