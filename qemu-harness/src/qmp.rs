//! A minimal QMP client: the QEMU Machine Protocol on the VM's `-qmp unix:...` socket, used
//! to press the VM's buttons the way a platform does.
//!
//! # Design
//!
//! QMP is JSON objects, one per line. On connect QEMU sends a greeting (`{"QMP": ...}`);
//! the client must answer `{"execute": "qmp_capabilities"}` before any other command; then
//! each `{"execute": NAME, "arguments": {...}}` is answered by `{"return": ...}` or
//! `{"error": {"class": ..., "desc": ...}}`. Asynchronous events (`{"event": ...}`, e.g.
//! `POWERDOWN`) may arrive at any time in between and are skipped.
//!
//! [`execute`] opens a fresh connection per command, negotiates and runs the one command.
//! The harness sends a handful of commands per VM, so a long-lived connection (and a reader
//! for its events) would buy nothing, and QEMU serves a new client as soon as the last one
//! has gone. Every read has a timeout, so a hung QEMU fails the call with an error rather
//! than the test with a hang.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use crate::HarnessError;

/// How long QEMU may take to answer one QMP message.
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

fn err(command: &str, detail: impl std::fmt::Display) -> HarnessError {
    HarnessError::Qmp {
        command: command.to_string(),
        detail: detail.to_string(),
    }
}

/// Reads lines until a reply (`return` or `error`), skipping events; `command` names the
/// request in errors.
fn reply(r: &mut impl BufRead, command: &str) -> Result<Value, HarnessError> {
    loop {
        let mut line = String::new();
        match r.read_line(&mut line) {
            Ok(0) => return Err(err(command, "QEMU closed the QMP connection")),
            Ok(_) => {}
            Err(e) => return Err(err(command, format_args!("reading the reply: {e}"))),
        }
        let v: Value = serde_json::from_str(line.trim())
            .map_err(|e| err(command, format_args!("not JSON ({e}): {line:?}")))?;
        if let Some(ret) = v.get("return") {
            return Ok(ret.clone());
        }
        if let Some(e) = v.get("error") {
            return Err(err(command, format_args!("QEMU refused it: {e}")));
        }
        // `{"event": ...}` or anything else that is not our reply.
    }
}

/// Runs one QMP command on the socket at `socket` and returns its `return` value.
pub fn execute(socket: &Path, command: &str, arguments: Value) -> Result<Value, HarnessError> {
    let s = UnixStream::connect(socket)
        .map_err(|e| err(command, format_args!("connect {}: {e}", socket.display())))?;
    s.set_read_timeout(Some(REPLY_TIMEOUT))
        .map_err(|e| err(command, e))?;
    let mut w = s.try_clone().map_err(|e| err(command, e))?;
    let mut r = BufReader::new(s);
    let mut greeting = String::new();
    r.read_line(&mut greeting)
        .map_err(|e| err(command, format_args!("reading the greeting: {e}")))?;
    if !greeting.contains("\"QMP\"") {
        return Err(err(command, format_args!("no QMP greeting: {greeting:?}")));
    }
    let mut send = |v: Value| {
        let mut line = v.to_string();
        line.push('\n');
        w.write_all(line.as_bytes())
            .map_err(|e| err(command, format_args!("sending: {e}")))
    };
    send(json!({"execute": "qmp_capabilities"}))?;
    reply(&mut r, "qmp_capabilities")?;
    let mut req = json!({ "execute": command });
    if !arguments.is_null() {
        req["arguments"] = arguments;
    }
    send(req)?;
    reply(&mut r, command)
}

/// The arguments of `send-key` for a chord of QEMU key codes (`qcode`s), pressed together
/// and released in reverse order.
pub fn keys(qcodes: &[&str]) -> Value {
    let keys: Vec<Value> = qcodes
        .iter()
        .map(|k| json!({ "type": "qcode", "data": k }))
        .collect();
    json!({ "keys": keys })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    /// A fake QEMU: greets, checks the negotiation, sends an event before each reply, and
    /// answers the command with `answer`. Returns the lines it received.
    fn fake_qemu(sock: &Path, answer: Value) -> std::thread::JoinHandle<Vec<Value>> {
        let l = UnixListener::bind(sock).unwrap();
        std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut w = s.try_clone().unwrap();
            let mut r = BufReader::new(s);
            let mut got = Vec::new();
            writeln!(w, r#"{{"QMP": {{"version": {{}}, "capabilities": []}}}}"#).unwrap();
            for reply in [json!({"return": {}}), answer] {
                let mut line = String::new();
                r.read_line(&mut line).unwrap();
                got.push(serde_json::from_str(&line).unwrap());
                writeln!(w, r#"{{"event": "POWERDOWN", "data": {{}}}}"#).unwrap();
                writeln!(w, "{reply}").unwrap();
            }
            got
        })
    }

    #[test]
    fn a_command_is_negotiated_sent_and_answered() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("qmp.sock");
        let server = fake_qemu(&sock, json!({"return": {"ok": 1}}));
        let ret = execute(&sock, "send-key", keys(&["ctrl", "alt", "delete"])).unwrap();
        assert_eq!(ret, json!({"ok": 1}));
        let got = server.join().unwrap();
        assert_eq!(got[0], json!({"execute": "qmp_capabilities"}));
        assert_eq!(got[1]["execute"], "send-key");
        assert_eq!(
            got[1]["arguments"]["keys"][2],
            json!({"type": "qcode", "data": "delete"})
        );
    }

    #[test]
    fn an_error_reply_names_the_command_and_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("qmp.sock");
        let server = fake_qemu(
            &sock,
            json!({"error": {"class": "GenericError", "desc": "no such thing"}}),
        );
        let e = execute(&sock, "system_powerdown", Value::Null).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("system_powerdown") && msg.contains("no such thing"),
            "{msg}"
        );
        assert!(server.join().unwrap()[1].get("arguments").is_none());
        let e = execute(
            &dir.path().join("none.sock"),
            "system_powerdown",
            Value::Null,
        );
        assert!(e.unwrap_err().to_string().contains("connect"));
    }
}
