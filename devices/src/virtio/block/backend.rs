//! Where a disk's bytes live.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::{BlockError, SECTOR_SIZE};

/// A disk of fixed size, addressed in bytes. Callers keep every access within
/// `size_bytes()`; implementations fail (never panic) on anything else.
///
/// The plain implementation is [`FileDisk`]; a layered copy-on-write backend (a shared
/// read-only base plus a private overlay, for forked VMs) implements the same trait.
pub trait DiskBackend: Send {
    /// Fills all of `buf` from `offset`; a short read is an error.
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Writes all of `buf` at `offset`.
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Makes every completed write durable.
    fn flush(&mut self) -> io::Result<()>;
    /// The disk size in bytes, fixed for the backend's lifetime.
    fn size_bytes(&self) -> u64;
}

/// A disk image file (or block device) read and written with pread/pwrite.
#[derive(Debug)]
pub struct FileDisk {
    file: File,
    path: PathBuf,
    size: u64,
}

impl FileDisk {
    /// Opens `path` read-write, or read-only if `read_only`. Its size must be a multiple
    /// of 512 bytes.
    pub fn open(path: &Path, read_only: bool) -> Result<Self, BlockError> {
        let mut file = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .open(path)
            .map_err(|source| match source.kind() {
                io::ErrorKind::NotFound => BlockError::NotFound(path.to_owned()),
                _ => BlockError::Open {
                    path: path.to_owned(),
                    source,
                },
            })?;
        // Seeking to the end works for block devices too, whose metadata length is 0.
        let size = file
            .seek(SeekFrom::End(0))
            .map_err(|source| BlockError::Size {
                path: path.to_owned(),
                source,
            })?;
        if !size.is_multiple_of(SECTOR_SIZE) {
            return Err(BlockError::Unaligned {
                path: path.to_owned(),
                size,
            });
        }
        Ok(Self {
            file,
            path: path.to_owned(),
            size,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl DiskBackend for FileDisk {
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }

    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.file.write_all_at(buf, offset)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn size_bytes(&self) -> u64 {
        self.size
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_utils::TempImage;
    use super::*;

    #[test]
    fn open_checks_existence_and_size() {
        let missing = std::env::temp_dir().join("sprout-blk-test-does-not-exist.img");
        let err = FileDisk::open(&missing, false).unwrap_err();
        assert!(matches!(err, BlockError::NotFound(_)));
        assert!(err.to_string().contains("does not exist"), "{err}");

        let odd = TempImage::new(&[0u8; 513]);
        let err = FileDisk::open(&odd.0, true).unwrap_err();
        assert!(matches!(err, BlockError::Unaligned { size: 513, .. }));
        assert!(err.to_string().contains("not a multiple of 512"), "{err}");

        let dir = std::env::temp_dir();
        assert!(matches!(
            FileDisk::open(&dir, false),
            Err(BlockError::Open { .. })
        ));
    }

    #[test]
    fn reads_writes_and_refuses_short_reads() {
        let img = TempImage::new(&[7u8; 1024]);
        let mut d = FileDisk::open(&img.0, false).unwrap();
        assert_eq!(d.size_bytes(), 1024);
        assert_eq!(d.path(), img.0);
        d.write_at(&[1, 2, 3], 510).unwrap();
        d.flush().unwrap();
        let mut b = [0u8; 4];
        d.read_at(&mut b, 509).unwrap();
        assert_eq!(b, [7, 1, 2, 3]);
        assert!(d.read_at(&mut b, 1022).is_err());

        let mut ro = FileDisk::open(&img.0, true).unwrap();
        assert!(ro.write_at(&[0], 0).is_err());
    }
}
