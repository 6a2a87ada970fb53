//! `bench --vm --vm-profile`: a profile of each forwarder's 64-byte round trip, taken
//! inside the bench guest with the host's own `perf`.
//!
//! The guest image carries `perf` the way it carries socat ([`super::vm_fwd::host_program`]:
//! the binary, every library `ldd` lists and the loader, at their host paths). Debian's
//! `linux-perf` may install `/usr/bin/perf` as a wrapper script that runs
//! `perf_<kernel version>`; [`perf_elf`] finds the ELF either way. The guest needs two
//! things guest-init does not give an app, both set up from the kernel command line
//! ([`CMDLINE`]):
//!
//! - `kernel.perf_event_paranoid=-1`: the app (unprivileged, every capability dropped by
//!   guest-init) may count system-wide and read tracepoints. Only in this opt-in bench
//!   guest; nothing else runs there.
//! - tracefs, for the system-call tracepoints: `rdinit=/bin/guest-probe` makes the probe a
//!   pre-init that mounts tracefs for the app's group and then execs guest-init as PID 1.
//!
//! After its rounds the probe profiles each path (`guest-probe/profile.rs`) and prints
//! `guest-probe: profile path=NAME KIND| TEXT` lines; [`lines`] collects them, and the
//! bench prints them after the tables and writes them to the JSON (`vm_forwarder_profile`).
//! Without `perf` on the host the option is a note and the bench runs without it.

use std::path::{Path, PathBuf};

use vm_image::initramfs::ExtraFile;

/// Where the guest finds `perf`.
pub const GUEST_PERF: &str = "/usr/bin/perf";
/// Kernel command-line additions for a profiling boot: the sysctls, the pre-init, and (an
/// environment variable for init) the group that may read tracefs.
pub fn cmdline() -> String {
    format!("{CMDLINE} GUEST_PROBE_TRACEFS_GID={}", super::vm::APP_UID)
}
const CMDLINE: &str = "sysctl.kernel.perf_event_paranoid=-1 sysctl.kernel.kptr_restrict=0 \
                       rdinit=/bin/guest-probe";
/// What a profiling boot adds to the probe's time: per path three `perf` runs of 3 s and
/// two reports, each far slower under TCG than on the host.
pub const EXTRA_TIMEOUT_MS: u64 = 15 * 60 * 1000;

/// `perf` and what it needs in the guest, or why it cannot be carried.
pub fn files() -> Result<Vec<ExtraFile>, String> {
    let host = super::vm_fwd::which("perf")
        .ok_or("perf is not installed on the host (apt-get install linux-perf)")?;
    let elf = perf_elf(&host)?;
    super::vm_fwd::host_program(&elf, GUEST_PERF)
}

/// The `perf` ELF: `host` itself, or, when it is Debian's wrapper script, the newest
/// `perf_*` ELF beside it.
fn perf_elf(host: &Path) -> Result<PathBuf, String> {
    if is_elf(host) {
        return Ok(host.to_path_buf());
    }
    let dir = host.parent().unwrap_or(Path::new("/usr/bin"));
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("cannot list {}: {e}", dir.display()))?
        .filter_map(|e| Some(e.ok()?.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("perf_"))
                && is_elf(p)
        })
        .collect();
    found.sort();
    found.pop().ok_or(format!(
        "{} is not an ELF and no perf_<version> ELF is beside it",
        host.display()
    ))
}

fn is_elf(p: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    std::fs::File::open(p)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && magic == *b"\x7fELF"
}

/// The profile lines of a console, without the console's timestamps and prefix.
pub fn lines(console: &str) -> Vec<String> {
    console
        .lines()
        .filter_map(|l| l.split("guest-probe: profile").nth(1))
        .map(|rest| format!("profile{}", rest.trim_end()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_profile_lines_only() {
        let console = "[ 1.0] guest-probe: load round=1 path=x rtt_p50_us=1\n\
                       [ 2.0] guest-probe: profile path=socat stat| cpu-clock total=3000msec\n\
                       guest-probe: profile finished\n";
        assert_eq!(
            lines(console),
            [
                "profile path=socat stat| cpu-clock total=3000msec",
                "profile finished"
            ]
        );
    }

    #[test]
    fn a_wrapper_script_is_not_the_elf() {
        let dir = tempfile::tempdir().unwrap();
        let wrapper = dir.path().join("perf");
        std::fs::write(&wrapper, "#!/bin/bash\nexec perf_$version \"$@\"\n").unwrap();
        assert!(perf_elf(&wrapper).unwrap_err().contains("not an ELF"));
        for v in ["perf_5.10", "perf_6.1"] {
            std::fs::write(dir.path().join(v), b"\x7fELF....").unwrap();
        }
        assert_eq!(perf_elf(&wrapper).unwrap(), dir.path().join("perf_6.1"));
        assert_eq!(
            perf_elf(&dir.path().join("perf_5.10")).unwrap(),
            dir.path().join("perf_5.10")
        );
    }
}
