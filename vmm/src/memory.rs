//! Guest RAM: one memfd holding all of it, mapped shared per region (below the
//! 32-bit MMIO gap, and above 4 GiB), so the whole of RAM is one file that
//! snapshots can write out and restores can map.

use devices::virtio::GuestMemoryMmap;
use std::ffi::CStr;
use std::fs::File;
use std::os::fd::FromRawFd;

use vm_memory::{FileOffset, GuestAddress};

use crate::layout;

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("Cannot create the guest memory file")]
    Memfd(#[source] std::io::Error),
    #[error("Cannot size the guest memory file to {0} bytes")]
    Truncate(u64, #[source] std::io::Error),
    #[error("Cannot map guest memory")]
    Map(#[source] vm_memory::mmap::FromRangesError),
}

/// Guest RAM and the file behind it.
pub struct GuestRam {
    pub mem: GuestMemoryMmap,
    pub file: File,
    pub size: u64,
}

/// Creates `size` bytes of zeroed guest RAM laid out by [`layout::ram_regions`].
pub fn create(size: u64) -> Result<GuestRam, MemoryError> {
    let name: &CStr = c"sprout-guest-ram";
    // SAFETY: memfd_create takes a valid NUL-terminated name and flags; we check
    // the returned fd before use.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(MemoryError::Memfd(std::io::Error::last_os_error()));
    }
    // SAFETY: fd is a freshly created, valid descriptor that nothing else owns.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size)
        .map_err(|e| MemoryError::Truncate(size, e))?;
    let (regions, n) = layout::ram_regions(size);
    let mut offset = 0u64;
    let mut ranges = Vec::with_capacity(n);
    for &(base, len) in &regions[..n] {
        let f = file.try_clone().map_err(MemoryError::Memfd)?;
        ranges.push((
            GuestAddress(base),
            len as usize,
            Some(FileOffset::new(f, offset)),
        ));
        offset += len;
    }
    let mem = GuestMemoryMmap::from_ranges_with_files(ranges).map_err(MemoryError::Map)?;
    Ok(GuestRam { mem, file, size })
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestMemoryBackend};

    #[test]
    fn regions_share_one_file() {
        let ram = create(256 << 20).unwrap();
        assert_eq!(ram.mem.num_regions(), 1);
        ram.mem
            .write_obj(0xdead_beefu32, GuestAddress(0x1000))
            .unwrap();
        let mut b = [0u8; 4];
        use std::os::unix::fs::FileExt;
        ram.file.read_exact_at(&mut b, 0x1000).unwrap();
        assert_eq!(u32::from_le_bytes(b), 0xdead_beef);
        assert!(ram.mem.read_obj::<u32>(GuestAddress(256 << 20)).is_err());
    }
}
