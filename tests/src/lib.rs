//! Cross-crate end-to-end tests and their fixtures.
//!
//! The library holds fixtures that several test files share: a real Dovecot started in a
//! temporary directory, Radicale in a virtualenv, the reference enrollment service, the
//! cached ext4 root disk of the Radicale guest ([`radicale_rootfs`]), and helpers to find
//! the workspace's binaries. The tests themselves are in `tests/tests/`, the benchmark
//! command in `src/bin/bench/`.

pub mod dovecot;
pub mod enroll_service;
pub mod operator;
pub mod radicale;
pub mod radicale_rootfs;
pub mod radicale_vm;
pub mod util;
