//! The memory key store: the key never touches a disk.
//!
//! Each key's 32-byte scalar lives in a page of its own:
//! - preferably from `memfd_secret(2)` (Linux 5.14+, system call 447 on x86-64): the page
//!   is removed from the kernel's direct map, so not even the kernel reads it casually, it
//!   is never swapped, and it is absent from core dumps;
//! - where that is unavailable (the guest kernel lacks `CONFIG_SECRETMEM`, or `secretmem`
//!   is disabled), an anonymous private mapping that is `mlock`ed (never swapped) and
//!   `MADV_DONTDUMP` (absent from core dumps).
//!
//! The store also makes the process non-dumpable (`PR_SET_DUMPABLE 0`), which keeps
//! `ptrace` and `/proc/<pid>/mem` of other uids away and suppresses core dumps.
//!
//! Signing reconstructs the `p256` signing key on the stack from the page for the one
//! operation and drops it (the `p256` key wipes itself). The page is wiped before it is
//! unmapped. Everything is lost when the process ends: with this store the VM re-enrolls on
//! every boot, which needs fresh bootstrap material per boot (the service gives one
//! token's certificate to one CSR only).
//!
//! Threat: the key reaching a disk (swap, files, core dumps) or another process's view.

use std::collections::HashMap;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use p256::ecdsa::signature::Signer;
use zeroize::Zeroize;

use super::keystore::{slot_for, KeyStore, KeyStoreError, MachineKey, P256Key};

const STORE: &str = "memory";

/// `memfd_secret` on x86-64 (and aarch64).
const SYS_MEMFD_SECRET: libc::c_long = 447;

/// How a secret page was obtained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protection {
    /// `memfd_secret(2)`.
    MemfdSecret,
    /// `mmap` + `mlock` + `MADV_DONTDUMP`.
    Mlock,
}

/// One page of protected memory, wiped and unmapped on drop.
struct SecretPage {
    ptr: NonNull<u8>,
    len: usize,
    protection: Protection,
    // Keeps the secretmem file open for the mapping's life (the mapping would also keep
    // it alive; holding it makes the ownership explicit).
    _fd: Option<OwnedFd>,
}

// SAFETY: the page is written only in `SecretPage::new` before the value is shared, and
// afterwards only read (through `as_slice`) until `Drop`, which has exclusive access; a
// raw mapping has no thread affinity.
unsafe impl Send for SecretPage {}
// SAFETY: see `Send`: after construction the memory is immutable until drop.
unsafe impl Sync for SecretPage {}

impl SecretPage {
    fn new(data: &[u8]) -> io::Result<SecretPage> {
        // SAFETY: sysconf has no memory-safety preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        let len = usize::try_from(page).unwrap_or(4096).max(data.len());
        let mut page = match Self::memfd_secret(len) {
            Ok(p) => p,
            Err(_) => Self::mlocked(len)?,
        };
        page.as_mut_slice()[..data.len()].copy_from_slice(data);
        Ok(page)
    }

