//! A TAP device: the host end of a virtio-net device's wire.
//!
//! Opened with `IFF_VNET_HDR` and a 12-byte vnet header, which is exactly the
//! virtio 1.x `virtio_net_hdr_v1`: a frame goes between the guest's buffers
//! and the TAP with its header as is, so checksum and segmentation offloads
//! cost nothing here (the host kernel does the work the header asks for).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::OpenOptionsExt;

use super::HDR_SIZE;

/// `ioctl`s of /dev/net/tun (linux/if_tun.h).
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNSETOFFLOAD: libc::c_ulong = 0x4004_54d0;
const TUNSETVNETHDRSZ: libc::c_ulong = 0x4004_54d8;
const IFF_TAP: i16 = 0x0002;
const IFF_NO_PI: i16 = 0x1000;
const IFF_VNET_HDR: i16 = 0x4000;

/// Offloads the TAP may hand the guest (`TUNSETOFFLOAD`): partial
/// checksums, and TCP segments over the MTU.
pub const TUN_F_CSUM: u32 = 0x01;
pub const TUN_F_TSO4: u32 = 0x02;
pub const TUN_F_TSO6: u32 = 0x04;
pub const TUN_F_TSO_ECN: u32 = 0x08;

/// Longest interface name (IFNAMSIZ less its NUL).
const MAX_NAME: usize = 15;

/// An open TAP interface, non-blocking.
#[derive(Debug)]
pub struct Tap {
    file: File,
    name: String,
}

/// `struct ifreq` as TUNSETIFF takes it: the name, then the flags.
#[repr(C)]
struct IfReq {
    name: [u8; 16],
    flags: i16,
    _pad: [u8; 22],
}

impl Tap {
    /// Opens (creating it if needed, as root or with CAP_NET_ADMIN) the TAP
    /// interface `name`: 1-15 characters of `[A-Za-z0-9_.-]`.
    pub fn open(name: &str) -> io::Result<Tap> {
        let ok = !name.is_empty()
            && name.len() <= MAX_NAME
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
        if !ok {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{name:?} is not a network interface name (1-15 of A-Z a-z 0-9 _ . -)"),
            ));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/net/tun")?;
        let mut req = IfReq {
            name: [0; 16],
            flags: IFF_TAP | IFF_NO_PI | IFF_VNET_HDR,
            _pad: [0; 22],
        };
        req.name[..name.len()].copy_from_slice(name.as_bytes());
        // SAFETY: the fd is open; TUNSETIFF reads (and may write back) one
        // `struct ifreq`, which `req` is, laid out as the kernel's and alive
        // for the call.
        if unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, &mut req) } < 0 {
            return Err(io::Error::last_os_error());
        }
        let hdr = HDR_SIZE as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads one int through the pointer, which
        // points at `hdr`, alive for the call.
        if unsafe { libc::ioctl(file.as_raw_fd(), TUNSETVNETHDRSZ, &hdr) } < 0 {
            return Err(io::Error::last_os_error());
        }
        let len = req.name.iter().position(|&b| b == 0).unwrap_or(16);
        Ok(Tap {
            file,
            name: String::from_utf8_lossy(&req.name[..len]).into_owned(),
        })
    }

    /// The interface's name (as the kernel gave it).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Sets what the TAP may hand on: `TUN_F_*` bits, from the offloads
    /// the guest's driver took (a frame it could not take is segmented and
    /// checksummed by the host kernel instead).
    pub fn set_offload(&self, flags: u32) -> io::Result<()> {
        // SAFETY: TUNSETOFFLOAD takes its argument by value; the fd is open.
        if unsafe { libc::ioctl(self.file.as_raw_fd(), TUNSETOFFLOAD, flags as libc::c_ulong) } < 0
        {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Reads one frame (vnet header first) into `buf`; `WouldBlock` if
    /// there is none.
    pub fn read_frame(&self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: `buf` is valid for writes of its length; the fd is open.
        let n = unsafe { libc::read(self.file.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    /// Writes one frame (vnet header first); `WouldBlock` if the TAP's
    /// queue is full.
    pub fn write_frame(&self, frame: &[u8]) -> io::Result<usize> {
        // SAFETY: `frame` is valid for reads of its length; the fd is open.
        let n = unsafe { libc::write(self.file.as_raw_fd(), frame.as_ptr().cast(), frame.len()) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }
}

impl AsFd for Tap {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}
