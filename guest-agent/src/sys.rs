//! The few system calls with no safe wrapper: the random driver's ioctls, and the
//! network interface and route ioctls (the guest has no `ip`). Every `unsafe` block of
//! the crate but init's signal handler is here.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;

/// `_IOW('R', 0x03, int[2])`: add entropy to the input pool and credit it.
const RNDADDENTROPY: libc::Ioctl = 0x4008_5203;
/// `_IO('R', 0x07)`: reseed the CRNG from the input pool now.
const RNDRESEEDCRNG: libc::Ioctl = 0x5207;

/// `struct rand_pool_info` with room for 64 bytes.
#[repr(C)]
struct RandPoolInfo {
    entropy_count: libc::c_int,
    buf_size: libc::c_int,
    buf: [u8; 64],
}

/// Mixes `bytes` (at most 64) into the kernel's input pool, crediting 8 bits per byte.
/// Needs CAP_SYS_ADMIN; `random` is an open `/dev/random` or `/dev/urandom`.
pub(crate) fn add_entropy(random: &File, bytes: &[u8]) -> io::Result<()> {
    let mut info = RandPoolInfo {
        entropy_count: 0,
        buf_size: 0,
        buf: [0; 64],
    };
    let n = bytes.len().min(info.buf.len());
    info.buf[..n].copy_from_slice(&bytes[..n]);
    info.buf_size = n as libc::c_int;
    info.entropy_count = (n * 8) as libc::c_int;
    // SAFETY: RNDADDENTROPY reads a rand_pool_info whose buf holds buf_size bytes; `info`
    // is that layout, buf_size <= its 64-byte buffer, and it outlives the call.
    let r = unsafe {
        libc::ioctl(
            random.as_raw_fd(),
            RNDADDENTROPY,
            &info as *const RandPoolInfo,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Reseeds the kernel CRNG from the input pool. Needs CAP_SYS_ADMIN.
pub(crate) fn reseed_crng(random: &File) -> io::Result<()> {
    // SAFETY: RNDRESEEDCRNG takes no argument and touches no user memory.
    let r = unsafe { libc::ioctl(random.as_raw_fd(), RNDRESEEDCRNG) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sets IFF_UP on network interface `name` (e.g. `lo`). Needs CAP_NET_ADMIN.
pub(crate) fn set_link_up(name: &str) -> io::Result<()> {
    let net = NetCtl::new()?;
    let flags = net.flags(name)?;
    net.set_flags(name, flags | IFF_UP_RUNNING)
}

/// IFF_UP | IFF_RUNNING, as the `ifr_flags` member holds them.
pub(crate) const IFF_UP_RUNNING: libc::c_short =
    (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
pub(crate) const IFF_LOOPBACK: libc::c_short = libc::IFF_LOOPBACK as libc::c_short;

/// The interface requests this module makes: each takes a pointer to a `struct ifreq`.
#[derive(Clone, Copy, Debug)]
enum IfRequest {
    GetFlags,
    SetFlags,
    SetHwAddr,
    SetAddr,
    SetNetmask,
}

impl IfRequest {
    /// Its request code (`libc::Ioctl` is `c_ulong` with glibc, `c_int` with musl).
    fn code(self) -> libc::Ioctl {
        (match self {
            IfRequest::GetFlags => libc::SIOCGIFFLAGS,
            IfRequest::SetFlags => libc::SIOCSIFFLAGS,
            IfRequest::SetHwAddr => libc::SIOCSIFHWADDR,
            IfRequest::SetAddr => libc::SIOCSIFADDR,
            IfRequest::SetNetmask => libc::SIOCSIFNETMASK,
        }) as libc::Ioctl
    }
}

/// The route requests this module makes: each takes a pointer to a `struct rtentry`.
#[derive(Clone, Copy, Debug)]
enum RouteRequest {
    Add,
    Delete,
}

impl RouteRequest {
    fn code(self) -> libc::Ioctl {
        (match self {
            RouteRequest::Add => libc::SIOCADDRT,
            RouteRequest::Delete => libc::SIOCDELRT,
        }) as libc::Ioctl
    }
}

/// An IPv4 address as a `struct sockaddr_in` (port 0) in a `struct sockaddr`, which
/// is what the address members of `ifreq` and `rtentry` hold.
fn sockaddr_in(ip: Ipv4Addr) -> libc::sockaddr {
    let mut sa = libc::sockaddr {
        sa_family: libc::AF_INET as libc::sa_family_t,
        sa_data: [0; 14],
    };
    // sin_port (2 bytes, 0), then sin_addr in network order.
    for (d, s) in sa.sa_data[2..6].iter_mut().zip(ip.octets()) {
        *d = s as libc::c_char;
    }
    sa
}

/// Network interface and IPv4 route configuration, through ioctls on an AF_INET
/// datagram socket. Every setter needs CAP_NET_ADMIN.
pub(crate) struct NetCtl {
    sock: socket2::Socket,
}

impl NetCtl {
    pub(crate) fn new() -> io::Result<NetCtl> {
        let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None)?;
        Ok(NetCtl { sock })
    }

    /// A zeroed `ifreq` naming interface `name` (at most 15 bytes, no NUL).
    fn ifreq(name: &str) -> io::Result<libc::ifreq> {
        // SAFETY: ifreq is plain data (a name and a union of plain fields): all zeroes
        // is a valid value.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        if name.len() >= req.ifr_name.len() || name.as_bytes().contains(&0) {
            return Err(io::ErrorKind::InvalidInput.into());
        }
        for (d, s) in req.ifr_name.iter_mut().zip(name.bytes()) {
            *d = s as libc::c_char;
        }
        Ok(req)
    }

    fn if_ioctl(&self, request: IfRequest, req: &mut libc::ifreq) -> io::Result<()> {
        // SAFETY: every IfRequest takes a pointer to a struct ifreq, which the kernel
        // reads (the NUL-terminated name, the member the request sets) and, for a get,
        // writes; `req` is a whole, initialised ifreq that outlives the call.
        let r = unsafe {
            libc::ioctl(
                self.sock.as_raw_fd(),
                request.code(),
                req as *mut libc::ifreq,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// The interface's flags (`IFF_*`); `ENODEV` if there is no such interface.
    pub(crate) fn flags(&self, name: &str) -> io::Result<libc::c_short> {
        let mut req = Self::ifreq(name)?;
        self.if_ioctl(IfRequest::GetFlags, &mut req)?;
        // SAFETY: SIOCGIFFLAGS just filled the flags member of the union (and the union
        // was zeroed before: any value of it is a valid c_short).
        Ok(unsafe { req.ifr_ifru.ifru_flags })
    }

    pub(crate) fn set_flags(&self, name: &str, flags: libc::c_short) -> io::Result<()> {
        let mut req = Self::ifreq(name)?;
        req.ifr_ifru.ifru_flags = flags;
        self.if_ioctl(IfRequest::SetFlags, &mut req)
    }

    /// Sets the interface's Ethernet address (most drivers want it down for that).
    pub(crate) fn set_mac(&self, name: &str, mac: [u8; 6]) -> io::Result<()> {
        let mut req = Self::ifreq(name)?;
        let mut sa = libc::sockaddr {
            sa_family: libc::ARPHRD_ETHER,
            sa_data: [0; 14],
        };
        for (d, s) in sa.sa_data.iter_mut().zip(mac) {
            *d = s as libc::c_char;
        }
        req.ifr_ifru.ifru_hwaddr = sa;
        self.if_ioctl(IfRequest::SetHwAddr, &mut req)
    }

    /// Sets the interface's (primary) IPv4 address, replacing the one it had.
    pub(crate) fn set_address(&self, name: &str, ip: Ipv4Addr) -> io::Result<()> {
        let mut req = Self::ifreq(name)?;
        req.ifr_ifru.ifru_addr = sockaddr_in(ip);
        self.if_ioctl(IfRequest::SetAddr, &mut req)
    }

    /// Sets the netmask of the interface's IPv4 address (after [`Self::set_address`]).
    pub(crate) fn set_netmask(&self, name: &str, mask: Ipv4Addr) -> io::Result<()> {
        let mut req = Self::ifreq(name)?;
        req.ifr_ifru.ifru_netmask = sockaddr_in(mask);
        self.if_ioctl(IfRequest::SetNetmask, &mut req)
    }

    /// A route request for the default route (0.0.0.0/0) through `gateway` on
    /// interface `dev`, or any default route if both are absent.
    fn default_route(
        &self,
        request: RouteRequest,
        gateway: Option<Ipv4Addr>,
        dev: Option<&CString>,
    ) -> io::Result<()> {
        // SAFETY: rtentry is plain data (addresses, integers and a pointer): all zeroes
        // is a valid value, the pointer null.
        let mut rt: libc::rtentry = unsafe { std::mem::zeroed() };
        rt.rt_dst = sockaddr_in(Ipv4Addr::UNSPECIFIED);
        rt.rt_genmask = sockaddr_in(Ipv4Addr::UNSPECIFIED);
        rt.rt_flags = libc::RTF_UP;
        if let Some(gw) = gateway {
            rt.rt_gateway = sockaddr_in(gw);
            rt.rt_flags |= libc::RTF_GATEWAY;
        }
        if let Some(dev) = dev {
            // The kernel only reads the name (it copies it in); the cast to *mut is
            // what the C struct's type asks for.
            rt.rt_dev = dev.as_ptr() as *mut libc::c_char;
        }
        // SAFETY: SIOCADDRT and SIOCDELRT read a struct rtentry; `rt` is a whole,
        // initialised one that outlives the call, and its rt_dev is null or points to
        // `dev`, a NUL-terminated string that also outlives the call.
        let r = unsafe {
            libc::ioctl(
                self.sock.as_raw_fd(),
                request.code(),
                &mut rt as *mut libc::rtentry,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Deletes every IPv4 default route of the main table; how many there were.
    pub(crate) fn delete_default_routes(&self) -> usize {
        // A bound, should a route come back as fast as it goes.
        (0..64)
            .take_while(|_| self.default_route(RouteRequest::Delete, None, None).is_ok())
            .count()
    }

    /// Adds the default route through `gateway` on interface `dev`.
    pub(crate) fn add_default_route(&self, dev: &str, gateway: Ipv4Addr) -> io::Result<()> {
        let dev = CString::new(dev).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        self.default_route(RouteRequest::Add, Some(gateway), Some(&dev))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ipv4_sockaddr_holds_the_address_in_network_order() {
        let sa = sockaddr_in(Ipv4Addr::new(10, 1, 2, 254));
        assert_eq!(sa.sa_family, libc::AF_INET as libc::sa_family_t);
        let data: Vec<u8> = sa.sa_data.iter().map(|&b| b as u8).collect();
        assert_eq!(data, [0, 0, 10, 1, 2, 254, 0, 0, 0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn interface_names_are_checked() {
        assert!(NetCtl::ifreq("eth0").is_ok());
        assert!(NetCtl::ifreq(&"x".repeat(15)).is_ok());
        assert!(NetCtl::ifreq(&"x".repeat(16)).is_err());
        assert!(NetCtl::ifreq("a\0b").is_err());
    }
}
