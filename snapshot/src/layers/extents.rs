//! Where a file has data: `FS_IOC_FIEMAP` (many extents per call), used by
//! the checksum code to read sparse files only where they hold data.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// `_IOWR('f', 11, struct fiemap)`.
const FS_IOC_FIEMAP: u64 = 0xc020_660b;
const FIEMAP_EXTENT_LAST: u32 = 0x1;
/// Extents asked for per call.
const BATCH: usize = 256;

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FiemapExtent {
    logical: u64,
    physical: u64,
    length: u64,
    reserved64: [u64; 2],
    flags: u32,
    reserved: [u32; 3],
}

#[repr(C)]
struct Fiemap {
    start: u64,
    length: u64,
    flags: u32,
    mapped_extents: u32,
    extent_count: u32,
    reserved: u32,
    extents: [FiemapExtent; BATCH],
}

/// Every extent of `file` within `[0, size)` the filesystem knows of (data,
/// delayed allocation, unwritten alike: more than the data is fine, reading
/// it finds zeros), as sorted `(start, end)`. `None` if the filesystem has no
/// FIEMAP (the caller then uses `SEEK_DATA`).
pub(crate) fn fiemap_extents(file: &File, size: u64) -> io::Result<Option<Vec<(u64, u64)>>> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut pos = 0u64;
    let mut req = Box::new(Fiemap {
        start: 0,
        length: 0,
        flags: 0,
        mapped_extents: 0,
        extent_count: BATCH as u32,
        reserved: 0,
        extents: [FiemapExtent::default(); BATCH],
    });
    while pos < size {
        req.start = pos;
        req.length = size - pos;
        req.flags = 0;
        req.mapped_extents = 0;
        req.extent_count = BATCH as u32;
        // SAFETY: FS_IOC_FIEMAP reads the header and writes at most
        // `extent_count` extents into the array that follows it, all inside
        // the boxed struct, which outlives the call.
        let r = unsafe {
            libc::ioctl(
                file.as_raw_fd(),
                FS_IOC_FIEMAP as libc::c_ulong,
                &mut *req as *mut Fiemap,
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EOPNOTSUPP) | Some(libc::ENOTTY) | Some(libc::EINVAL) if pos == 0 => {
                    Ok(None)
                }
                _ => Err(e),
            };
        }
        let n = (req.mapped_extents as usize).min(BATCH);
        if n == 0 {
            break;
        }
        let mut last = false;
        for e in &req.extents[..n] {
            let start = e.logical.max(pos);
            let end = e.logical.saturating_add(e.length).min(size);
            if start < end {
                match out.last_mut() {
                    Some((_, pe)) if *pe >= start => *pe = (*pe).max(end),
                    _ => out.push((start, end)),
                }
            }
            last |= e.flags & FIEMAP_EXTENT_LAST != 0;
        }
        let next = req.extents[n - 1]
            .logical
            .saturating_add(req.extents[n - 1].length);
        if last || next <= pos {
            break;
        }
        pos = next;
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    #[test]
    fn fiemap_sees_written_and_delayed_data() {
        let f = tempfile::tempfile().unwrap();
        let size = 4096 * 4096;
        f.set_len(size).unwrap();
        for p in (0..4096u64).step_by(5) {
            f.write_all_at(&[1u8; 4096], p * 4096).unwrap();
        }
        let Some(ext) = fiemap_extents(&f, size).unwrap() else {
            return; // no FIEMAP here: nothing to check
        };
        for p in (0..4096u64).step_by(5) {
            let at = p * 4096;
            assert!(
                ext.iter().any(|&(s, e)| s <= at && at + 4096 <= e),
                "page {p} not covered"
            );
        }
        let covered: u64 = ext.iter().map(|(s, e)| e - s).sum();
        assert!(covered < size / 2);
    }
}
