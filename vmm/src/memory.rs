//! Guest RAM: one range of host memory holding all of it, cut into regions
//! (below the 32-bit MMIO gap, and above 4 GiB). A booted VM's is anonymous
//! private memory starting on a huge page, as Firecracker's is: where the host
//! backs anonymous memory with transparent huge pages
//! (`/sys/kernel/mm/transparent_hugepage/enabled` is `always`), so is guest
//! RAM, and KVM maps it 2 MiB at a time. A restored VM's is its restore
//! backend's mapping.

use devices::virtio::GuestMemoryMmap;

use kvm_bindings::{kvm_userspace_memory_region, KVM_MEM_LOG_DIRTY_PAGES};
use kvm_ioctls::VmFd;
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion, GuestRegionMmap, MmapRegion};

use crate::layout;

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("Cannot reserve {0} bytes of guest memory")]
    Reserve(u64, #[source] std::io::Error),
    #[error("Cannot describe guest memory")]
    Raw(#[source] vm_memory::mmap::MmapRegionError),
    #[error("A shell's memory range of {0} bytes cannot hold {1} bytes of guest RAM")]
    RangeSize(u64, u64),
    #[error("Restored guest memory region overflows the guest address space")]
    Region,
    #[error("Cannot assemble restored guest memory")]
    Regions(#[source] vm_memory::GuestRegionCollectionError),
    #[error("KVM refused to register guest memory")]
    Register(#[source] kvm_ioctls::Error),
    #[error("KVM refused to report dirty pages")]
    DirtyLog(#[source] kvm_ioctls::Error),
}

/// What keeps guest RAM's host mapping alive: a booted VM's own anonymous
/// memory, or the mapping a restore backend made.
pub enum Backing {
    /// Fresh zeroed memory (a shell's, or reserved for the boot).
    Fresh(snapshot::Reservation),
    /// `MAP_PRIVATE` of the snapshot's layer files (kernel copy-on-write).
    Mmap(snapshot::mmap::PrivateMapping),
    /// Anonymous memory filled by a userfaultfd page server.
    Uffd(snapshot::uffd::UffdRestore),
}

impl Backing {
    /// A snapshot layer file backing this RAM that changed size since the
    /// restore mapped it (`None` for a VM's own memory).
    pub fn changed_layer(&self) -> Option<std::path::PathBuf> {
        match self {
            Backing::Fresh(_) => None,
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
    /// Owns the mapping `mem`'s regions describe (they do not own it), and
    /// is dropped after them.
    pub backing: Backing,
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

/// Creates `size` bytes of zeroed guest RAM laid out by [`layout::ram_regions`].
pub fn create(size: u64) -> Result<GuestRam, MemoryError> {
    let range =
        snapshot::Reservation::new(size as usize).map_err(|e| MemoryError::Reserve(size, e))?;
    create_in(size, range)
}

/// [`create`] in `range`: a shell's reserved memory, whose KVM memory slots
/// already cover it (a boot into a ready worker's shell), or a new one.
pub fn create_in(size: u64, range: snapshot::Reservation) -> Result<GuestRam, MemoryError> {
    if range.len() as u64 != size {
        return Err(MemoryError::RangeSize(range.len() as u64, size));
    }
    from_backing(Backing::Fresh(range))
}

/// Guest RAM over a restore backend's mapping of the whole RAM offset space.
pub fn from_backing(backing: Backing) -> Result<GuestRam, MemoryError> {
    let (ptr, size) = match &backing {
        Backing::Fresh(r) => (r.as_ptr(), r.len() as u64),
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
    Ok(GuestRam { mem, size, backing })
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

    /// Fresh RAM is one zeroed anonymous range starting on a huge page, the
    /// regions laid end to end in it.
    #[test]
    fn fresh_ram_is_one_aligned_range() {
        let g = layout::GIB;
        let ram = create(256 << 20).unwrap();
        assert_eq!(ram.mem.num_regions(), 1);
        ram.mem
            .write_obj(0xdead_beefu32, GuestAddress(0x1000))
            .unwrap();
        let Backing::Fresh(range) = &ram.backing else {
            panic!("fresh RAM is a reservation")
        };
        assert_eq!(range.as_ptr() as usize % (2 << 20), 0);
        // SAFETY: offset 0x1000 is inside the 256 MiB range, written above.
        let at = unsafe { std::ptr::read_unaligned(range.as_ptr().add(0x1000).cast::<u32>()) };
        assert_eq!(at, 0xdead_beef);
        assert!(ram.mem.read_obj::<u32>(GuestAddress(256 << 20)).is_err());
        // Across the gap: RAM above 4 GiB follows RAM below it in the range.
        let big = create(4 * g).unwrap();
        assert_eq!(big.mem.num_regions(), 2);
        big.mem.write_obj(7u8, GuestAddress(4 * g)).unwrap();
        let Backing::Fresh(range) = &big.backing else {
            panic!("fresh RAM is a reservation")
        };
        let below = big.mem.find_region(GuestAddress(0)).unwrap().len();
        // SAFETY: `below` < 4 GiB, inside the range.
        assert_eq!(unsafe { *range.as_ptr().add(below as usize) }, 7);
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
