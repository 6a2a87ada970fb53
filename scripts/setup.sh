#!/usr/bin/env bash
# Installs everything the tests and the demo need on a fresh Debian 12 (bookworm) machine,
# as root. Idempotent: each step is skipped when its result is already there.
#   apt packages, the rustup musl target, a nightly toolchain and cargo-fuzz (fuzzing only),
#   vhost-device-vsock (built from crates.io),
#   the Debian cloud guest kernel with its modules, and a virtualenv with Radicale.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${MICROVM_CACHE:-$ROOT/.cache}
mkdir -p "$CACHE"
say() { printf '[setup] %s\n' "$*"; }

APT_PKGS=(qemu-system-x86 socat dovecot-core cpio gzip e2fsprogs iproute2 kmod file
          util-linux python3-venv debootstrap musl-tools busybox-static)
missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "apt: installing ${missing[*]}"
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi
# Debian starts Dovecot's system service on install where an init system runs; the tests
# start their own instances and need none.
if command -v service >/dev/null && pgrep -x dovecot >/dev/null 2>&1; then
  service dovecot stop >/dev/null 2>&1 || true
fi

if ! rustup target list --installed | grep -q x86_64-unknown-linux-musl; then
  say "rustup: adding x86_64-unknown-linux-musl"
  rustup target add x86_64-unknown-linux-musl
fi

# Fuzzing (tests/fuzz, docs/FUZZING.md) only: a nightly toolchain and cargo-fuzz. The
# workspace itself builds on stable.
if ! rustup run nightly rustc --version >/dev/null 2>&1; then
  say "rustup: installing the nightly toolchain (fuzzing only)"
  rustup toolchain install nightly --profile minimal --no-self-update
fi
if [ ! -x "$CACHE/tools/bin/cargo-fuzz" ]; then
  say "building cargo-fuzz 0.13.2 (a few minutes)"
  cargo install --quiet --locked cargo-fuzz --version 0.13.2 --root "$CACHE/tools"
fi

if [ ! -x "$CACHE/tools/bin/vhost-device-vsock" ]; then
  say "building vhost-device-vsock 0.3.0 (about a minute)"
  cargo install --quiet --locked vhost-device-vsock --version 0.3.0 --root "$CACHE/tools"
fi

# The guest kernel: Debian's cloud flavour (LZ4, fastest to boot under TCG). Its virtio
# and vsock drivers are modules; the .deb ships no modules.dep, so depmod makes one.
kver=$(apt-cache depends linux-image-cloud-amd64 2>/dev/null |
       awk '/Depends: linux-image-[0-9]/{sub("linux-image-","",$2); print $2; exit}')
if [ -z "$kver" ]; then
  apt-get update -q >/dev/null
  kver=$(apt-cache depends linux-image-cloud-amd64 |
         awk '/Depends: linux-image-[0-9]/{sub("linux-image-","",$2); print $2; exit}')
fi
kdir="$CACHE/kernel/$kver"
if [ ! -f "$kdir/vmlinuz" ] || [ ! -f "$kdir/modules/lib/modules/$kver/modules.dep" ]; then
  say "guest kernel: fetching linux-image-$kver"
  tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download -q "linux-image-$kver" >/dev/null 2>&1)
  rm -rf "$kdir"; mkdir -p "$kdir/modules"
  dpkg -x "$tmp"/linux-image-"$kver"_*.deb "$tmp/x"
  cp "$tmp/x/boot/vmlinuz-$kver" "$kdir/vmlinuz"
  mkdir -p "$kdir/modules/lib"
  mv "$tmp/x/lib/modules" "$kdir/modules/lib/modules"
  depmod -b "$kdir/modules" "$kver"
  rm -rf "$tmp"
fi
ln -sfn "$kver" "$CACHE/kernel/current"

if [ ! -x "$CACHE/venv/bin/radicale" ]; then
  say "python: virtualenv with Radicale 3.9.0"
  python3 -m venv "$CACHE/venv"
  "$CACHE/venv/bin/pip" install -q radicale==3.9.0
fi
say "ready: kernel $kver, $("$CACHE/tools/bin/vhost-device-vsock" --version 2>/dev/null || echo vhost-device-vsock)"
