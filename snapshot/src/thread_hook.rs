//! A hook run at the start of every thread the VMM spawns, told which kind
//! of thread it is: how a jailed worker installs each thread kind's seccomp
//! filter on that thread, first thing, before it touches the guest.
//!
//! It lives in this crate, the lowest one that spawns a VM thread (the uffd
//! page server), so `vmm`'s vCPU and event-loop threads share it
//! (`vmm::thread_hook`). Without a hook set, nothing runs.

use std::sync::OnceLock;

/// The kinds of thread a VM runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThreadKind {
    /// `sprout-vcpuN`: runs KVM_RUN and the exits it handles.
    Vcpu,
    /// `sprout-events`: the device event loop.
    Events,
    /// `sprout-uffd`: the userfaultfd page server of a uffd restore.
    Uffd,
}

static HOOK: OnceLock<fn(ThreadKind)> = OnceLock::new();

/// Sets the hook once per process; a second call is ignored (returns false).
pub fn set(hook: fn(ThreadKind)) -> bool {
    HOOK.set(hook).is_ok()
}

/// Called by each VM thread as its first act.
pub fn thread_started(kind: ThreadKind) {
    if let Some(h) = HOOK.get() {
        h(kind);
    }
}
