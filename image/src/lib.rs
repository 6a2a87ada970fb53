//! `vm-image`: builds what a micro-VM boots.
//!
//! Two artefacts, both reproducible (the same inputs give the same bytes):
//!
//! - an **initramfs** ([`initramfs`]): a gzip-compressed newc cpio archive ([`cpio`]) with
//!   the static `guest-init` as `/init` ([`elf`] checks it is static), its configuration,
//!   and the kernel modules the configuration lists, expanded in dependency order from the
//!   guest kernel's `modules.dep` ([`modules`]) and decompressed when the kernel ships
//!   them as `.ko.xz`, `.ko.zst` or `.ko.gz` ([`decompress`]);
//! - an optional **ext4 root disk** ([`rootdisk`]) made from a directory without root
//!   privileges, for apps too big for an initramfs.
//!
//! The builder fails early and clearly on what would otherwise only fail at boot as a
//! kernel panic or a silent hang: a dynamically linked init, a module that does not exist,
//! an image over its size limit. The layout it writes is fixed in `docs/CONTRACTS.md`;
//! `docs/IMAGE.md` describes the builder and its command line.

pub mod cpio;
pub mod decompress;
pub mod elf;
pub mod initramfs;
pub mod modules;
pub mod rootdisk;

/// The modules a guest needs for AF_VSOCK over virtio-pci (q35/pc machines), in load order.
/// `modules.dep` does not list `virtio_pci` for the vsock transport, but without it there
/// is no device to bind, so it is named explicitly.
pub const VSOCK_MODULES: &[&str] = &[
    "virtio_ring",
    "virtio",
    "virtio_pci_modern_dev",
    "virtio_pci_legacy_dev",
    "virtio_pci",
    "vsock",
    "vmw_vsock_virtio_transport_common",
    "vmw_vsock_virtio_transport",
];

/// The modules that turn an ACPI power-button press into an input event guest-init can read:
/// the ACPI `button` driver and `evdev` (`/dev/input/event*`). Debian's cloud kernels build
/// both as modules. The initramfs builder adds them to every configuration that loads
/// modules, when the kernel has them (see [`initramfs`]).
pub const POWER_BUTTON_MODULES: &[&str] = &["button", "evdev"];
