//! The `mmap` restore backend: guest RAM as one `MAP_PRIVATE` mapping of the
//! base layer file, with the diff layers' pages laid over it by `MAP_FIXED`
//! private mappings of their own files. The kernel does copy-on-write; page
//! cache pages are shared by every restore of the same snapshot.
//!
//! Each run of consecutive pages a diff layer decides becomes one mapping of
//! that layer's file (pages sit at their natural offsets, so a run is
//! contiguous there too); runs the diffs set back to zero become anonymous
//! mappings. The number of host mappings is bounded by
//! [`MapOptions::max_mappings`]: past it, the shortest runs are copied into
//! the private mapping instead (as are runs shorter than
//! [`MapOptions::copy_runs_below`]).

use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::PathBuf;
use std::ptr::NonNull;

use crate::layers::{LayerFiles, LayerStack, Page, PageSource};
use crate::PAGE_SIZE;

/// Default bound on the host mappings (VMAs) one restore makes; Linux allows
/// 65530 per process by default.
pub const DEFAULT_MAX_MAPPINGS: usize = 8192;

#[derive(Debug, thiserror::Error)]
pub enum MmapError {
    #[error("Restore asks for {asked} bytes of RAM, the snapshot has {actual}")]
    Size { asked: u64, actual: u64 },
    #[error("max_mappings must be at least 1")]
    NoMappings,
    #[error("Cannot map memory layer {path}")]
    Map {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("Cannot map anonymous memory for zero pages")]
    Anon(#[source] std::io::Error),
    #[error("Cannot keep the memory layer files open")]
    Files(#[source] std::io::Error),
}

/// What [`map_private`] built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MapStats {
    /// Host mappings (VMAs) making up guest RAM, at most: the base pieces plus
    /// one per overlaid run.
    pub mappings: usize,
    /// Runs overlaid by a file or anonymous mapping.
    pub overlay_runs: usize,
    /// Pages overlaid from diff layer files.
    pub overlay_pages: u64,
    /// Pages overlaid with anonymous (zero) memory.
    pub zero_pages: u64,
    /// Pages of short runs copied in (`copy_runs_below`, or the mapping
    /// bound).
    pub copied_pages: u64,
}

/// Guest RAM restored by [`map_private`]: unmapped on drop.
#[derive(Debug)]
pub struct PrivateMapping {
    ptr: NonNull<u8>,
    len: usize,
    stats: MapStats,
    /// A SIGBUS here (a layer file truncated under us) ends the process
    /// with a clear reason: see [`crate::fault`].
    _fault: crate::fault::FaultGuard,
    /// The files mapped, to tell a truncated one from other failures.
    files: LayerFiles,
}

// SAFETY: the mapping is owned by this value and only exposed as a raw
// pointer; moving its ownership to another thread is sound.
unsafe impl Send for PrivateMapping {}
// SAFETY: `&PrivateMapping` gives only the address, length and stats; access
// to the memory itself is the caller's business through the raw pointer.
unsafe impl Sync for PrivateMapping {}

impl PrivateMapping {
    /// Start of guest RAM (the RAM offset space).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn len(&self) -> u64 {
        self.len as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn stats(&self) -> MapStats {
        self.stats
    }

    /// The first layer file mapped here that changed size since (a guest
    /// access to a page past its new end fails): see [`LayerFiles`].
    pub fn changed_layer(&self) -> Option<PathBuf> {
        self.files.changed()
    }

