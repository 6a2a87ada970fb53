#!/usr/bin/env bash
# Runs every test on a fresh machine: set-up, style and lint gates, the static musl
# binaries the VMs boot, then the whole workspace's tests with nothing allowed to skip.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
start=$(date +%s)
bash scripts/setup.sh
echo "[test] cargo fmt --check"; cargo fmt --all -- --check
echo "[test] cargo clippy -D warnings"; cargo clippy --quiet --workspace --all-targets -- -D warnings
echo "[test] static musl builds"
cargo build --quiet --release --target x86_64-unknown-linux-musl -p guest-init -p host-relay
# guest-probe: the static app the VM tests run inside guests (rebuilt so it is never stale).
cargo build --quiet --release --target x86_64-unknown-linux-musl -p qemu-harness --bin guest-probe
ls -l target/x86_64-unknown-linux-musl/release/guest-init target/x86_64-unknown-linux-musl/release/host-relay \
      target/x86_64-unknown-linux-musl/release/guest-probe
echo "[test] cargo test"
REQUIRE_ALL=1 cargo test --workspace --no-fail-fast 2>&1 | tee target/test-output.log
echo "[test] done in $(( $(date +%s) - start )) s"
