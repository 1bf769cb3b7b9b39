//! The few system calls with no safe wrapper: the random driver's ioctls and bringing up
//! a network interface. Every `unsafe` block of the crate is here.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// `_IOW('R', 0x03, int[2])`: add entropy to the input pool and credit it.
const RNDADDENTROPY: libc::Ioctl = 0x4008_5203;
/// `_IO('R', 0x07)`: reseed the CRNG from the input pool now.
const RNDRESEEDCRNG: libc::Ioctl = 0x5207;
/// The interface flag requests (`libc::Ioctl` is `c_ulong` with glibc, `c_int` with musl).
const SIOCGIFFLAGS: libc::Ioctl = libc::SIOCGIFFLAGS as libc::Ioctl;
const SIOCSIFFLAGS: libc::Ioctl = libc::SIOCSIFFLAGS as libc::Ioctl;

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
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None)?;
    // SAFETY: ifreq is plain data (a name and a union of plain fields): all zeroes is a
    // valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    if name.len() >= req.ifr_name.len() {
        return Err(io::ErrorKind::InvalidInput.into());
    }
    for (d, s) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS reads the NUL-terminated name from `req` and writes the flags
    // into it; `req` is a whole ifreq that outlives the call.
    if unsafe { libc::ioctl(sock.as_raw_fd(), SIOCGIFFLAGS, &mut req as *mut libc::ifreq) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: SIOCGIFFLAGS just filled the flags member of the union.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    req.ifr_ifru.ifru_flags = flags | (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    // SAFETY: SIOCSIFFLAGS reads the name and flags from `req`, a whole ifreq.
    if unsafe { libc::ioctl(sock.as_raw_fd(), SIOCSIFFLAGS, &req as *const libc::ifreq) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
