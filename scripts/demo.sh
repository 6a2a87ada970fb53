#!/usr/bin/env bash
# The README's first command: sets up a fresh Debian 12 machine and shows the whole path of
# a sign-in once, with real parts end to end:
#
#   HTTP client ──hostfwd──▶ QEMU user net ──▶ Radicale 3.9 (guest, uid radicale)
#     Radicale ──/var/run/dovecot/auth-client──▶ guest-init (PID 1) forwarder
#     ──virtio-vsock──▶ vhost-device-vsock ──<uds>_5001──▶ host-relay ──▶ Dovecot 2.3 (host)
#
# Steps: scripts/setup.sh (apt packages, musl target, vhost-device-vsock, guest kernel,
# Radicale venv), the static musl guest-init and host-relay, the demo program, then the demo
# itself (it builds and caches the Radicale root disk on first use). Run as root.
#
# The guest kernel: `bash scripts/demo.sh --kernel 6.12` (or MICROVM_KERNEL=6.12); setup
# installs Debian's 6.1 (the default) and 6.12 cloud kernels.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
say() { printf '[demo.sh] %s\n' "$*"; }

if [ "$(id -u)" != 0 ]; then
  echo "demo.sh: run as root (setup installs packages; the root disk build uses chroot)" >&2
  exit 1
fi

t0=$(date +%s)
bash scripts/setup.sh
say "building the static musl guest-init and host-relay (release)"
cargo build --release --quiet --target x86_64-unknown-linux-musl -p guest-init -p host-relay
# The demo program itself is not performance-sensitive: the dev profile shares its build
# with `cargo test` (scripts/test.sh), so running both costs one build, not two.
say "building the demo program"
cargo build --quiet -p e2e-tests --bin demo
say "setup and builds took $(( $(date +%s) - t0 )) s; starting the demo"
export GUEST_INIT_MUSL=${GUEST_INIT_MUSL:-$TARGET/x86_64-unknown-linux-musl/release/guest-init}
export HOST_RELAY_MUSL=${HOST_RELAY_MUSL:-$TARGET/x86_64-unknown-linux-musl/release/host-relay}
exec "$TARGET/debug/demo" "$@"
