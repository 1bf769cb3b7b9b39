//! SIGBUS on snapshot mappings.
//!
//! Restored guest RAM (the `mmap` backend's `MAP_PRIVATE` of layer files) and
//! the layer stack's read-only mappings are backed by files. Verification
//! checked them and [`crate::LayerStack::open`] checked their sizes again and
//! keeps them open, but nothing stops another process from truncating one
//! later: a page past the new end then faults with SIGBUS, and the code that
//! touched it (a device reading a queue, a snapshot reading RAM, the uffd
//! page server) cannot be resumed.
//!
//! Each such mapping is registered here while it lives ([`FaultGuard`]). A
//! process-wide SIGBUS handler checks the faulting address: inside a
//! registered mapping, it writes a clear reason to standard error and ends
//! the process with [`LAYER_FAULT_EXIT`] (a worker holds one VM, so that VM
//! fails, visibly); elsewhere it hands the signal on to the handler that was
//! there before (Rust's own), or to the default action.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Once, OnceLock};

/// Exit status of a process that took a SIGBUS in a snapshot mapping.
pub const LAYER_FAULT_EXIT: i32 = 86;

/// What the handler writes to standard error before exiting.
pub const LAYER_FAULT_MESSAGE: &str = "sprout: SIGBUS in a snapshot layer mapping: a layer file \
     was truncated or changed while a VM used it; the VM cannot continue, exiting\n";

/// At most this many mappings are guarded at once; more are mapped anyway,
/// unguarded (with a warning).
const SLOTS: usize = 512;

struct Slot {
    claimed: AtomicBool,
    start: AtomicUsize,
    end: AtomicUsize,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Slot = Slot {
    claimed: AtomicBool::new(false),
    start: AtomicUsize::new(0),
    end: AtomicUsize::new(0),
};

static GUARDED: [Slot; SLOTS] = [FREE; SLOTS];

/// The SIGBUS action before ours, to hand foreign faults on to.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

/// Registers `[start, start + len)` as a snapshot mapping until dropped.
#[derive(Debug)]
pub struct FaultGuard {
    slot: Option<usize>,
}

impl FaultGuard {
    pub fn new(start: *const u8, len: usize) -> FaultGuard {
        install();
        let start = start as usize;
        for (i, s) in GUARDED.iter().enumerate() {
            if s.claimed
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                s.end.store(start.saturating_add(len), Ordering::Release);
                s.start.store(start, Ordering::Release);
                return FaultGuard { slot: Some(i) };
            }
        }
        log::warn!("snapshot: more than {SLOTS} mappings; a SIGBUS in this one is not explained");
        FaultGuard { slot: None }
    }
}

impl Drop for FaultGuard {
    fn drop(&mut self) {
        if let Some(i) = self.slot {
            let s = &GUARDED[i];
            s.start.store(0, Ordering::Release);
            s.end.store(0, Ordering::Release);
            s.claimed.store(false, Ordering::Release);
        }
    }
}

/// Whether `addr` lies in a registered mapping (async-signal-safe: atomics only).
fn guarded(addr: usize) -> bool {
    GUARDED.iter().any(|s| {
        let start = s.start.load(Ordering::Acquire);
        start != 0 && addr >= start && addr < s.end.load(Ordering::Acquire)
    })
}

fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: a zeroed sigaction is a valid "no handler" value to read into
        // and to fill in; sigaction only reads `new` and writes `old`, both
        // valid for the call; `on_sigbus` has the SA_SIGINFO signature.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut old) != 0 {
                log::warn!("snapshot: cannot read the SIGBUS action");
                return;
            }
            let _ = PREVIOUS.set(old);
            let mut new: libc::sigaction = std::mem::zeroed();
            new.sa_sigaction = on_sigbus as *const () as usize;
            new.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut new.sa_mask);
            if libc::sigaction(libc::SIGBUS, &new, std::ptr::null_mut()) != 0 {
                log::warn!("snapshot: cannot install the SIGBUS handler");
            }
        }
    });
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel hands an SA_SIGINFO handler a valid siginfo; for
    // SIGBUS `si_addr` is the faulting address.
    let addr = unsafe { (*info).si_addr() } as usize;
    if guarded(addr) {
        let m = LAYER_FAULT_MESSAGE.as_bytes();
        // SAFETY: write(2) and _exit(2) are async-signal-safe; `m` is a valid
        // static buffer of `m.len()` bytes.
        unsafe {
            libc::write(2, m.as_ptr().cast(), m.len());
            libc::_exit(LAYER_FAULT_EXIT);
        }
    }
    let prev = PREVIOUS.get().copied();
    match prev {
        Some(p) if p.sa_sigaction != libc::SIG_DFL && p.sa_sigaction != libc::SIG_IGN => {
            if p.sa_flags & libc::SA_SIGINFO != 0 {
                // SAFETY: the previous action was installed with SA_SIGINFO, so
                // its handler has this signature; we pass on our own arguments.
                let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                    unsafe { std::mem::transmute(p.sa_sigaction) };
                f(sig, info, ctx);
            } else {
                // SAFETY: a handler installed without SA_SIGINFO takes the
                // signal number only.
                let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(p.sa_sigaction) };
                f(sig);
            }
        }
        _ => {
            // Not ours and no handler before us: the default action. Returning
            // re-runs the faulting access, which then kills the process.
            // SAFETY: signal(2) with SIG_DFL is async-signal-safe.
            unsafe { libc::signal(libc::SIGBUS, libc::SIG_DFL) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guards_register_and_unregister() {
        let buf = vec![0u8; 4096];
        let p = buf.as_ptr();
        assert!(!guarded(p as usize));
        {
            let _g = FaultGuard::new(p, buf.len());
            assert!(guarded(p as usize));
            assert!(guarded(p as usize + 4095));
            assert!(!guarded(p as usize + 4096));
        }
        assert!(!guarded(p as usize));
    }
}
