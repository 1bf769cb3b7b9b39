//! Every version of a read-only image that VMs here booted over, kept in
//! `<data dir>/images/` as `<size>-<head hash>.img`, named by its
//! [`ImageIdentity`]: a hard link to the image file (a sparse copy when it
//! cannot be linked: the image is on another file system, as the lab's
//! image disk is, or it is another user's).
//!
//! A snapshot records the path and identity of each image its VM read, and
//! the guest's memory holds that image's file system state: it can only be
//! restored over that very image. Images are rebuilt (a new agent, an image
//! pulled again, the lab's image disk replaced) while sandboxes sleep and
//! snapshots wait; without a kept copy, those could never wake again. A
//! restore reads the image where it is now when it is still the same
//! version, else its kept version here ([`Pins::find`]).
//!
//! What is kept goes when nothing needs it: at start and hourly, versions
//! that no snapshot on this node records and no sandbox's VM reads are
//! removed ([`Pins::sweep`]). A restored sandbox's version is its
//! snapshot's (kept while it lives: it was made from it); a booted one's
//! directory names the version it booted over ([`IMAGE_LINK`]).

use std::collections::HashSet;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use devices::virtio::block::ImageIdentity;

/// In a booted sandbox's directory: a link to the kept version of the
/// image its VM booted over (which may be on its way: a copy is made in
/// the background).
pub const IMAGE_LINK: &str = "image";
/// `<data dir>/images`.
pub const PINS_DIR: &str = "images";
const SUFFIX: &str = ".img";
/// A copy's unit: a block of zeros in it is left a hole.
const COPY_CHUNK: usize = 1 << 20;
const ZERO_BLOCK: usize = 4096;
/// A copy's thread's nice value: the lowest priority.
const COPY_NICE: i32 = 19;

static TMP_SEQ: AtomicU64 = AtomicU64::new(0);

pub struct Pins {
    dir: PathBuf,
    /// Versions being copied now: one copy each.
    copying: Arc<Mutex<HashSet<PathBuf>>>,
}

impl Pins {
    pub fn new(data_dir: &Path) -> Self {
        Self {
            dir: data_dir.join(PINS_DIR),
            copying: Default::default(),
        }
    }

    /// Where version `id` of an image is kept.
    pub fn path_of(&self, id: ImageIdentity) -> PathBuf {
        self.dir
            .join(format!("{}-{:032x}{SUFFIX}", id.size, id.head))
    }

    /// Keeps the image at `image` as it is now, and returns its version
    /// and where it is kept (nothing is done when it is kept already). A
    /// hard link is made at once; a copy (where the image cannot be linked)
    /// is made on a thread of its own, whose failure is logged.
    pub fn keep(&self, image: &Path) -> io::Result<(ImageIdentity, PathBuf)> {
        // Identified and linked through one open file: an image replaced
        // in between cannot be kept under another's name.
        let f = File::open(image)?;
        let id = ImageIdentity::of_open(&f)?;
        let kept = self.path_of(id);
        if kept.exists() {
            return Ok((id, kept));
        }
        std::fs::create_dir_all(&self.dir)?;
        let tmp = self.tmp_path();
        let from = PathBuf::from(format!(
            "/proc/self/fd/{}",
            rustix::fd::AsRawFd::as_raw_fd(&f)
        ));
        match rustix::fs::linkat(
            rustix::fs::CWD,
            &from,
            rustix::fs::CWD,
            &tmp,
            rustix::fs::AtFlags::SYMLINK_FOLLOW,
        ) {
            Ok(()) => {
                std::fs::rename(&tmp, &kept).inspect_err(|_| {
                    let _ = std::fs::remove_file(&tmp);
                })?;
                tracing::info!(
                    "kept image {} ({id}) as {}",
                    image.display(),
                    kept.display()
                );
            }
            // Another file system, links refused (`protected_hardlinks`
            // for an image of another user's), too many, or none at all.
            Err(
                rustix::io::Errno::XDEV
                | rustix::io::Errno::PERM
                | rustix::io::Errno::MLINK
                | rustix::io::Errno::OPNOTSUPP,
            ) => {
                if !lock(&self.copying).insert(kept.clone()) {
                    return Ok((id, kept));
                }
                let (image, to, copying) = (image.to_owned(), kept.clone(), self.copying.clone());
                std::thread::Builder::new()
                    .name("sprout-keep-image".into())
                    .spawn(move || {
                        // Behind the VMs: on a small host it would take
                        // the CPU of the boot it follows. (On Linux a
                        // nice value is the calling thread's alone.)
                        let _ = rustix::process::setpriority_process(None, COPY_NICE);
                        let t = std::time::Instant::now();
                        match copy_sparse(&f, &tmp, &to) {
                            Ok(()) => tracing::info!(
                                "kept image {} ({id}) as a copy, {} in {} ms",
                                image.display(),
                                to.display(),
                                t.elapsed().as_millis()
                            ),
                            Err(e) => {
                                let _ = std::fs::remove_file(&tmp);
                                tracing::warn!(
                                    "cannot keep a copy of image {} as {}: {e}; sandboxes \
                                     asleep over it cannot wake once it is rebuilt",
                                    image.display(),
                                    to.display()
                                );
                            }
                        }
                        lock(&copying).remove(&to);
                    })
                    .inspect_err(|_| {
                        lock(&self.copying).remove(&kept);
                    })?;
            }
            Err(e) => return Err(e.into()),
        }
        Ok((id, kept))
    }

