//! swtpm, the software TPM 2.0 a VM gets as its vTPM, in the two ways the project runs it.
//!
//! - **For a VM** ([`vm_command`]): `swtpm socket --tpm2 --tpmstate dir=STATE --ctrl
//!   type=unixio,path=SOCK --terminate --flags startup-clear`. QEMU's `-tpmdev emulator`
//!   connects to the control socket and carries the guest's TPM commands over it; swtpm ends
//!   when QEMU closes it. [`crate::vm::Vm`] starts one per VM and supervises it.
//! - **Without a VM** ([`RawServer`]): `--server type=unixio,path=SOCK --flags
//!   not-need-init,startup-clear`, which takes raw TPM 2.0 commands on a stream socket, the
//!   same bytes a guest writes to `/dev/tpmrm0`. Host-side tests and the benchmark talk to
//!   the TPM code this way.
//!
//! Either way the TPM's whole state (its seeds, hence every key it ever wrapped) is the
//! state directory: the same directory is the same TPM, a fresh one a new TPM.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The command that runs a VM's vTPM on `state`, with QEMU's control socket at `ctrl`.
pub fn vm_command(bin: &Path, state: &Path, ctrl: &Path) -> Command {
    let mut cmd = Command::new(bin);
    cmd.args(["socket", "--tpm2", "--terminate", "--tpmstate"])
        .arg(format!("dir={}", state.display()))
        .arg("--ctrl")
        .arg(format!("type=unixio,path={}", ctrl.display()))
        .args(["--flags", "startup-clear"]);
    cmd
}

/// A swtpm taking raw TPM commands on `<state>/data.sock`; killed when dropped.
pub struct RawServer {
    child: std::process::Child,
    socket: PathBuf,
}

impl RawServer {
    /// Starts `swtpm` (from `PATH`) on `state` (created if missing) and waits until it
    /// accepts connections.
    pub fn start(state: &Path) -> std::io::Result<RawServer> {
        std::fs::create_dir_all(state)?;
        let socket = state.join("data.sock");
        let _ = std::fs::remove_file(&socket);
        let child = Command::new("swtpm")
            .args(["socket", "--tpm2", "--tpmstate"])
            .arg(format!("dir={}", state.display()))
            .arg("--server")
            .arg(format!("type=unixio,path={}", socket.display()))
            .args(["--flags", "not-need-init,startup-clear"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let mut server = RawServer { child, socket };
        let deadline = Instant::now() + Duration::from_secs(20);
        while UnixStream::connect(&server.socket).is_err() {
            if let Some(status) = server.child.try_wait()? {
                return Err(std::io::Error::other(format!(
                    "swtpm exited before listening: {status}"
                )));
            }
            if Instant::now() > deadline {
                return Err(std::io::Error::other("swtpm did not listen within 20 s"));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(server)
    }

    /// The socket to connect to (one client at a time).
    pub fn socket(&self) -> &Path {
        &self.socket
    }
}

impl Drop for RawServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
