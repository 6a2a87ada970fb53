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
# Fuzz targets (docs/FUZZING.md): a short, fixed number of runs each from the committed
# seeds, a smoke test of the targets and their assertions; the long runs are documented.
# New inputs go to a temporary directory, never into the committed corpus.
echo "[test] fuzz targets: ${FUZZ_RUNS:=50000} runs each"
FUZZ=(env RUSTUP_TOOLCHAIN=nightly "${MICROVM_CACHE:-$ROOT/.cache}/tools/bin/cargo-fuzz" fuzz)
cargo fmt --manifest-path tests/fuzz/Cargo.toml -- --check
"${FUZZ[@]}" build --fuzz-dir tests/fuzz -s none -a
fuzz_tmp=$(mktemp -d)
for t in $("${FUZZ[@]}" list --fuzz-dir tests/fuzz); do
  mkdir -p "$fuzz_tmp/$t"
  "${FUZZ[@]}" run --fuzz-dir tests/fuzz -s none -a "$t" "$fuzz_tmp/$t" "tests/fuzz/corpus/$t" -- \
    -runs="$FUZZ_RUNS" -max_total_time=60 -max_len=4096 -timeout=5 -rss_limit_mb=2048 \
    >"$fuzz_tmp/$t.log" 2>&1 || { tail -40 "$fuzz_tmp/$t.log"; echo "[test] fuzz target $t failed"; exit 1; }
  echo "[test]   $t: $(grep -m1 '^Done' "$fuzz_tmp/$t.log")"
done
rm -rf "$fuzz_tmp"
echo "[test] static musl builds"
cargo build --quiet --release --target x86_64-unknown-linux-musl -p guest-init -p host-relay
# guest-probe: the static app the VM tests run inside guests (rebuilt so it is never stale).
cargo build --quiet --release --target x86_64-unknown-linux-musl -p qemu-harness --bin guest-probe
ls -l target/x86_64-unknown-linux-musl/release/guest-init target/x86_64-unknown-linux-musl/release/host-relay \
      target/x86_64-unknown-linux-musl/release/guest-probe
echo "[test] cargo test"
REQUIRE_ALL=1 cargo test --workspace --no-fail-fast 2>&1 | tee target/test-output.log
echo "[test] done in $(( $(date +%s) - start )) s"
