//! Unpacks compressed kernel modules at image build time, so the guest loads plain ELF.
//!
//! # Why at build time
//!
//! Distributions compress their modules: Debian 13 and the 6.12 backports with xz, Ubuntu
//! and Fedora with zstd or xz, some with gzip. A kernel built with
//! `CONFIG_MODULE_DECOMPRESS=y` could take the compressed file itself through
//! `finit_module(fd, "", MODULE_INIT_COMPRESSED_FILE)`, but only if it was built with the
//! matching decompressor, and older kernels (6.1) refuse the flag. `guest-init` would then
//! need to know, per kernel, which way works. Decompressing here, on the host, removes the
//! question: the initramfs always holds plain `.ko` bytes that `finit_module` with no flags
//! loads on any kernel, and guest-init stays as it is. The cost is a larger uncompressed
//! archive, but the initramfs is gzip-compressed as a whole anyway, so the compressed image
//! grows little (the numbers are in `docs/IMAGE.md`).
//!
//! # How
//!
//! The format is taken from the file name as `modules.dep` lists it (`.ko`, `.ko.xz`,
//! `.ko.zst`, `.ko.gz`), and the bytes must agree: a wrong magic number is an error naming
//! the file, as is a result that is not an ELF object. The decoders are pure Rust
//! (`lzma-rs` for xz, `ruzstd` for zstd, `flate2`'s default Rust back end for gzip), so
//! the builder needs no C libraries and no tools on the host. Decoding is a pure function
//! of the input bytes, so the image stays reproducible.

use std::io::Read;

/// How a module file is compressed, from its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// A plain `.ko`.
    Plain,
    /// `.ko.xz`.
    Xz,
    /// `.ko.zst`.
    Zstd,
    /// `.ko.gz`.
    Gzip,
}

/// The file name endings accepted, for messages.
pub const ACCEPTED: &str = ".ko, .ko.xz, .ko.zst, .ko.gz";

impl Format {
    /// The format of a module file by its name, or `None` if it is not a module file the
    /// builder knows.
    pub fn of(file_name: &str) -> Option<Self> {
        if file_name.ends_with(".ko") {
            Some(Self::Plain)
        } else if file_name.ends_with(".ko.xz") {
            Some(Self::Xz)
        } else if file_name.ends_with(".ko.zst") {
            Some(Self::Zstd)
        } else if file_name.ends_with(".ko.gz") {
            Some(Self::Gzip)
        } else {
            None
        }
    }

    fn magic(self) -> &'static [u8] {
        match self {
            Self::Plain => b"\x7fELF",
            Self::Xz => b"\xfd7zXZ\x00",
            Self::Zstd => b"\x28\xb5\x2f\xfd",
            Self::Gzip => b"\x1f\x8b",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Plain => "ELF",
            Self::Xz => "xz",
            Self::Zstd => "zstd",
            Self::Gzip => "gzip",
        }
    }
}

/// A module file that cannot be turned into plain ELF bytes.
#[derive(Debug, thiserror::Error)]
pub enum DecompressError {
    /// The name says one format, the bytes another.
    #[error(
        "kernel module file {file}: its name says {expected} but it does not start with \
         {expected}'s magic bytes; the kernel's module tree is damaged: reinstall it \
         (scripts/setup.sh) and rerun depmod"
    )]
    BadMagic {
        /// The file.
        file: String,
        /// The format its name gives.
        expected: &'static str,
    },
    /// The decoder failed.
    #[error(
        "kernel module file {file}: {format} data is corrupt or truncated ({reason}); \
         reinstall the kernel's modules (scripts/setup.sh)"
    )]
    Corrupt {
        /// The file.
        file: String,
        /// Its format.
        format: &'static str,
        /// The decoder's message.
        reason: String,
    },
    /// The decompressed bytes are not an ELF object.
    #[error(
        "kernel module file {file}: decompressed {format} data is not an ELF object; \
         is this really a kernel module?"
    )]
    NotElf {
        /// The file.
        file: String,
        /// Its format.
        format: &'static str,
    },
}