    /// Where version `id` of an image can be read now: at `current` (where
    /// the image is now) while it is that version, else its kept version.
    pub fn find(&self, id: ImageIdentity, current: Option<&Path>) -> Option<PathBuf> {
        if let Some(c) = current.filter(|c| ImageIdentity::of_path(c).is_ok_and(|now| now == id)) {
            return Some(c.to_owned());
        }
        let kept = self.path_of(id);
        kept.is_file().then_some(kept)
    }

    /// Removes every kept version not in `needed`, and copies another
    /// process cut short (this one's may be under way). Returns how many
    /// went.
    pub fn sweep(&self, needed: &HashSet<PathBuf>) -> usize {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        let mine = format!(".tmp-{}-", std::process::id());
        let mut gone = 0;
        for e in rd.flatten() {
            let p = e.path();
            if needed.contains(&p) || e.file_name().to_string_lossy().starts_with(&mine) {
                continue;
            }
            match std::fs::remove_file(&p) {
                Ok(()) => gone += 1,
                Err(err) => tracing::warn!("cannot remove {}: {err}", p.display()),
            }
        }
        gone
    }

    fn tmp_path(&self) -> PathBuf {
        self.dir.join(format!(
            ".tmp-{}-{}",
            std::process::id(),
            TMP_SEQ.fetch_add(1, Ordering::Relaxed)
        ))
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Points `dir`'s [`IMAGE_LINK`] at `kept`.
pub fn link_from(dir: &Path, kept: &Path) -> io::Result<()> {
    let link = dir.join(IMAGE_LINK);
    match std::fs::remove_file(&link) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    std::os::unix::fs::symlink(kept, link)
}

/// What `dir`'s [`IMAGE_LINK`] names, if it has one.
pub fn linked_from(dir: &Path) -> Option<PathBuf> {
    std::fs::read_link(dir.join(IMAGE_LINK)).ok()
}

/// Copies `from` to `tmp`, leaving blocks of zeros as holes, makes it
/// durable, and renames it to `to`.
fn copy_sparse(from: &File, tmp: &Path, to: &Path) -> io::Result<()> {
    let size = from.metadata()?.size();
    let mut src = from;
    src.seek(SeekFrom::Start(0))?;
    let mut out = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(tmp)?;
    let mut buf = vec![0u8; COPY_CHUNK];
    let mut at = 0u64;
    while at < size {
        let n = COPY_CHUNK.min((size - at) as usize);
        src.read_exact(&mut buf[..n])?;
        for (i, block) in buf[..n].chunks(ZERO_BLOCK).enumerate() {
            if block.iter().any(|&b| b != 0) {
                out.seek(SeekFrom::Start(at + (i * ZERO_BLOCK) as u64))?;
                out.write_all(block)?;
            }
        }
        at += n as u64;
    }
    out.set_len(size)?;
    out.sync_all()?;
    std::fs::rename(tmp, to)?;
    File::open(to.parent().unwrap_or(Path::new(".")))?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(dir: &Path, name: &str, seed: u8) -> PathBuf {
        let p = dir.join(name);
        let mut b = vec![0u8; 3 << 20];
        for (i, x) in b.iter_mut().enumerate().take(200_000) {
            *x = (i as u8).wrapping_mul(seed);
        }
        b[(2 << 20) + 5] = seed;
        std::fs::write(&p, &b).unwrap();
        p
    }

    #[test]
    fn a_kept_version_outlives_a_rebuild_and_goes_when_unneeded() {
        let t = tempfile::tempdir().unwrap();
        let pins = Pins::new(&t.path().join("data"));
        let img = image(t.path(), "default.ext4", 3);
        let (one, kept) = pins.keep(&img).unwrap();
        assert_eq!(kept, pins.path_of(one));
        assert_eq!(std::fs::read(&kept).unwrap(), std::fs::read(&img).unwrap());
        // Kept again: the same, nothing new.
        assert_eq!(pins.keep(&img).unwrap(), (one, kept.clone()));
        assert_eq!(pins.find(one, Some(&img)), Some(img.clone()));
        // Rebuilt (a new file moved over it): the old version is found kept.
        let new = image(t.path(), "new.ext4", 5);
        std::fs::rename(&new, &img).unwrap();
        assert_eq!(pins.find(one, Some(&img)), Some(kept.clone()));
        let (two, kept2) = pins.keep(&img).unwrap();
        assert_ne!(one, two);
        assert_eq!(pins.find(two, None), Some(kept2.clone()));
        // Swept: only what is needed stays.
        assert_eq!(pins.sweep(&HashSet::from([kept2.clone()])), 1);
        assert_eq!(pins.find(one, Some(&img)), None);
        assert!(kept2.is_file());
    }

    /// The image on one file system, the data dir on another (tmpfs): kept
    /// as a copy, made on its own thread.
    #[test]
    fn an_image_on_another_file_system_is_kept_as_a_copy() {
        let data = tempfile::tempdir_in("/dev/shm").expect("a tmpfs at /dev/shm");
        let t = tempfile::tempdir().unwrap();
        let dev = |p: &Path| std::fs::metadata(p).unwrap().dev();
        assert_ne!(dev(data.path()), dev(t.path()), "two file systems");
        let pins = Pins::new(data.path());
        let img = image(t.path(), "i.ext4", 9);
        let nice = rustix::process::getpriority_process(None).unwrap();
        let (id, kept) = pins.keep(&img).unwrap();
        let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !kept.exists() {
            assert!(std::time::Instant::now() < until, "no copy after 60 s");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(std::fs::read(&kept).unwrap(), std::fs::read(&img).unwrap());
        assert_eq!(pins.find(id, None), Some(kept));
        // Its thread's low priority is its own.
        assert_eq!(rustix::process::getpriority_process(None).unwrap(), nice);
        // Nothing but the copy is left in the directory.
        assert_eq!(
            std::fs::read_dir(data.path().join(PINS_DIR))
                .unwrap()
                .count(),
            1
        );
    }

    #[test]
    fn a_copy_is_sparse_and_the_same_bytes() {
        let t = tempfile::tempdir().unwrap();
        let img = image(t.path(), "i.ext4", 7);
        let f = File::open(&img).unwrap();
        let (tmp, to) = (t.path().join(".tmp"), t.path().join("copy.img"));
        copy_sparse(&f, &tmp, &to).unwrap();
        assert_eq!(std::fs::read(&to).unwrap(), std::fs::read(&img).unwrap());
        assert!(!tmp.exists());
        let m = std::fs::metadata(&to).unwrap();
        assert_eq!(m.len(), 3 << 20);
        // About 200 KB and one block of data, in a 3 MiB file.
        assert!(m.blocks() * 512 < 1 << 20, "{} blocks", m.blocks());
        assert_eq!(m.mode() & 0o777, 0o644);
    }
}
