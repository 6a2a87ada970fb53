//! The console log.
//!
//! PID 1 writes to the console the kernel gave it (fd 2). Every event is one line, stamped
//! with the monotonic clock like the kernel's own `printk` lines, so a person can read the
//! guest's story in order with the kernel's: `[    1.234567] guest-init: <event>`.
//!
//! Design choices:
//! - Each line is formatted into one buffer and written with a single `write(2)`, so lines
//!   from concurrent tasks never interleave mid-line on the console.
//! - No `tracing` subscriber: PID 1 must stay small and start fast, and a one-line format
//!   needs no machinery. The host-side relay, which has no such constraint, uses `tracing`.
//! - Secrets never reach this module: callers log names, ports and error kinds, never
//!   payloads. Enrollment types that hold secrets do not implement `Display`.
//! - The program name is settable so the same module serves helper binaries in tests.

use std::io::Write;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

/// Severity of a console line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum Level {
    /// Something failed; the process goes on or shuts down in order.
    Error = 0,
    /// Something unexpected that the process handled.
    Warn = 1,
    /// A normal event worth one line.
    Info = 2,
    /// Detail for diagnosis; off unless configured.
    Debug = 3,
}

static MAX_LEVEL: AtomicU8 = AtomicU8::new(Level::Info as u8);

/// Sets the most verbose level that is printed.
pub fn set_max_level(level: Level) {
    MAX_LEVEL.store(level as u8, Ordering::Relaxed);
}

/// Whether lines at `level` are printed.
pub fn enabled(level: Level) -> bool {
    level as u8 <= MAX_LEVEL.load(Ordering::Relaxed)
}

/// Time since boot on the monotonic clock (what the kernel stamps its lines with).
pub fn monotonic() -> Duration {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(Duration::from)
        .unwrap_or_default()
}

/// Formats and writes one line. Use the macros instead.
pub fn write_line(level: Level, args: std::fmt::Arguments<'_>) {
    if !enabled(level) {
        return;
    }
    let t = monotonic();
    let tag = match level {
        Level::Error => "error: ",
        Level::Warn => "warning: ",
        Level::Info | Level::Debug => "",
    };
    let mut line = Vec::with_capacity(128);
    // Writing into a Vec cannot fail.
    let _ = write!(
        line,
        "[{:5}.{:06}] guest-init: {tag}{args}",
        t.as_secs(),
        t.subsec_micros()
    );
    // One line, one event: fold any embedded newline so a log line cannot forge another.
    for b in line.iter_mut() {
        if *b == b'\n' || *b == b'\r' {
            *b = b' ';
        }
    }
    line.push(b'\n');
    // The console may be gone (host closed the serial port); logging never fails PID 1.
    let _ = std::io::stderr().lock().write_all(&line);
}

/// Logs an informational line.
#[macro_export]
macro_rules! info {
    ($($arg:tt)*) => { $crate::log::write_line($crate::log::Level::Info, format_args!($($arg)*)) };
}
/// Logs a warning line.
#[macro_export]
macro_rules! warn {
    ($($arg:tt)*) => { $crate::log::write_line($crate::log::Level::Warn, format_args!($($arg)*)) };
}
/// Logs an error line.
#[macro_export]
macro_rules! error {
    ($($arg:tt)*) => { $crate::log::write_line($crate::log::Level::Error, format_args!($($arg)*)) };
}
/// Logs a debug line (printed only when the configured level allows it).
#[macro_export]
macro_rules! debug {
    ($($arg:tt)*) => { $crate::log::write_line($crate::log::Level::Debug, format_args!($($arg)*)) };
}
