//! The `guest-init` binary (wired up by the supervisor work).

fn main() {}
