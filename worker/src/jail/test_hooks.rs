//! Test-only hooks, compiled in only with the cargo feature `test-hooks`,
//! which only this crate's own tests enable (its self dev-dependency in
//! `Cargo.toml`): no build of `sproutd`, `sprout` or `sprout-worker` on its
//! own has them. `SPROUT_WORKER_TEST_FORBIDDEN_SYSCALL`, read once as the
//! jail is entered, makes one thread of a **jailed** worker make a call its
//! filter refuses, so the tests can show that each thread kind's filter
//! traps and that the worker dies alone, saying which:
//!
//! | value | thread | call |
//! | --- | --- | --- |
//! | `1` | the owner, on its first request | `getppid` (in no list) |
//! | `ioctl` | the owner, on its first request | `ioctl` `KVM_SET_IDENTITY_MAP_ADDR` (in no list) |
//! | `vcpu-ioctl` | each vCPU thread, once its filter is in place | `ioctl` `KVM_SET_USER_MEMORY_REGION` (the owner's, not the vCPU's) |
//! | `uffd-ioctl` | the uffd page server, once its filter is in place | `ioctl` `UFFDIO_REGISTER` (the owner's, not the uffd thread's) |
//! | `heap-churn` | the events thread, once its filter is in place | none of its own: 32 MiB in 64 KiB blocks allocated and freed, so that malloc shrinks that thread's heap (a regression test: glibc's per-thread arenas read /proc/sys/vm/overcommit_memory then) |
//!
//! Each is one fixed call: an `ioctl` on no descriptor (-1) with a null
//! argument, which even a filter that let it through would see refused by
//! the kernel (EBADF) with nothing touched. Nothing from the environment
//! but the choice among these reaches a syscall.

use std::sync::OnceLock;

use super::ioctls;
use super::seccomp::Kind;

/// The variable that picks a hook.
pub const ENV: &str = "SPROUT_WORKER_TEST_FORBIDDEN_SYSCALL";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hook {
    OwnerSyscall,
    OwnerIoctl,
    VcpuIoctl,
    UffdIoctl,
    HeapChurn,
}

static HOOK: OnceLock<Option<Hook>> = OnceLock::new();

fn parse(v: &str) -> Option<Hook> {
    match v {
        "1" => Some(Hook::OwnerSyscall),
        "ioctl" => Some(Hook::OwnerIoctl),
        "vcpu-ioctl" => Some(Hook::VcpuIoctl),
        "uffd-ioctl" => Some(Hook::UffdIoctl),
        "heap-churn" => Some(Hook::HeapChurn),
        _ => None,
    }
}

/// Reads [`ENV`], once, as the jail's filters are prepared (before any
/// thread, so no thread reads the environment under its filter).
pub(super) fn init() {
    let _ = HOOK.set(std::env::var(ENV).ok().as_deref().and_then(parse));
}

fn hook() -> Option<Hook> {
    HOOK.get().copied().flatten()
}

/// An `ioctl` of `request` on no descriptor (see the module docs).
fn refused_ioctl(request: u64) {
    // SAFETY: an ioctl on no descriptor (-1) with a null argument: the
    // kernel answers EBADF and touches no memory; the filter traps it
    // before that.
    unsafe {
        libc::ioctl(
            -1,
            request as libc::c_ulong,
            std::ptr::null_mut::<libc::c_void>(),
        );
    }
}

/// The owner, before it handles a request (nothing unless jailed).
pub fn on_request() {
    if !super::seccomp::active() {
        return;
    }
    match hook() {
        Some(Hook::OwnerSyscall) => {
            let _ = rustix::process::getppid();
        }
        Some(Hook::OwnerIoctl) => refused_ioctl(ioctls::KVM_SET_IDENTITY_MAP_ADDR),
        _ => {}
    }
}

/// A VM thread, once its own filter is in place.
pub(super) fn on_vm_thread(kind: Kind) {
    match (hook(), kind) {
        (Some(Hook::VcpuIoctl), Kind::Vcpu) => refused_ioctl(ioctls::KVM_SET_USER_MEMORY_REGION),
        (Some(Hook::UffdIoctl), Kind::Uffd) => refused_ioctl(ioctls::UFFDIO_REGISTER),
        (Some(Hook::HeapChurn), Kind::Events) => {
            // Below the mmap threshold, so from this thread's arena; all
            // freed at once, so its heap's top is trimmed.
            let blocks: Vec<Vec<u8>> = (0..512).map(|i| vec![i as u8; 64 << 10]).collect();
            std::hint::black_box(&blocks);
            drop(blocks);
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_listed_values_pick_a_hook() {
        assert_eq!(parse("1"), Some(Hook::OwnerSyscall));
        assert_eq!(parse("ioctl"), Some(Hook::OwnerIoctl));
        assert_eq!(parse("vcpu-ioctl"), Some(Hook::VcpuIoctl));
        assert_eq!(parse("uffd-ioctl"), Some(Hook::UffdIoctl));
        for v in ["", "0", "yes", "vcpu", "0x4020ae46"] {
            assert_eq!(parse(v), None, "{v:?}");
        }
    }

    /// Each hook's call is refused by its thread's filter and allowed by
    /// the owner's (which its thread inherits): what is shown is the
    /// narrower filter of the thread kind.
    #[test]
    fn each_vm_thread_hook_is_the_owners_and_not_its_threads() {
        let owner = ioctls::owner();
        for (list, req) in [
            (ioctls::VCPU, ioctls::KVM_SET_USER_MEMORY_REGION),
            (ioctls::UFFD, ioctls::UFFDIO_REGISTER),
        ] {
            assert!(owner.contains(&req), "{req:#x}");
            assert!(!list.contains(&req), "{req:#x}");
        }
    }
}
