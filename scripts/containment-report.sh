#!/usr/bin/env bash
# The containment suite in one run, and its figures as the README's table: every test
# SECURITY.md's "Containment, tested" names that reports what it tried
# (`strata_tests::contained`), then a Markdown table of attempts contained per scenario and
# backend, and of faults injected and survived. A failing test fails the run (nothing is
# reported contained that was not). Run as root with what scripts/setup.sh installs;
# STRATA_SOAK_CYCLES and STRATA_FLOOD_SECONDS size the soak and the floods (the issue's
# figures: 1000 and 60). Usage: scripts/containment-report.sh [REPORT_FILE]
set -euo pipefail
cd "$(dirname "$0")/.."
report=${1:-target/containment-report.tsv}
mkdir -p "$(dirname "$report")"
: > "$report"
export STRATA_CONTAINMENT_REPORT=$PWD/$report STRATA_REQUIRE_PRIVILEGED=1
# The binaries the tests call, as scripts/test.sh builds them (a fresh checkout has none).
cargo build --workspace --bins
CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-C target-feature=+crt-static" \
  cargo build -p strata-agent --target x86_64-unknown-linux-gnu
run() { cargo test -p strata-tests --test "$1" -- --test-threads=1 "${@:2}"; }
run containment
run runtime a_hostile_command_cannot_take_over_the_agent the_hosts_kernel_files_are_masked \
  dangerous_syscalls_are_refused an_agent_can_change_neither budgets_hold_and_say
run vm a_hostile_command_cannot_take_over_the_guest_agent a_guests_kernel_files_are_masked \
  a_guests_dangerous_syscalls_are_refused a_vm_agent_can_change_neither budgets_hold_and_the_network
run lazyfs over_radosgw
python3 - "$report" <<'EOF'
import collections, sys
rows = collections.OrderedDict()
faults = collections.OrderedDict()
for line in open(sys.argv[1]):
    _, scenario, backend, tried = line.rstrip("\n").split("\t")
    if backend == "faults":
        faults[scenario] = faults.get(scenario, 0) + int(tried)
    else:
        rows.setdefault(scenario, collections.Counter())[backend] += int(tried)
backends = ["fncall", "container", "microvm", "vm"]
print("| Scenario | " + " | ".join(backends) + " |")
print("|---|" + "---|" * len(backends))
totals = collections.Counter()
for scenario, by in rows.items():
    cells = []
    for b in backends:
        if b in by:
            cells.append(f"{by[b]}/{by[b]}")
            totals[b] += by[b]
        else:
            cells.append("—")
    print(f"| {scenario} | " + " | ".join(cells) + " |")
print("| **attempts contained** | " + " | ".join(f"**{totals[b]}/{totals[b]}**" for b in backends) + " |")
print()
print("| Fault | Injected | Survived |")
print("|---|---|---|")
for f, n in faults.items():
    print(f"| {f} | {n} | {n} |")
EOF
