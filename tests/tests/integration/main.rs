//! The cross-crate tests, one binary. Everything is real: host-relay and guest-init
//! processes, Dovecot, Radicale, and for the `vm_*`, `enroll_vm*` and `agent_vm*` modules
//! QEMU with Debian's guest kernel and vhost-device-vsock (those VMs are built by
//! [`vm_guest`]). The relay's admission and caller-identity
//! guarantees each have their own module (`relay_*`); enrollment runs end to end against
//! the reference service (`enroll_e2e`) and inside VMs (`enroll_vm*`). Shared helpers
//! live in [`support`]; fixtures (Dovecot, Radicale, the enrollment service) in the
//! `e2e` library.

mod support;

mod agent_e2e;
mod agent_vm;
mod agent_vm_lifecycle;
mod bench_smoke;
mod enroll_disk;
mod enroll_e2e;
mod enroll_vm;
mod enroll_vm_reboot;
mod enroll_vm_tpm;
mod guest_init_binary;
mod relay_burst_of_sign_ins;
mod relay_burst_within_the_services_limit;
mod relay_forged_names_change_nothing;
mod relay_gateway;
mod relay_lifecycle;
mod relay_other_app_unreachable;
mod relay_radicale_chain;
mod relay_undeclared_refused;
mod vm_e2e;
mod vm_guest;
mod vm_radicale;
mod vm_stop;
