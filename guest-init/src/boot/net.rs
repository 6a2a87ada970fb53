//! Hostname, loopback and the optional static IPv4 address and default route, set with
//! `ioctl`s on an `AF_INET` socket so no `ip` binary has to be in the image. Interface
//! names are checked before they reach the kernel.

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::BootError;
use crate::config::NetworkConfig;
use crate::info;

/// Sets the hostname.
pub fn set_hostname(name: &str) -> Result<(), BootError> {
    nix::unistd::sethostname(name).map_err(|e| BootError::Sys {
        what: format!("hostname: cannot set {name:?}"),
        source: e.into(),
    })
}

fn inet_socket() -> io::Result<std::os::fd::OwnedFd> {
    Ok(nix::sys::socket::socket(
        nix::sys::socket::AddressFamily::Inet,
        nix::sys::socket::SockType::Datagram,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        None,
    )?)
}

fn ifreq_for(name: &str) -> io::Result<libc::ifreq> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() >= libc::IFNAMSIZ || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "interface name must be 1 to 15 bytes",
        ));
    }
    // SAFETY: `ifreq` is a plain C struct (a name array and a union of plain data); all
    // zero bytes is a valid value for every member.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    Ok(req)
}

fn ioctl_ifreq(
    sock: &impl AsRawFd,
    request: libc::c_ulong,
    req: &mut libc::ifreq,
) -> io::Result<()> {
    // SAFETY: every request passed here (SIOC[GS]IFFLAGS, SIOCSIFADDR, SIOCSIFNETMASK) reads
    // and writes at most one `struct ifreq`, and `req` points to a valid, exclusively
    // borrowed one for the duration of the call.
    let r = unsafe { libc::ioctl(sock.as_raw_fd(), request as _, req as *mut libc::ifreq) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Sets `IFF_UP` (and `IFF_RUNNING`) on an interface.
pub fn interface_up(name: &str) -> io::Result<()> {
    let sock = inet_socket()?;
    let mut req = ifreq_for(name)?;
    ioctl_ifreq(&sock, libc::SIOCGIFFLAGS as _, &mut req)?;
    // SAFETY: SIOCGIFFLAGS just filled `ifru_flags`, the member read here.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    req.ifr_ifru.ifru_flags = flags | (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    ioctl_ifreq(&sock, libc::SIOCSIFFLAGS as _, &mut req)
}

/// Brings up the loopback interface.
pub fn loopback_up() -> Result<(), BootError> {
    interface_up("lo").map_err(|source| BootError::Sys {
        what: "cannot bring up lo".into(),
        source,
    })
}

fn sockaddr_in(addr: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(addr).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: `sockaddr_in` and `sockaddr` are both 16-byte plain C structs; the kernel
    // reads a `sockaddr` that holds a `sockaddr_in` exactly this way.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

/// The IPv4 netmask of a prefix length.
pub fn netmask(prefix: u8) -> Ipv4Addr {
    let bits = if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(prefix.min(32)))
    };
    Ipv4Addr::from(bits)
}

/// Configures one interface with a static IPv4 address and an optional default route.
/// Waits up to `wait_ms` for the interface to appear (its driver may have just loaded).
pub fn configure_network(net: &NetworkConfig) -> Result<(), BootError> {
    let (addr, prefix) = net.parsed_address().map_err(|r| BootError::Network {
        field: "address",
        what: r,
        source: io::ErrorKind::InvalidInput.into(),
    })?;
    let name = net.interface.as_str();
    let deadline = Instant::now() + Duration::from_millis(net.wait_ms);
    while nix::net::if_::if_nametoindex(name).is_err() {
        if Instant::now() >= deadline {
            return Err(BootError::Network {
                field: "interface",
                what: format!(
                    "interface {name} did not appear within {} ms; check its driver module is in `modules`",
                    net.wait_ms
                ),
                source: io::ErrorKind::NotFound.into(),
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let err = |field: &'static str, what: String| {
        move |source: io::Error| BootError::Network {
            field,
            what,
            source,
        }
    };
    let sock = inet_socket().map_err(err("interface", "socket".into()))?;
    let mut req = ifreq_for(name).map_err(err("interface", name.into()))?;
    req.ifr_ifru.ifru_addr = sockaddr_in(addr);
    ioctl_ifreq(&sock, libc::SIOCSIFADDR as _, &mut req)
        .map_err(err("address", format!("SIOCSIFADDR {addr} on {name}")))?;
    let mut req = ifreq_for(name).map_err(err("interface", name.into()))?;
    req.ifr_ifru.ifru_netmask = sockaddr_in(netmask(prefix));
    ioctl_ifreq(&sock, libc::SIOCSIFNETMASK as _, &mut req).map_err(err(
        "address",
        format!("SIOCSIFNETMASK /{prefix} on {name}"),
    ))?;
    interface_up(name).map_err(err("interface", format!("bringing {name} up")))?;
    if let Some(gw) = net.gateway {
        // SAFETY: `rtentry` is a plain C struct; all zero bytes (null `rt_dev`, zero
        // addresses) is a valid value.
        let mut rt: libc::rtentry = unsafe { std::mem::zeroed() };
        rt.rt_dst = sockaddr_in(Ipv4Addr::UNSPECIFIED);
        rt.rt_genmask = sockaddr_in(Ipv4Addr::UNSPECIFIED);
        rt.rt_gateway = sockaddr_in(gw);
        rt.rt_flags = libc::RTF_UP | libc::RTF_GATEWAY;
        // SAFETY: SIOCADDRT reads one `struct rtentry`; `rt` is valid for the call and its
        // `rt_dev` is null (the kernel picks the interface from the gateway's subnet).
        let r = unsafe {
            libc::ioctl(
                sock.as_raw_fd(),
                libc::SIOCADDRT as _,
                &mut rt as *mut libc::rtentry,
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            // A default route that already exists (a second boot step) is fine.
            if e.raw_os_error() != Some(libc::EEXIST) {
                return Err(BootError::Network {
                    field: "gateway",
                    what: format!("SIOCADDRT default via {gw}"),
                    source: e,
                });
            }
        }
    }
    info!(
        "network: {name} {addr}/{prefix}{}",
        net.gateway.map(|g| format!(" via {g}")).unwrap_or_default()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn netmasks() {
        assert_eq!(netmask(24), Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!(netmask(0), Ipv4Addr::new(0, 0, 0, 0));
        assert_eq!(netmask(32), Ipv4Addr::new(255, 255, 255, 255));
        assert_eq!(netmask(9), Ipv4Addr::new(255, 128, 0, 0));
    }

    #[test]
    fn bad_interface_names_are_refused() {
        assert!(ifreq_for("").is_err());
        assert!(ifreq_for("a-very-long-interface-name").is_err());
        assert!(ifreq_for("eth0").is_ok());
    }
}