/// Returns the plain ELF bytes of the module file `file` (its name, for the format and for
/// messages) whose content is `data`.
pub fn module_bytes(file: &str, data: Vec<u8>) -> Result<Vec<u8>, DecompressError> {
    let format = Format::of(file).unwrap_or(Format::Plain);
    if !data.starts_with(format.magic()) {
        return Err(DecompressError::BadMagic {
            file: file.to_string(),
            expected: format.name(),
        });
    }
    let corrupt = |reason: String| DecompressError::Corrupt {
        file: file.to_string(),
        format: format.name(),
        reason,
    };
    let out = match format {
        Format::Plain => return Ok(data),
        Format::Xz => {
            let mut out = Vec::with_capacity(data.len() * 5);
            lzma_rs::xz_decompress(&mut &data[..], &mut out).map_err(|e| corrupt(e.to_string()))?;
            out
        }
        Format::Zstd => {
            let mut out = Vec::with_capacity(data.len() * 5);
            let mut input = &data[..];
            // A file may hold several frames; each decoder reads exactly one.
            while !input.is_empty() {
                let mut dec = ruzstd::decoding::StreamingDecoder::new(&mut input)
                    .map_err(|e| corrupt(e.to_string()))?;
                dec.read_to_end(&mut out)
                    .map_err(|e| corrupt(e.to_string()))?;
            }
            out
        }
        Format::Gzip => {
            let mut out = Vec::with_capacity(data.len() * 5);
            flate2::read::MultiGzDecoder::new(&data[..])
                .read_to_end(&mut out)
                .map_err(|e| corrupt(e.to_string()))?;
            out
        }
    };
    if !out.starts_with(Format::Plain.magic()) {
        return Err(DecompressError::NotElf {
            file: file.to_string(),
            format: format.name(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn fake_module(seed: u8) -> Vec<u8> {
        let mut v = b"\x7fELF\x02\x01\x01".to_vec();
        for i in 0..20_000u32 {
            v.push((i % 251) as u8 ^ seed);
        }
        v
    }

    #[test]
    fn format_is_taken_from_the_name() {
        assert_eq!(Format::of("kernel/a/b.ko"), Some(Format::Plain));
        assert_eq!(Format::of("kernel/a/b.ko.xz"), Some(Format::Xz));
        assert_eq!(Format::of("kernel/a/b.ko.zst"), Some(Format::Zstd));
        assert_eq!(Format::of("kernel/a/b.ko.gz"), Some(Format::Gzip));
        assert_eq!(Format::of("kernel/a/b.ko.bz2"), None);
    }

    #[test]
    fn zstd_and_gzip_round_trip_and_plain_passes_through() {
        let m = fake_module(7);
        let zst =
            ruzstd::encoding::compress_to_vec(&m[..], ruzstd::encoding::CompressionLevel::Fastest);
        assert_eq!(module_bytes("x.ko.zst", zst.clone()).unwrap(), m);
        // Two frames back to back decode to both contents.
        let mut two = zst.clone();
        two.extend_from_slice(&zst);
        assert_eq!(
            module_bytes("x.ko.zst", two).unwrap(),
            [&m[..], &m[..]].concat()
        );
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&m).unwrap();
        assert_eq!(module_bytes("x.ko.gz", gz.finish().unwrap()).unwrap(), m);
        assert_eq!(module_bytes("x.ko", m.clone()).unwrap(), m);
    }

    #[test]
    fn wrong_magic_corrupt_data_and_non_elf_are_named() {
        let m = fake_module(1);
        let msg = module_bytes("kernel/v/a.ko.xz", m.clone())
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("kernel/v/a.ko.xz") && msg.contains("says xz"),
            "{msg}"
        );
        let mut zst =
            ruzstd::encoding::compress_to_vec(&m[..], ruzstd::encoding::CompressionLevel::Fastest);
        zst.truncate(zst.len() / 2);
        let err = module_bytes("kernel/v/a.ko.zst", zst).unwrap_err();
        assert!(matches!(err, DecompressError::Corrupt { .. }), "{err}");
        assert!(err.to_string().contains("kernel/v/a.ko.zst"), "{err}");
        let not_elf = ruzstd::encoding::compress_to_vec(
            &b"just text"[..],
            ruzstd::encoding::CompressionLevel::Fastest,
        );
        let err = module_bytes("b.ko.zst", not_elf).unwrap_err();
        assert!(matches!(err, DecompressError::NotElf { .. }), "{err}");
        let err = module_bytes("c.ko", b"text".to_vec()).unwrap_err();
        assert!(matches!(err, DecompressError::BadMagic { .. }), "{err}");
    }
}
