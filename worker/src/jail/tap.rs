//! The sandbox's TAP, made as the jail is entered: in the worker's own
//! network namespace, persistent and owned by the jail uid, so that the
//! VMM (no capabilities by then) can attach to it by name when a boot or
//! restore gives its VM a network device. `sproutd` joins that namespace
//! to the host (a veth pair, addresses, routes) from outside; the TAP goes
//! with the namespace when the worker ends.

use std::io;
use std::os::fd::AsRawFd;

use super::ioctls::{TUNSETGROUP, TUNSETIFF, TUNSETOWNER, TUNSETPERSIST};

/// The TAP's name in every worker's namespace.
pub const TAP_NAME: &str = "tap0";

const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;

/// `struct ifreq` as TUNSETIFF reads it: the name, the flags, padding.
#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// Makes [`TAP_NAME`] in this thread's network namespace, persistent and
/// attachable by `uid`/`gid` only. Needs CAP_NET_ADMIN (the worker is
/// still root here). A host without `/dev/net/tun` gets `NotFound`.
pub fn make(uid: u32, gid: u32) -> io::Result<()> {
    let tun = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")?;
    let mut req = IfReq {
        name: [0; libc::IFNAMSIZ],
        flags: IFF_TAP | IFF_NO_PI | IFF_VNET_HDR,
        _pad: [0; 22],
    };
    req.name[..TAP_NAME.len()].copy_from_slice(TAP_NAME.as_bytes());
    let fd = tun.as_raw_fd();
    let call = |what: &str, r: libc::c_int| {
        if r < 0 {
            let e = io::Error::last_os_error();
            Err(io::Error::new(e.kind(), format!("{what}: {e}")))
        } else {
            Ok(())
        }
    };
    // SAFETY: the fd is open; TUNSETIFF reads (and may write back) one
    // `struct ifreq`, which `req` is, laid out as the kernel's and alive
    // for the call.
    call("TUNSETIFF", unsafe {
        libc::ioctl(fd, TUNSETIFF as libc::c_ulong, &mut req)
    })?;
    // SAFETY: these three take their argument by value; the fd is open
    // and attached to the TAP just made.
    call("TUNSETOWNER", unsafe {
        libc::ioctl(fd, TUNSETOWNER as libc::c_ulong, libc::c_ulong::from(uid))
    })?;
    // SAFETY: as above.
    call("TUNSETGROUP", unsafe {
        libc::ioctl(fd, TUNSETGROUP as libc::c_ulong, libc::c_ulong::from(gid))
    })?;
    // SAFETY: as above.
    call("TUNSETPERSIST", unsafe {
        libc::ioctl(fd, TUNSETPERSIST as libc::c_ulong, 1 as libc::c_ulong)
    })?;
    Ok(())
}
