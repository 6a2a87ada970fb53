#!/usr/bin/env bash
# Installs everything the tests and the demo need on a fresh Debian 12 (bookworm) machine,
# as root. Idempotent: each step is skipped when its result is already there.
#   apt packages, the rustup musl target, a nightly toolchain and cargo-fuzz (fuzzing only),
#   vhost-device-vsock (built from crates.io), the Debian cloud guest kernels (6.1 and
#   6.12) with their modules, and a virtualenv with Radicale.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${MICROVM_CACHE:-$ROOT/.cache}
mkdir -p "$CACHE"
say() { printf '[setup] %s\n' "$*"; }

APT_PKGS=(qemu-system-x86 socat dovecot-core cpio gzip e2fsprogs iproute2 kmod file
          util-linux python3-venv debootstrap musl-tools busybox-static xz-utils zstd
          libfaketime swtpm swtpm-tools)
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

# The guest kernels: Debian's cloud flavour (LZ4, fastest to boot under TCG), two lines of
# it, each resolved through its metapackage to the versioned package:
#   linux-image-cloud-amd64       Debian 12's own 6.1 (virtio_pci a module, plain .ko);
#   linux-image-6.12-cloud-amd64  6.12, the line Debian 13 ships (virtio_pci built in,
#                                 modules compressed with xz; the image builder unpacks them).
# Each lands in <cache>/kernel/<version>/ (vmlinuz, modules/lib/modules/<version>/). The
# .deb ships no modules.dep, so depmod makes one. `current` keeps pointing at 6.1 for
# callers that name no version; the VM tests run on every kernel under <cache>/kernel/.
resolve_kernel() { # metapackage -> versioned release, e.g. 6.1.0-57-cloud-amd64
  apt-cache depends "$1" 2>/dev/null |
    awk '/Depends: linux-image-[0-9]/{sub("linux-image-","",$2); print $2; exit}'
}
fetch_kernel() { # metapackage; prints the release
  local meta=$1 kver kdir tmp
  kver=$(resolve_kernel "$meta")
  if [ -z "$kver" ]; then
    apt-get update -q >/dev/null
    kver=$(resolve_kernel "$meta")
  fi
  if [ -z "$kver" ]; then
    echo "setup: apt knows no $meta; check the bookworm(-security) sources" >&2
    exit 1
  fi
  kdir="$CACHE/kernel/$kver"
  if [ ! -f "$kdir/vmlinuz" ] || [ ! -f "$kdir/modules/lib/modules/$kver/modules.dep" ]; then
    say "guest kernel: fetching linux-image-$kver" >&2
    tmp=$(mktemp -d)
    (cd "$tmp" && apt-get download -q "linux-image-$kver" >/dev/null 2>&1)
    rm -rf "$kdir"; mkdir -p "$kdir/modules"
    dpkg -x "$tmp"/linux-image-"$kver"_*.deb "$tmp/x"
    cp "$tmp/x/boot/vmlinuz-$kver" "$kdir/vmlinuz"
    mkdir -p "$kdir/modules/lib"
    mv "$tmp/x/lib/modules" "$kdir/modules/lib/modules"
    depmod -b "$kdir/modules" "$kver" >&2
    rm -rf "$tmp"
  fi
  echo "$kver"
}
kver=$(fetch_kernel linux-image-cloud-amd64)
kver612=$(fetch_kernel linux-image-6.12-cloud-amd64)
ln -sfn "$kver" "$CACHE/kernel/current"

if [ ! -x "$CACHE/venv/bin/radicale" ]; then
  say "python: virtualenv with Radicale 3.9.0"
  python3 -m venv "$CACHE/venv"
  "$CACHE/venv/bin/pip" install -q radicale==3.9.0
fi
say "ready: kernels $kver (current) and $kver612, $("$CACHE/tools/bin/vhost-device-vsock" --version 2>/dev/null || echo vhost-device-vsock)"
