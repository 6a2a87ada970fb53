//! Checks that a binary is a static x86-64 ELF executable, fit to be a VM's `/init`.
//!
//! # Why
//!
//! An initramfs built by this crate holds no C library and no dynamic loader. A dynamically
//! linked `/init` would make the kernel fail to execute it and panic with "No working init
//! found" — a failure that shows up only at boot, on a console, far from its cause. So the
//! image builder refuses such a binary up front with a message that says how to fix it.
//!
//! # How
//!
//! Only the ELF header and program headers are read: a binary that needs a dynamic loader
//! names it in a `PT_INTERP` program header. (A static-PIE binary has type `ET_DYN` but no
//! `PT_INTERP`; it runs without a loader and is accepted.)

/// Why a binary cannot be `/init`.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ElfError {
    /// Not an ELF file at all.
    #[error("not an ELF executable (bad magic)")]
    NotElf,
    /// Not 64-bit little-endian x86-64.
    #[error("not a 64-bit x86-64 ELF executable (class {class}, machine {machine})")]
    WrongArch {
        /// EI_CLASS.
        class: u8,
        /// e_machine.
        machine: u16,
    },
    /// Headers point outside the file.
    #[error("truncated or corrupt ELF headers")]
    Truncated,
    /// Has a `PT_INTERP`: needs a dynamic loader.
    #[error(
        "dynamically linked (needs the loader {interp}); build it static, e.g. \
         `cargo build --release --target x86_64-unknown-linux-musl`"
    )]
    Dynamic {
        /// The requested interpreter path.
        interp: String,
    },
}

const PT_INTERP: u32 = 3;
const EM_X86_64: u16 = 62;

fn u16_at(b: &[u8], off: usize) -> Result<u16, ElfError> {
    b.get(off..off + 2)
        .map(|s| u16::from_le_bytes([s[0], s[1]]))
        .ok_or(ElfError::Truncated)
}

fn u32_at(b: &[u8], off: usize) -> Result<u32, ElfError> {
    b.get(off..off + 4)
        .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
        .ok_or(ElfError::Truncated)
}

fn u64_at(b: &[u8], off: usize) -> Result<u64, ElfError> {
    let s = b.get(off..off + 8).ok_or(ElfError::Truncated)?;
    let mut a = [0u8; 8];
    a.copy_from_slice(s);
    Ok(u64::from_le_bytes(a))
}

/// Returns `Ok(())` when `bytes` is a static x86-64 ELF executable.
pub fn check_static(bytes: &[u8]) -> Result<(), ElfError> {
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" {
        return Err(ElfError::NotElf);
    }
    let class = bytes[4];
    let data = bytes[5];
    let machine = u16_at(bytes, 18)?;
    if class != 2 || data != 1 || machine != EM_X86_64 {
        return Err(ElfError::WrongArch { class, machine });
    }
    let phoff = usize::try_from(u64_at(bytes, 32)?).map_err(|_| ElfError::Truncated)?;
    let phentsize = usize::from(u16_at(bytes, 54)?);
    let phnum = usize::from(u16_at(bytes, 56)?);
    if phentsize < 56 {
        return Err(ElfError::Truncated);
    }
    for i in 0..phnum {
        let ph = phoff
            .checked_add(i.checked_mul(phentsize).ok_or(ElfError::Truncated)?)
            .ok_or(ElfError::Truncated)?;
        if u32_at(bytes, ph)? == PT_INTERP {
            let off = usize::try_from(u64_at(bytes, ph + 8)?).map_err(|_| ElfError::Truncated)?;
            let size = usize::try_from(u64_at(bytes, ph + 32)?).map_err(|_| ElfError::Truncated)?;
            let raw = bytes
                .get(off..off.saturating_add(size))
                .ok_or(ElfError::Truncated)?;
            let interp = String::from_utf8_lossy(raw)
                .trim_end_matches('\0')
                .to_string();
            return Err(ElfError::Dynamic { interp });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dynamic_host_binary_is_refused_with_its_loader() {
        // Every Debian host has a dynamically linked /bin/sh.
        let bytes = std::fs::read("/bin/sh").unwrap();
        match check_static(&bytes) {
            Err(ElfError::Dynamic { interp }) => assert!(interp.contains("ld-linux"), "{interp}"),
            other => panic!("expected Dynamic, got {other:?}"),
        }
    }

    #[test]
    fn non_elf_and_truncated_are_refused() {
        assert_eq!(check_static(b"#!/bin/sh\necho hi\n"), Err(ElfError::NotElf));
        let bytes = std::fs::read("/bin/sh").unwrap();
        let mut cut = bytes[..64].to_vec();
        // Point the program headers past the end.
        cut[32..40].copy_from_slice(&1_000_000u64.to_le_bytes());
        assert_eq!(check_static(&cut), Err(ElfError::Truncated));
    }

    #[test]
    fn a_static_binary_is_accepted() {
        // busybox-static is installed by scripts/setup.sh.
        let path = "/bin/busybox";
        let Ok(bytes) = std::fs::read(path) else {
            if std::env::var("REQUIRE_ALL").is_ok_and(|v| v == "1") {
                panic!("{path} (busybox-static) is required for this test and missing");
            }
            eprintln!("SKIPPED: {path} is missing");
            return;
        };
        assert_eq!(check_static(&bytes), Ok(()));
    }
}