    fn memfd_secret(len: usize) -> io::Result<SecretPage> {
        // SAFETY: memfd_secret takes one flags argument and returns a new descriptor or -1;
        // no memory is passed.
        let fd = unsafe { libc::syscall(SYS_MEMFD_SECRET, libc::O_CLOEXEC as libc::c_uint) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let raw = i32::try_from(fd).map_err(|_| io::Error::other("descriptor out of range"))?;
        // SAFETY: the system call just returned this descriptor; nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        nix::unistd::ftruncate(&fd, len as libc::off_t)?;
        // SAFETY: a fresh shared mapping of a descriptor we own, at an address the kernel
        // chooses; the result is checked against MAP_FAILED before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                raw,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(SecretPage {
            ptr: NonNull::new(ptr.cast()).ok_or_else(|| io::Error::other("null mapping"))?,
            len,
            protection: Protection::MemfdSecret,
            _fd: Some(fd),
        })
    }

    fn mlocked(len: usize) -> io::Result<SecretPage> {
        // SAFETY: a fresh anonymous private mapping at a kernel-chosen address; checked
        // against MAP_FAILED before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let page = SecretPage {
            ptr: NonNull::new(ptr.cast()).ok_or_else(|| io::Error::other("null mapping"))?,
            len,
            protection: Protection::Mlock,
            _fd: None,
        };
        // SAFETY: `ptr..ptr+len` is the mapping created above and owned by `page`.
        if unsafe { libc::mlock(ptr, len) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: as above; MADV_DONTDUMP only changes core-dump behaviour.
        if unsafe { libc::madvise(ptr, len, libc::MADV_DONTDUMP) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(page)
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is a live read/write mapping of `len` bytes owned by `self`, and
        // it is only mutated through `&mut self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, with exclusive access through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for SecretPage {
    fn drop(&mut self) {
        self.as_mut_slice().zeroize();
        // SAFETY: unmapping the mapping this value owns; nothing refers to it any more.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// A key whose scalar lives in a [`SecretPage`].
struct MemoryKey {
    page: SecretPage,
    public: Vec<u8>,
}

impl MachineKey for MemoryKey {
    fn public_sec1(&self) -> &[u8] {
        &self.public
    }

    fn sign_der(&self, msg: &[u8]) -> Result<Vec<u8>, KeyStoreError> {
        let sk =
            p256::ecdsa::SigningKey::from_slice(&self.page.as_slice()[..32]).map_err(|_| {
                KeyStoreError::Crypto {
                    store: STORE,
                    what: "the in-memory key is damaged".into(),
                }
            })?;
        let sig: p256::ecdsa::Signature = sk.sign(msg);
        Ok(sig.to_der().as_bytes().to_vec())
    }
}

/// Keys in protected process memory.
pub struct MemoryKeyStore {
    keys: Mutex<HashMap<String, Arc<MemoryKey>>>,
}

impl MemoryKeyStore {
    /// A new, empty store; makes the process non-dumpable.
    pub fn new() -> Result<MemoryKeyStore, KeyStoreError> {
        // SAFETY: prctl(PR_SET_DUMPABLE, 0) takes integer arguments only.
        if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } != 0 {
            return Err(KeyStoreError::Io {
                store: STORE,
                what: "make the process non-dumpable".into(),
                source: io::Error::last_os_error(),
            });
        }
        Ok(MemoryKeyStore {
            keys: Mutex::new(HashMap::new()),
        })
    }

    /// How the key in `slot` is protected.
    pub fn protection(&self, slot: &str) -> Option<Protection> {
        self.lock().get(slot).map(|k| k.page.protection)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<MemoryKey>>> {
        self.keys.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl KeyStore for MemoryKeyStore {
    fn kind(&self) -> &'static str {
        STORE
    }

    fn persistent(&self) -> bool {
        false
    }

    fn generate(&self) -> Result<(String, Arc<dyn MachineKey>), KeyStoreError> {
        let key = P256Key::generate(STORE)?;
        let mut scalar = key.signing_key().to_bytes();
        let page = SecretPage::new(&scalar);
        scalar.as_mut_slice().zeroize();
        let page = page.map_err(|e| KeyStoreError::Io {
            store: STORE,
            what: "allocate protected memory".into(),
            source: e,
        })?;
        let public = key.public_sec1().to_vec();
        drop(key);
        let slot = slot_for(&public);
        let mk = Arc::new(MemoryKey { page, public });
        self.lock().insert(slot.clone(), mk.clone());
        Ok((slot, mk))
    }

    fn open(&self, slot: &str) -> Result<Option<Arc<dyn MachineKey>>, KeyStoreError> {
        Ok(self
            .lock()
            .get(slot)
            .map(|k| k.clone() as Arc<dyn MachineKey>))
    }

    fn remove(&self, slot: &str) -> Result<(), KeyStoreError> {
        self.lock().remove(slot);
        Ok(())
    }

    fn slots(&self) -> Result<Vec<String>, KeyStoreError> {
        Ok(self.lock().keys().cloned().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use p256::ecdsa::signature::Verifier;

    #[test]
    fn keys_sign_from_protected_memory_and_the_process_is_not_dumpable() {
        let store = MemoryKeyStore::new().unwrap();
        // SAFETY: PR_GET_DUMPABLE takes no pointers.
        assert_eq!(unsafe { libc::prctl(libc::PR_GET_DUMPABLE, 0, 0, 0, 0) }, 0);
        let (slot, key) = store.generate().unwrap();
        let p = store.protection(&slot).unwrap();
        eprintln!("memory store protection: {p:?}");
        let der = key.sign_der(b"msg").unwrap();
        let sig = p256::ecdsa::DerSignature::try_from(der.as_slice()).unwrap();
        let sig = p256::ecdsa::Signature::try_from(sig).unwrap();
        let vk = p256::ecdsa::VerifyingKey::from_sec1_bytes(key.public_sec1()).unwrap();
        vk.verify(b"msg", &sig).unwrap();
        assert!(store.open(&slot).unwrap().is_some());
        store.remove(&slot).unwrap();
        assert!(store.open(&slot).unwrap().is_none());
        // A fresh store (a reboot) has nothing.
        assert!(MemoryKeyStore::new().unwrap().slots().unwrap().is_empty());
    }

    #[test]
    fn the_mlock_fallback_holds_data_and_is_locked() {
        let mut page = SecretPage::mlocked(4096).unwrap();
        page.as_mut_slice()[..3].copy_from_slice(b"abc");
        assert_eq!(&page.as_slice()[..3], b"abc");
        assert_eq!(page.protection, Protection::Mlock);
        // The mapping shows as locked in this process's status.
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let locked: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmLck:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap();
        assert!(locked >= 4, "VmLck {locked} kB");
    }
}
