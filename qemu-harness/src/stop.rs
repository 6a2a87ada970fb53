//! Ending a running [`Vm`] the ways platforms do, and waiting for QEMU to exit.
//!
//! # Design
//!
//! Three requests, one wait:
//!
//! - [`Vm::stop`]: guest-init's own vsock control port (`stop\n` → `ok stopping\n`,
//!   `docs/CONTRACTS.md`), what this project's host side uses.
//! - [`Vm::power_button`]: QMP `system_powerdown`, the ACPI power button that QEMU, libvirt
//!   (`virsh shutdown`), KubeVirt and Cloud Hypervisor press. guest-init sees `KEY_POWER`.
//! - [`Vm::ctrl_alt_del`]: QMP `send-key ctrl-alt-delete` through the i8042 keyboard, the
//!   path of Firecracker's `SendCtrlAltDel`. guest-init, with Ctrl-Alt-Del disabled, gets
//!   SIGINT from the kernel.
//!
//! After the request the harness waits for QEMU to exit by itself: the app gets SIGTERM and
//! the guest powers off (or reboots, which `-no-reboot` turns into QEMU's exit) in order.
//! Only when that does not happen within the spec's stop timeout is QEMU killed, and the
//! [`StopReport`] says so ([`StopReport::killed`]); a stop is never retried silently.
//! Each stop is recorded as the `stop` phase with its duration.

use std::io::{Read, Write};
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::vm::Vm;
use crate::{qmp, HarnessError};

/// How a stop went.
#[derive(Clone, Debug)]
pub struct StopReport {
    /// The answer to the request: guest-init's line on the control port, or QMP's `return`
    /// value as JSON.
    pub reply: String,
    /// QEMU's exit status.
    pub exit: Option<ExitStatus>,
    /// Whether QEMU had to be killed after the stop timeout.
    pub killed: bool,
    /// From the request to QEMU's exit.
    pub elapsed: Duration,
}

impl StopReport {
    /// QEMU exited 0 by itself.
    pub fn clean(&self) -> bool {
        !self.killed && self.exit.is_some_and(|s| s.success())
    }
}

impl Vm {
    /// Sends one control command (`stop`, `ping`) and returns the answer line.
    pub fn control(&mut self, command: &str) -> Result<String, HarnessError> {
        let port = self.spec.control_port;
        let mut s = self.connect(port, Duration::from_secs(30))?;
        let io = |e| HarnessError::Connect {
            port,
            source: e,
            tail: String::new(),
        };
        s.set_read_timeout(Some(Duration::from_secs(30)))
            .map_err(io)?;
        s.write_all(format!("{command}\n").as_bytes()).map_err(io)?;
        let mut reply = Vec::new();
        let mut byte = [0u8; 1];
        while reply.len() < 256 {
            match s.read(&mut byte) {
                Ok(0) => break,
                Ok(_) if byte[0] == b'\n' => break,
                Ok(_) => reply.push(byte[0]),
                Err(e) => return Err(io(e)),
            }
        }
        Ok(String::from_utf8_lossy(&reply).into_owned())
    }

    /// Runs one QMP command on this VM's QEMU and returns its `return` value.
    pub fn qmp(&mut self, command: &str, arguments: Value) -> Result<Value, HarnessError> {
        qmp::execute(&self.spec.qmp_socket(), command, arguments)
    }

    /// Asks guest-init to stop over its control port and waits for QEMU to exit by itself;
    /// kills it only after the stop timeout, and says so in the report.
    pub fn stop(&mut self) -> Result<StopReport, HarnessError> {
        self.end_with("control port stop", |vm| vm.control("stop"))
    }

    /// Presses the ACPI power button (QMP `system_powerdown`) and waits as [`Vm::stop`]
    /// does.
    pub fn power_button(&mut self) -> Result<StopReport, HarnessError> {
        self.end_with("power button", |vm| {
            vm.qmp("system_powerdown", Value::Null)
                .map(|v| v.to_string())
        })
    }

    /// Presses Ctrl-Alt-Del on the VM's keyboard (QMP `send-key`) and waits as
    /// [`Vm::stop`] does.
    pub fn ctrl_alt_del(&mut self) -> Result<StopReport, HarnessError> {
        self.end_with("ctrl-alt-del", |vm| {
            vm.qmp("send-key", qmp::keys(&["ctrl", "alt", "delete"]))
                .map(|v| v.to_string())
        })
    }

    /// Sends `request`, then waits for QEMU's exit (see the module documentation). A
    /// request that fails kills QEMU and returns the error.
    fn end_with(
        &mut self,
        what: &str,
        request: impl FnOnce(&mut Vm) -> Result<String, HarnessError>,
    ) -> Result<StopReport, HarnessError> {
        let t = Instant::now();
        let reply = match request(self) {
            Ok(r) => r,
            Err(e) => {
                if let Some(q) = self.qemu.as_mut() {
                    q.kill();
                }
                return Err(e);
            }
        };
        let (exit, killed) = self.wait_exit_inner(self.spec.stop_timeout);
        let report = StopReport {
            reply,
            exit,
            killed,
            elapsed: t.elapsed(),
        };
        let detail = if killed {
            format!(
                "{what}: QEMU did not exit within {:?}: KILLED",
                self.spec.stop_timeout
            )
        } else {
            format!(
                "{what}: answer {:?}, QEMU exit {:?}",
                report.reply,
                exit.and_then(|s| s.code())
            )
        };
        self.phase("stop", &detail, t);
        Ok(report)
    }

    fn wait_exit_inner(&mut self, timeout: Duration) -> (Option<ExitStatus>, bool) {
        let Some(q) = self.qemu.as_mut() else {
            return (None, false);
        };
        match q.wait_timeout(timeout) {
            Some(s) => (Some(s), false),
            None => (q.kill(), true),
        }
    }

    /// Waits for the guest to end by itself (e.g. after a fatal error); kills QEMU after
    /// `timeout` and reports [`HarnessError::Timeout`].
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus, HarnessError> {
        match self.wait_exit_inner(timeout) {
            (Some(s), false) => Ok(s),
            _ => Err(HarnessError::Timeout {
                what: "QEMU to exit by itself (it was killed)".into(),
                after: timeout,
                tail: self.console_tail(),
            }),
        }
    }

    /// Whether QEMU is still running.
    pub fn is_running(&mut self) -> bool {
        self.qemu.as_mut().is_some_and(|q| q.try_status().is_none())
    }
}
