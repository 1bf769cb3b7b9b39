//! Guest RAM: one memfd holding all of it, mapped shared per region (below the
//! 32-bit MMIO gap, and above 4 GiB), so the whole of RAM is one file that
//! snapshots can write out and restores can map.

use devices::virtio::GuestMemoryMmap;
use std::ffi::CStr;
use std::fs::File;
use std::os::fd::FromRawFd;

use kvm_bindings::{kvm_userspace_memory_region, KVM_MEM_LOG_DIRTY_PAGES};
use kvm_ioctls::VmFd;
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::{
    FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryRegion, GuestRegionMmap, MmapRegion,
};

use crate::layout;

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("Cannot create the guest memory file")]
    Memfd(#[source] std::io::Error),
    #[error("Cannot size the guest memory file to {0} bytes")]
    Truncate(u64, #[source] std::io::Error),
    #[error("Cannot map guest memory")]
    Map(#[source] vm_memory::mmap::FromRangesError),
    #[error("Cannot describe restored guest memory")]
    Raw(#[source] vm_memory::mmap::MmapRegionError),
    #[error("A shell's memory range of {0} bytes cannot hold {1} bytes of guest RAM")]
    RangeSize(u64, u64),
    #[error("Cannot map guest memory into the shell's range")]
    MapIn(#[source] std::io::Error),
    #[error("Fresh guest memory is not a restore backend")]
    NotRestored,
    #[error("Restored guest memory region overflows the guest address space")]
    Region,
    #[error("Cannot assemble restored guest memory")]
    Regions(#[source] vm_memory::GuestRegionCollectionError),
    #[error("KVM refused to register guest memory")]
    Register(#[source] kvm_ioctls::Error),
    #[error("KVM refused to report dirty pages")]
    DirtyLog(#[source] kvm_ioctls::Error),
}

/// What keeps guest RAM's host mapping alive: the VM's own memfd, or the
/// mapping a restore backend made.
pub enum Backing {
    Memfd(File),
    /// `MAP_PRIVATE` of the snapshot's layer files (kernel copy-on-write).
    Mmap(snapshot::mmap::PrivateMapping),
    /// Anonymous memory filled by a userfaultfd page server.
    Uffd(snapshot::uffd::UffdRestore),
}

impl Backing {
    /// A snapshot layer file backing this RAM that changed size since the
    /// restore mapped it (`None` for a VM's own memfd).
    pub fn changed_layer(&self) -> Option<std::path::PathBuf> {
        match self {
            Backing::Memfd(_) => None,
            Backing::Mmap(m) => m.changed_layer(),
            Backing::Uffd(u) => u.changed_layer(),
        }
    }
}

/// Guest RAM and what backs it. Guest physical regions map, in order, onto
/// one contiguous "RAM offset space" `[0, size)`.
pub struct GuestRam {
    pub mem: GuestMemoryMmap,
    pub size: u64,
    pub backing: Backing,
    /// A shell's reserved range the memfd is mapped over ([`create_in`]):
    /// unmapped when this is dropped, after `mem` (whose regions do not own
    /// their mapping then).
    pub(crate) _range: Option<snapshot::Reservation>,
}

/// A VM's guest RAM, unmapped on drop unless [`KeptRam::leak`] was called:
/// a thread that teardown had to abandon may still touch it, and unmapping
/// memory under a live thread would turn its next access into a SIGSEGV.
pub struct KeptRam {
    ram: std::mem::ManuallyDrop<GuestRam>,
    leak: bool,
}

impl KeptRam {
    pub fn new(ram: GuestRam) -> Self {
        Self {
            ram: std::mem::ManuallyDrop::new(ram),
            leak: false,
        }
    }

    /// Keeps the mapping (and its backing) for the life of the process.
    pub fn leak(&mut self) {
        self.leak = true;
    }
}

impl std::ops::Deref for KeptRam {
    type Target = GuestRam;
    fn deref(&self) -> &GuestRam {
        &self.ram
    }
}

impl Drop for KeptRam {
    fn drop(&mut self) {
        if !self.leak {
            // SAFETY: `ram` is dropped only here, once, and never used after;
            // a leaked `ram` is never dropped at all.
            unsafe { std::mem::ManuallyDrop::drop(&mut self.ram) };
        }
    }
}

/// The memfd behind guest RAM, `size` bytes of zeros.
fn new_memfd(size: u64) -> Result<File, MemoryError> {
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
    Ok(file)
}

/// Creates `size` bytes of zeroed guest RAM laid out by [`layout::ram_regions`].
pub fn create(size: u64) -> Result<GuestRam, MemoryError> {
    let file = new_memfd(size)?;
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
    Ok(GuestRam {
        mem,
        size,
        backing: Backing::Memfd(file),
        _range: None,
    })
}

/// [`create`], with the memfd mapped over a shell's reserved range (whose
/// KVM memory slots already cover it) instead of a new mapping: a boot
/// into a ready worker's shell.
pub fn create_in(size: u64, range: snapshot::Reservation) -> Result<GuestRam, MemoryError> {
    use vm_memory::bitmap::NewBitmap;
    use vm_memory::mmap::MmapRegionBuilder;
    if range.len() as u64 != size {
        return Err(MemoryError::RangeSize(range.len() as u64, size));
    }
    let file = new_memfd(size)?;
    let base = range.as_ptr();
    // SAFETY: MAP_FIXED over `range`, a mapping of exactly `size` bytes this
    // process owns and nothing else uses (a shell's memory is mapped only
    // by a boot or a restore into it, which takes it); the result is
    // checked, and `range` (kept in the GuestRam) unmaps it at the end.
    let p = unsafe {
        libc::mmap(
            base.cast(),
            size as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            std::os::fd::AsRawFd::as_raw_fd(&file),
            0,
        )
    };
    if p != base.cast() {
        return Err(MemoryError::MapIn(std::io::Error::last_os_error()));
    }
    let (regions, n) = layout::ram_regions(size);
    let mut out = Vec::with_capacity(n);
    let mut offset = 0u64;
    for &(gpa, len) in &regions[..n] {
        let f = file.try_clone().map_err(MemoryError::Memfd)?;
        // SAFETY: [base + offset, + len) lies inside the shared mapping
        // made above (offset + len <= size), which outlives the region: it
        // is unmapped only when the GuestRam's `_range` drops, after `mem`.
        let region = unsafe {
            MmapRegionBuilder::<AtomicBitmap>::new_with_bitmap(
                len as usize,
                AtomicBitmap::with_len(len as usize),
            )
            .with_raw_mmap_pointer(base.add(offset as usize))
        }
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
        .with_mmap_flags(libc::MAP_SHARED)
        .with_file_offset(FileOffset::new(f, offset))
        .build()
        .map_err(MemoryError::Raw)?;
        out.push(GuestRegionMmap::new(region, GuestAddress(gpa)).ok_or(MemoryError::Region)?);
        offset += len;
    }
    let mem = GuestMemoryMmap::from_regions(out).map_err(MemoryError::Regions)?;
    Ok(GuestRam {
        mem,
        size,
        backing: Backing::Memfd(file),
        _range: Some(range),
    })
}

/// Guest RAM over a restore backend's mapping of the whole RAM offset space.
pub fn from_backing(backing: Backing) -> Result<GuestRam, MemoryError> {
    let (ptr, size) = match &backing {
        Backing::Memfd(_) => return Err(MemoryError::NotRestored),
        Backing::Mmap(m) => (m.as_ptr(), m.len()),
        Backing::Uffd(u) => (u.as_ptr(), u.len()),
    };
    let (regions, n) = layout::ram_regions(size);
    let mut out = Vec::with_capacity(n);
    let mut offset = 0u64;
    for &(base, len) in &regions[..n] {
        // SAFETY: the backend's mapping is live, page-aligned, read-write and
        // `size` bytes long; offset + len <= size keeps this sub-range inside it,
        // and the mapping outlives the region (it is kept in `GuestRam::backing`,
        // which is dropped after `mem`).
        let region = unsafe {
            MmapRegion::<AtomicBitmap>::build_raw(
                ptr.add(offset as usize),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE,
            )
        }
        .map_err(MemoryError::Raw)?;
        out.push(GuestRegionMmap::new(region, GuestAddress(base)).ok_or(MemoryError::Region)?);
        offset += len;
    }
    let mem = GuestMemoryMmap::from_regions(out).map_err(MemoryError::Regions)?;
    Ok(GuestRam {
        mem,
        size,
        backing,
        _range: None,
    })
}

/// Registers one guest memory slot: `len` bytes of host memory at `hva` as
/// guest physical `gpa`.
///
/// # Safety
/// `[hva, hva + len)` must stay mapped (it may be remapped in place) for as
/// long as the VM fd exists; `Vm` closes the VM fd before unmapping memory.
unsafe fn set_slot(
    vm: &VmFd,
    slot: u32,
    gpa: u64,
    len: u64,
    hva: u64,
    track_dirty: bool,
) -> Result<(), MemoryError> {
    let region = kvm_userspace_memory_region {
        slot,
        guest_phys_addr: gpa,
        memory_size: len,
        userspace_addr: hva,
        flags: if track_dirty {
            KVM_MEM_LOG_DIRTY_PAGES
        } else {
            0
        },
    };
    // SAFETY: the caller keeps the range mapped for the VM fd's lifetime (see
    // this function's contract); KVM only records it here.
    unsafe { vm.set_user_memory_region(region) }.map_err(MemoryError::Register)
}

/// Registers every region of `mem` with KVM, slot `i` for region `i`, with
/// dirty logging when `track_dirty`.
pub fn register(vm: &VmFd, mem: &GuestMemoryMmap, track_dirty: bool) -> Result<(), MemoryError> {
    for (slot, r) in mem.iter().enumerate() {
        // SAFETY: the region is a live host mapping owned by `mem`, which the
        // VMM keeps mapped until after the VM fd is closed.
        unsafe {
            set_slot(
                vm,
                slot as u32,
                r.start_addr().0,
                r.len(),
                r.as_ptr() as u64,
                track_dirty,
            )
        }?;
    }
    Ok(())
}

/// Registers guest memory regions over `[base, base + size)` (the RAM offset
/// space, region by region) before anything is mapped there for good: a
/// restore later maps the snapshot over the same range.
pub fn register_range(
    vm: &VmFd,
    base: *mut u8,
    size: u64,
    track_dirty: bool,
) -> Result<(), MemoryError> {
    let (regions, n) = layout::ram_regions(size);
    let mut offset = 0u64;
    for (slot, &(gpa, len)) in regions[..n].iter().enumerate() {
        // SAFETY: the caller owns `[base, base + size)` (a reservation that
        // becomes the VM's guest RAM and stays mapped until after the VM fd is
        // closed).
        unsafe { set_slot(vm, slot as u32, gpa, len, base as u64 + offset, track_dirty) }?;
        offset += len;
    }
    Ok(())
}

/// Pages changed since the last call, over the RAM offset space (bit `i` =
/// page `i`, KVM's word layout): KVM's dirty log (guest writes) or'ed with the
/// regions' own bitmaps (writes the VMM made through `mem`). Both are reset.
pub fn take_dirty(vm: &VmFd, mem: &GuestMemoryMmap) -> Result<Vec<u64>, MemoryError> {
    let mut out = Vec::new();
    for (slot, r) in mem.iter().enumerate() {
        let mut kvm_log = vm
            .get_dirty_log(slot as u32, r.len() as usize)
            .map_err(MemoryError::DirtyLog)?;
        let mapping: &MmapRegion<AtomicBitmap> = r;
        let vmm_log = mapping.bitmap().get_and_reset();
        for (k, v) in kvm_log.iter_mut().zip(vmm_log) {
            *k |= v;
        }
        out.extend(kvm_log);
    }
    Ok(out)
}

/// Forgets the writes the VMM made through `mem` so far, so that the next
/// [`take_dirty`] of a VM whose vCPUs have not run yet starts now. KVM's half
/// of that log needs nothing: a slot's dirty log starts clear (Sprout does not
/// enable `KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2`, whose `INITIALLY_SET` would set
/// it) and only a running vCPU marks it, so a new VM skips a
/// `KVM_GET_DIRTY_LOG` per slot (1.8 ms of a lab restore).
pub fn forget_vmm_writes(mem: &GuestMemoryMmap) {
    for r in mem.iter() {
        let mapping: &MmapRegion<AtomicBitmap> = r;
        mapping.bitmap().reset();
    }
}

/// Maps a RAM-offset-space range to guest physical addresses, region by region.
pub fn offset_to_gpa(size: u64, offset: u64) -> Option<GuestAddress> {
    let (regions, n) = layout::ram_regions(size);
    let mut start = 0;
    for &(base, len) in &regions[..n] {
        if offset < start + len {
            return Some(GuestAddress(base + (offset - start)));
        }
        start += len;
    }
    None
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
        let Backing::Memfd(file) = &ram.backing else {
            panic!("fresh RAM is a memfd")
        };
        file.read_exact_at(&mut b, 0x1000).unwrap();
        assert_eq!(u32::from_le_bytes(b), 0xdead_beef);
        assert!(ram.mem.read_obj::<u32>(GuestAddress(256 << 20)).is_err());
    }

    #[test]
    fn offsets_map_across_the_gap() {
        let g = layout::GIB;
        assert_eq!(offset_to_gpa(6 * g, 0x1000), Some(GuestAddress(0x1000)));
        assert_eq!(offset_to_gpa(6 * g, 3 * g), Some(GuestAddress(4 * g)));
        assert_eq!(offset_to_gpa(6 * g, 6 * g), None);
    }

    #[test]
    fn vmm_writes_are_tracked_per_page() {
        let ram = create(128 << 20).unwrap();
        ram.mem.write_obj(1u8, GuestAddress(5 * 4096 + 7)).unwrap();
        let r: &MmapRegion<AtomicBitmap> = ram.mem.iter().next().unwrap();
        let words = r.bitmap().get_and_reset();
        assert_eq!(words[0], 1 << 5);
        assert_eq!(r.bitmap().get_and_reset()[0], 0);
    }
}
