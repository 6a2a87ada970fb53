//! guest-init's integration tests, one binary: the configuration's errors, PID 1 in a PID
//! and mount namespace, the ordinary-process supervisor, forwarding (in process, through
//! the binary, in a child process, and the socket file's life), and enrollment's bad
//! input and bootstrap push. Shared helpers live in [`support`].

mod support;

mod config_errors;
mod enroll_bad_input;
mod enroll_push;
mod forward;
mod forward_binary;
mod forward_process;
mod forward_socket;
mod ordinary;
mod pid1;