    /// Guest RAM as a byte slice.
    ///
    /// # Safety
    /// Nothing (no vCPU, no device, no other thread) may write the memory
    /// while the slice is borrowed.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is `len` readable bytes for as long as `self`
        // lives; the caller guarantees no concurrent writes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PrivateMapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` is the whole region this value mapped (the
        // overlays lie inside it), unmapped once; the caller stopped using the
        // pointer before dropping its owner.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// How [`map_private_with`] lays diff pages over the base.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapOptions {
    /// Most host mappings (VMAs) to make; past it the shortest runs are
    /// copied. At least 1.
    pub max_mappings: usize,
    /// Runs shorter than this many pages are copied rather than mapped
    /// (copying a page costs less than a mapping; a mapped page stays shared
    /// in the page cache). 0 or 1: map every run.
    pub copy_runs_below: u64,
}

impl Default for MapOptions {
    fn default() -> Self {
        MapOptions {
            max_mappings: DEFAULT_MAX_MAPPINGS,
            copy_runs_below: 0,
        }
    }
}

/// Restores `stack` into one private mapping of `mem_bytes` (which must be
/// the stack's size), with [`MapOptions::default`]: every diff run mapped, at
/// most [`DEFAULT_MAX_MAPPINGS`] host mappings.
pub fn map_private(stack: &LayerStack, mem_bytes: u64) -> Result<PrivateMapping, MmapError> {
    map_private_with(stack, mem_bytes, MapOptions::default())
}

/// [`map_private`] with explicit [`MapOptions`].
pub fn map_private_with(
    stack: &LayerStack,
    mem_bytes: u64,
    opts: MapOptions,
) -> Result<PrivateMapping, MmapError> {
    map_private_impl(stack, mem_bytes, opts, None)
}

/// [`map_private_with`] into `at`, which becomes the mapping (its length must
/// be `mem_bytes`): the address stays what the caller registered with KVM.
pub fn map_private_in(
    stack: &LayerStack,
    mem_bytes: u64,
    opts: MapOptions,
    at: crate::Reservation,
) -> Result<PrivateMapping, MmapError> {
    map_private_impl(stack, mem_bytes, opts, Some(at))
}

fn map_private_impl(
    stack: &LayerStack,
    mem_bytes: u64,
    opts: MapOptions,
    at: Option<crate::Reservation>,
) -> Result<PrivateMapping, MmapError> {
    let max_mappings = opts.max_mappings;
    if mem_bytes != stack.mem_bytes() {
        return Err(MmapError::Size {
            asked: mem_bytes,
            actual: stack.mem_bytes(),
        });
    }
    if max_mappings == 0 {
        return Err(MmapError::NoMappings);
    }
    let len = mem_bytes as usize;
    if let Some(r) = &at {
        if r.len() != len {
            return Err(MmapError::Size {
                asked: r.len() as u64,
                actual: mem_bytes,
            });
        }
    }
    // Into a reservation, the base replaces it in place (MAP_FIXED); from then
    // on the PrivateMapping owns (and unmaps) the range.
    let files = stack.files().map_err(MmapError::Files)?;
    let fixed = at.map(|r| r.into_raw().0.as_ptr());
    let base = map_file(fixed, len, stack.layer_fd(0), 0).map_err(|source| {
        if let Some(p) = fixed {
            // SAFETY: the reserved range was ours; after a failed MAP_FIXED
            // it holds either the reservation or nothing, and nobody else
            // refers to it.
            unsafe { libc::munmap(p.cast(), len) };
        }
        MmapError::Map {
            path: stack.layer_path(0).clone(),
            source,
        }
    })?;
    let mut out = PrivateMapping {
        ptr: base,
        len,
        stats: MapStats::default(),
        _fault: crate::fault::FaultGuard::new(base.as_ptr(), len),
        files,
    };
    let (mut runs, mut copied): (Vec<_>, Vec<_>) = stack
        .overlay_runs()
        .into_iter()
        .partition(|r| r.1 >= opts.copy_runs_below);
    // Each overlaid run can split a base mapping in two: keep the longest
    // (max - 1) / 2 runs as mappings, copy the rest in.
    let keep = (max_mappings - 1) / 2;
    if runs.len() > keep {
        runs.sort_unstable_by_key(|r| std::cmp::Reverse(r.1));
        copied.extend(runs.split_off(keep));
        runs.sort_unstable_by_key(|r| r.0);
    }
    for &(first, count, src) in &runs {
        let offset = first as usize * PAGE_SIZE;
        let bytes = count as usize * PAGE_SIZE;
        // SAFETY: first + count <= pages, so the target lies inside `out`.
        let at = unsafe { out.ptr.as_ptr().add(offset) };
        match src {
            PageSource::Layer(i) => {
                map_file(Some(at), bytes, stack.layer_fd(i), offset as i64).map_err(|source| {
                    MmapError::Map {
                        path: stack.layer_path(i).clone(),
                        source,
                    }
                })?;
                out.stats.overlay_pages += count;
            }
            PageSource::Zero => {
                map_anon(at, bytes).map_err(MmapError::Anon)?;
                out.stats.zero_pages += count;
            }
        }
    }
    for &(first, count, _) in &copied {
        for pfn in first..first + count {
            // SAFETY: pfn < pages, so the page lies inside `out`, a private
            // writable mapping nobody else uses yet.
            let dst = unsafe { out.ptr.as_ptr().add(pfn as usize * PAGE_SIZE) };
            match stack.lookup(pfn) {
                // SAFETY: `dst` is a whole writable page of `out`; `data` is a
                // page of a different (read-only) mapping, so they cannot
                // overlap.
                Page::Data(data) => unsafe {
                    std::ptr::copy_nonoverlapping(data.as_ptr(), dst, PAGE_SIZE)
                },
                // SAFETY: `dst` is a whole writable page of `out`.
                Page::Zero => unsafe { std::ptr::write_bytes(dst, 0, PAGE_SIZE) },
            }
        }
        out.stats.copied_pages += count;
    }
    out.stats.overlay_runs = runs.len();
    out.stats.mappings = count_mappings(&runs, stack.pages());
    Ok(out)
}

/// Host mappings of guest RAM: the overlaid runs (sorted) plus the base
/// pieces between them.
fn count_mappings(runs: &[(u64, u64, PageSource)], pages: u64) -> usize {
    let mut n = runs.len();
    let mut end = 0;
    for &(first, count, _) in runs {
        n += usize::from(first > end);
        end = first + count;
    }
    n + usize::from(end < pages)
}

/// `mmap` of `len` bytes of `fd` at `offset`, private and writable; at `at`
/// (replacing what is there) or wherever the kernel chooses.
fn map_file(
    at: Option<*mut u8>,
    len: usize,
    fd: BorrowedFd<'_>,
    offset: i64,
) -> std::io::Result<NonNull<u8>> {
    let fixed = if at.is_some() { libc::MAP_FIXED } else { 0 };
    // SAFETY: with `at` None the kernel picks a free range; with `at` Some the
    // caller passes a range inside a mapping it owns and has not handed out
    // yet, so replacing it affects no other memory. The result is checked.
    let p = unsafe {
        libc::mmap(
            at.unwrap_or(std::ptr::null_mut()).cast(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_NORESERVE | fixed,
            fd.as_raw_fd(),
            offset,
        )
    };
    checked(p, at)
}

/// Anonymous private zero memory at `at`, replacing what is there.
fn map_anon(at: *mut u8, len: usize) -> std::io::Result<NonNull<u8>> {
    // SAFETY: `at..at + len` lies inside a mapping the caller owns and has not
    // handed out yet, so replacing it affects no other memory.
    let p = unsafe {
        libc::mmap(
            at.cast(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    checked(p, Some(at))
}

fn checked(p: *mut libc::c_void, at: Option<*mut u8>) -> std::io::Result<NonNull<u8>> {
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    if at.is_some_and(|a| a.cast() != p) {
        return Err(std::io::Error::other("MAP_FIXED mapping moved"));
    }
    NonNull::new(p.cast()).ok_or_else(|| std::io::Error::other("mmap returned NULL"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Snapshot;
    use crate::layers::DirtyBitmap;
    use crate::testutil::{diff, fill, full, zero};

    fn check(m: &PrivateMapping, ram: &[u8]) {
        // SAFETY: nothing else uses the mapping in this test.
        let got = unsafe { m.as_slice() };
        for (pfn, (a, b)) in got.chunks(PAGE_SIZE).zip(ram.chunks(PAGE_SIZE)).enumerate() {
            assert!(a == b, "page {pfn} differs");
        }
    }

    #[test]
    fn overlays_and_the_mapping_bound() {
        let dir = tempfile::tempdir().unwrap();
        let pages = 512u64;
        let mut ram = vec![0u8; pages as usize * PAGE_SIZE];
        for p in 0..pages / 2 {
            fill(&mut ram, p, 1);
        }
        let base = full(dir.path(), "base", &ram);
        let mut dirty = DirtyBitmap::new(pages);
        for p in (0..pages).step_by(3) {
            if p % 2 == 0 {
                fill(&mut ram, p, 2);
            } else {
                zero(&mut ram, p);
            }
            dirty.set(p);
        }
        for p in 300..340 {
            fill(&mut ram, p, 3);
            dirty.set(p);
        }
        let top = diff(dir.path(), "top", &base, &ram, &dirty);
        let stack = LayerStack::open(&Snapshot::load_chain(top.dir()).unwrap()).unwrap();
        let m = map_private(&stack, ram.len() as u64).unwrap();
        check(&m, &ram);
        let s = m.stats();
        assert_eq!(s.copied_pages, 0);
        assert!(s.overlay_runs > 100 && s.mappings <= 2 * s.overlay_runs + 1);
        let opts = MapOptions {
            max_mappings: 9,
            ..Default::default()
        };
        let small = map_private_with(&stack, ram.len() as u64, opts).unwrap();
        check(&small, &ram);
        let s = small.stats();
        assert_eq!(s.overlay_runs, 4);
        assert!(s.mappings <= 9 && s.copied_pages > 0);
        assert!(s.overlay_pages >= 40, "the long run is kept: {s:?}");
        let opts = MapOptions {
            copy_runs_below: 2,
            ..Default::default()
        };
        let copying = map_private_with(&stack, ram.len() as u64, opts).unwrap();
        check(&copying, &ram);
        assert_eq!(copying.stats().overlay_runs, 1, "{:?}", copying.stats());
        // Writes are private.
        // SAFETY: the mapping is writable and nothing else uses it.
        unsafe { m.as_ptr().write(0xee) };
        let again = map_private(&stack, ram.len() as u64).unwrap();
        check(&again, &ram);
        assert!(map_private(&stack, 4096).is_err());
    }
}
