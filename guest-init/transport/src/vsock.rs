//! Named vsock addresses (`linux/vm_sockets.h`), so no code spells a CID as a bare number.
//!
//! The CID of a connection's peer is set by the kernel (or, under hybrid vsock, implied by
//! which VMM socket it arrived on), never by anything the peer says: that is what makes
//! it usable for admission.

/// Listen on every CID this side has (`VMADDR_CID_ANY`).
pub const VMADDR_CID_ANY: u32 = u32::MAX;
/// The hypervisor (`VMADDR_CID_HYPERVISOR`).
pub const VMADDR_CID_HYPERVISOR: u32 = 0;
/// Local loopback inside one kernel (`VMADDR_CID_LOCAL`, module `vsock_loopback`).
pub const VMADDR_CID_LOCAL: u32 = 1;
/// The host, as every guest dials it (`VMADDR_CID_HOST`).
pub const VMADDR_CID_HOST: u32 = 2;
/// Any port, when binding (`VMADDR_PORT_ANY`); never a port to dial.
pub const VMADDR_PORT_ANY: u32 = u32::MAX;
/// The first CID a guest can have.
pub const FIRST_GUEST_CID: u32 = 3;
/// Ports at or below this one need `CAP_NET_BIND_SERVICE` to bind (`LAST_RESERVED_PORT`
/// in the kernel's `af_vsock.c`).
pub const LAST_RESERVED_PORT: u32 = 1023;
