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

    /// The identity of the image as this open file has it now
    /// ([`ImageIdentity`]): one read of at most [`IDENTITY_HEAD_BYTES`].
    pub fn identity(&self) -> Result<ImageIdentity, BlockError> {
        ImageIdentity::of_file(&self.file, self.size).map_err(|source| BlockError::Identity {
            path: self.path.clone(),
            source,
        })
    }
}

/// How many bytes from its start an [`ImageIdentity`] hashes: 64 KiB.
pub const IDENTITY_HEAD_BYTES: u64 = 64 << 10;

/// Which version of a read-only disk image a guest saw: its size and an
/// xxh3-128 of its first [`IDENTITY_HEAD_BYTES`]. A snapshot records it so a
/// restore can refuse an image that is no longer the one whose contents the
/// guest's page cache and file system state hold.
///
/// The head of an ext4 image is its superblock (a random UUID and creation
/// time per `mkfs`; mount, write and unmount times and counts that change
/// with every read-write mount) and its group descriptors, so a rebuilt or
/// edited image differs there; a copy of the same bytes, anywhere, does not.
/// A change that leaves the head alone (bytes rewritten in place deep inside
/// the file, past its file system) is not seen: hashing whole images at every
/// restore would cost seconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ImageIdentity {
    pub size: u64,
    pub head: u128,
}

impl ImageIdentity {
    /// The identity of any file at `path` now (a disk image, or a kernel
    /// that stands for one), as [`FileDisk::identity`] has it for an image.
    pub fn of_path(path: &Path) -> io::Result<ImageIdentity> {
        Self::of_open(&File::open(path)?)
    }

    /// The identity of the open file `f` now.
    pub fn of_open(f: &File) -> io::Result<ImageIdentity> {
        Self::of_file(f, f.metadata()?.len())
    }

    fn of_file(f: &File, size: u64) -> io::Result<ImageIdentity> {
        let mut head = vec![0u8; size.min(IDENTITY_HEAD_BYTES) as usize];
        f.read_exact_at(&mut head, 0)?;
        Ok(ImageIdentity {
            size,
            head: xxhash_rust::xxh3::xxh3_128(&head),
        })
    }
}

impl std::fmt::Display for ImageIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} bytes, head {:032x}", self.size, self.head)
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

    /// The same bytes anywhere are one image; a change in its head or its
    /// size is another; a change past the head is not seen (the documented
    /// limit). A device opened read-only from a file carries its identity.
    #[test]
    fn an_image_is_identified_by_its_size_and_head() {
        let bytes: Vec<u8> = (0..(96u32 << 10)).map(|i| (i % 251) as u8).collect();
        let a = TempImage::new(&bytes);
        let copy = TempImage::new(&bytes);
        let id = ImageIdentity::of_path(&a.0).unwrap();
        assert_eq!(id.size, 96 << 10);
        assert_eq!(id.head, xxhash_rust::xxh3::xxh3_128(&bytes[..64 << 10]));
        assert_eq!(ImageIdentity::of_path(&copy.0).unwrap(), id);
        let mut head = bytes.clone();
        head[1024 + 0x68] ^= 1;
        assert_ne!(
            ImageIdentity::of_path(&TempImage::new(&head).0).unwrap(),
            id
        );
        let mut longer = bytes.clone();
        longer.extend_from_slice(&[0; 512]);
        assert_ne!(
            ImageIdentity::of_path(&TempImage::new(&longer).0).unwrap(),
            id
        );
        let mut deep = bytes.clone();
        deep[80 << 10] ^= 1;
        assert_eq!(
            ImageIdentity::of_path(&TempImage::new(&deep).0).unwrap(),
            id
        );
        // Smaller than the head: all of it. Any file, of any length.
        let odd = TempImage::new(&bytes[..1000]);
        let o = ImageIdentity::of_path(&odd.0).unwrap();
        assert_eq!(
            (o.size, o.head),
            (1000, xxhash_rust::xxh3::xxh3_128(&bytes[..1000]))
        );
        let small = TempImage::new(&bytes[..4096]);
        let s = ImageIdentity::of_path(&small.0).unwrap();
        assert_eq!(s.head, xxhash_rust::xxh3::xxh3_128(&bytes[..4096]));
        assert_eq!(s.to_string(), format!("4096 bytes, head {:032x}", s.head));
        let dev = crate::virtio::block::Block::new(crate::virtio::block::BlockConfig {
            path: a.0.clone(),
            read_only: true,
            id: "img".into(),
        })
        .unwrap();
        assert_eq!(dev.image_identity(), Some(id));
        let rw = crate::virtio::block::Block::new(crate::virtio::block::BlockConfig {
            path: a.0.clone(),
            read_only: false,
            id: "img".into(),
        })
        .unwrap();
        assert_eq!(rw.image_identity(), None);
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
