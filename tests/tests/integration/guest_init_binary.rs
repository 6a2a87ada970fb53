//! The `guest-init` a VM boots, checked as the kernel will load it: a static ELF (no
//! program interpreter, so nothing to find in an image without a libc) within the 3 MB
//! (3,000,000 bytes) budget the docs state. The size is read from the file the release musl
//! build produced, not from any constant of ours.

use e2e::util::musl_bin;

/// The budget in `README.md`: guest-init stays within 3 MB.
const BUDGET: u64 = 3_000_000;

#[test]
fn guest_init_is_a_static_elf_within_its_size_budget() {
    let path = musl_bin("guest-init");
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(
        &bytes[..4],
        b"\x7fELF",
        "{} is not an ELF file",
        path.display()
    );
    assert!(
        (bytes.len() as u64) <= BUDGET,
        "guest-init is {} bytes, over the {BUDGET}-byte budget",
        bytes.len()
    );
    // ELF64 little-endian: e_phoff at 0x20, e_phentsize at 0x36, e_phnum at 0x38;
    // PT_INTERP (3) names the dynamic loader a dynamic binary needs.
    let u16_at = |o: usize| u16::from_le_bytes([bytes[o], bytes[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(bytes[0x20..0x28].try_into().unwrap()) as usize;
    let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
    assert!(phnum > 0, "no program headers");
    for i in 0..phnum {
        let at = phoff + i * phentsize;
        let p_type = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
        assert_ne!(p_type, 3, "guest-init has a PT_INTERP: it is not static");
    }
    eprintln!("guest-init: {} bytes, static", bytes.len());
}
