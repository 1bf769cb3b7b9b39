//! Per-thread seccomp filters for a jailed worker (`seccompiler`), and the
//! SIGSYS handler that turns a refused syscall into a clear message and a
//! distinct exit status instead of a silent kill.
//!
//! Order (filters stack; a thread inherits its creator's): the main thread
//! compiles every filter and installs the SIGSYS handler before it starts
//! any thread; `sprout-ctl` installs the control filter first thing (its
//! `sprout-conn` threads inherit it); the owner installs its filter once the
//! socket is bound and any ready shell is built, before it serves a request;
//! every VM thread (created by the owner later) and `sprout-exitwatch`
//! installs its own kind's filter as its first act, on top of the owner's.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::OnceLock;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

use super::{filters, ioctls};

/// The status a worker exits with when a filter refused a syscall.
pub const SECCOMP_EXIT: i32 = 159;

/// `SPROUT_WORKER_SECCOMP_LOG=1`: refused syscalls are allowed and logged
/// by the kernel (the audit log, `dmesg`) instead of trapped: how the lists
/// in `filters.rs` are found, a whole run at a time.
pub const LOG_ENV: &str = "SPROUT_WORKER_SECCOMP_LOG";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Owner,
    Control,
    Vcpu,
    Events,
    Uffd,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Owner => "owner",
            Kind::Control => "control",
            Kind::Vcpu => "vcpu",
            Kind::Events => "events",
            Kind::Uffd => "uffd",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("Cannot build the {0} seccomp filter")]
    Build(&'static str, #[source] seccompiler::BackendError),
    #[error("Cannot install the {0} seccomp filter")]
    Apply(&'static str, #[source] seccompiler::Error),
    #[error("Seccomp filters were not prepared")]
    NotPrepared,
    #[error("Cannot install the SIGSYS handler")]
    Handler(#[source] std::io::Error),
}

struct Filters {
    owner: BpfProgram,
    control: BpfProgram,
    vcpu: BpfProgram,
    events: BpfProgram,
    uffd: BpfProgram,
}

static FILTERS: OnceLock<Filters> = OnceLock::new();

thread_local! {
    /// This thread's filter kind and name, for the SIGSYS message (read in
    /// the handler: const-initialised, no destructor, so no allocation).
    static KIND: Cell<Option<Kind>> = const { Cell::new(None) };
    static NAME: Cell<[u8; 16]> = const { Cell::new([0; 16]) };
}

fn ioctl_req(req: u64) -> Result<SeccompRule, seccompiler::BackendError> {
    SeccompRule::new(vec![SeccompCondition::new(
        1,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::Eq,
        req,
    )?])
}

/// The `ioctl` requests `kind` may make, each by its exact number (the
/// lists are in `ioctls.rs`).
fn ioctl_requests(kind: Kind) -> Vec<u64> {
    match kind {
        Kind::Vcpu => ioctls::VCPU.to_vec(),
        Kind::Uffd => ioctls::UFFD.to_vec(),
        Kind::Control | Kind::Events => ioctls::SOCKETS.to_vec(),
        Kind::Owner => ioctls::owner(),
    }
}

fn ioctl_rules(kind: Kind) -> Result<Vec<SeccompRule>, seccompiler::BackendError> {
    ioctl_requests(kind).into_iter().map(ioctl_req).collect()
}

fn build(kind: Kind, log_only: bool) -> Result<BpfProgram, SeccompError> {
    let own: Vec<libc::c_long> = match kind {
        Kind::Owner => filters::owner(),
        Kind::Control => filters::CONTROL.to_vec(),
        Kind::Vcpu => filters::VCPU.to_vec(),
        Kind::Events => filters::EVENTS.to_vec(),
        Kind::Uffd => filters::UFFD.to_vec(),
    };
    let e = |e| SeccompError::Build(kind.name(), e);
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for nr in filters::COMMON.iter().chain(own.iter()) {
        rules.insert(*nr, Vec::new());
    }
    if let Some(r) = rules.get_mut(&libc::SYS_ioctl) {
        *r = ioctl_rules(kind).map_err(e)?;
    }
    let refuse = if log_only {
        SeccompAction::Log
    } else {
        SeccompAction::Trap
    };
    let f =
        SeccompFilter::new(rules, refuse, SeccompAction::Allow, TargetArch::x86_64).map_err(e)?;
    f.try_into().map_err(e)
}

/// Compiles every kind's filter and installs the SIGSYS handler. Call once,
/// on the main thread, before any other thread starts.
pub fn prepare() -> Result<(), SeccompError> {
    let log_only = std::env::var_os(LOG_ENV).is_some_and(|v| v == "1");
    let f = Filters {
        owner: build(Kind::Owner, log_only)?,
        control: build(Kind::Control, log_only)?,
        vcpu: build(Kind::Vcpu, log_only)?,
        events: build(Kind::Events, log_only)?,
        uffd: build(Kind::Uffd, log_only)?,
    };
    let _ = FILTERS.set(f);
    #[cfg(feature = "test-hooks")]
    super::test_hooks::init();
    install_handler()?;
    vmm::thread_hook::set(vm_thread_started);
    Ok(())
}

/// Whether [`prepare`] ran: the worker is jailed.
pub fn active() -> bool {
    FILTERS.get().is_some()
}

/// Installs `kind`'s filter on the calling thread (nothing when not jailed).
pub fn apply(kind: Kind) -> Result<(), SeccompError> {
    let Some(f) = FILTERS.get() else {
        return Ok(());
    };
    let prog = match kind {
        Kind::Owner => &f.owner,
        Kind::Control => &f.control,
        Kind::Vcpu => &f.vcpu,
        Kind::Events => &f.events,
        Kind::Uffd => &f.uffd,
    };
    let mut name = [0u8; 16];
    if let Some(n) = std::thread::current().name() {
        let n = n.as_bytes();
        let k = n.len().min(15);
        name[..k].copy_from_slice(&n[..k]);
    }
    NAME.with(|c| c.set(name));
    KIND.with(|c| c.set(Some(kind)));
    seccompiler::apply_filter(prog).map_err(|e| SeccompError::Apply(kind.name(), e))
}

/// [`apply`], or end the worker: a thread that cannot be confined must not run.
pub fn apply_or_exit(kind: Kind) {
    if let Err(e) = apply(kind) {
        eprintln!(
            "sprout-worker: jail: {}",
            crate::owner::chain(&e as &dyn std::error::Error)
        );
        std::process::exit(SECCOMP_EXIT);
    }
}

fn vm_thread_started(kind: vmm::thread_hook::ThreadKind) {
    use vmm::thread_hook::ThreadKind as T;
    let kind = match kind {
        T::Vcpu => Kind::Vcpu,
        T::Events => Kind::Events,
        T::Uffd => Kind::Uffd,
    };
    apply_or_exit(kind);
    #[cfg(feature = "test-hooks")]
    super::test_hooks::on_vm_thread(kind);
}

/// `siginfo_t` as the kernel fills it for SIGSYS (x86_64).
#[repr(C)]
struct SigsysInfo {
    signo: i32,
    errno: i32,
    code: i32,
    _pad: i32,
    call_addr: *mut libc::c_void,
    syscall: i32,
    arch: u32,
}

/// A fixed buffer to format into without allocating (signal context).
struct Buf {
    b: [u8; 256],
    n: usize,
}

impl std::fmt::Write for Buf {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let s = s.as_bytes();
        let k = s.len().min(self.b.len() - self.n);
        self.b[self.n..self.n + k].copy_from_slice(&s[..k]);
        self.n += k;
        Ok(())
    }
}

extern "C" fn on_sigsys(_sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo_t for SIGSYS, whose layout
    // SigsysInfo follows on x86_64.
    let nr = unsafe { (*(info as *const SigsysInfo)).syscall };
    // SAFETY: with SA_SIGINFO the third argument is the interrupted thread's
    // ucontext_t; RSI holds the syscall's second argument.
    let arg1 =
        unsafe { (*(ctx as *const libc::ucontext_t)).uc_mcontext.gregs[libc::REG_RSI as usize] };
    let kind = KIND.with(Cell::get).map_or("none", Kind::name);
    let name = NAME.with(Cell::get);
    let tname = std::str::from_utf8(&name[..name.iter().position(|&c| c == 0).unwrap_or(16)])
        .unwrap_or("?");
    let mut b = Buf { b: [0; 256], n: 0 };
    let _ = write!(
        b,
        "sprout-worker: seccomp: thread {tname} ({kind} filter) made forbidden syscall {nr} ({})",
        super::names::name(i64::from(nr))
    );
    if i64::from(nr) == libc::SYS_ioctl {
        let _ = write!(b, " request {:#x}", arg1 as u64 & 0xffff_ffff);
    }
    if i64::from(nr) == libc::SYS_openat && arg1 != 0 {
        // The path asked for: what would have been opened says who asked.
        let mut path = [0u8; 96];
        let mut n = 0;
        while n < path.len() {
            // SAFETY: RSI of an interrupted openat is its path argument, a
            // NUL-terminated string the caller passed; it is read byte by
            // byte up to its NUL or 96 bytes. A caller's bad pointer would
            // fault here, which ends the worker as the refusal would.
            let c = unsafe { *((arg1 as usize + n) as *const u8) };
            if c == 0 {
                break;
            }
            path[n] = c;
            n += 1;
        }
        // (No allocation in a signal handler: printable ASCII, else '?'.)
        for c in &mut path[..n] {
            if !c.is_ascii_graphic() {
                *c = b'?';
            }
        }
        let shown = std::str::from_utf8(&path[..n]).unwrap_or("?");
        let _ = write!(b, " of \"{shown}\"");
    }
    let _ = writeln!(b, "; the worker exits with status {SECCOMP_EXIT}");
    // SAFETY: write(2) and _exit(2) are async-signal-safe and allowed by
    // every filter; the buffer is valid for n bytes.
    unsafe {
        libc::write(2, b.b.as_ptr().cast(), b.n);
        libc::_exit(SECCOMP_EXIT);
    }
}

fn install_handler() -> Result<(), SeccompError> {
    // SAFETY: a zeroed sigaction is a valid starting value; the handler is
    // async-signal-safe (formats into a stack buffer, write(2), _exit(2)).
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigsys
            as extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void)
            as usize;
        sa.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut sa.sa_mask);
        if libc::sigaction(libc::SIGSYS, &sa, std::ptr::null_mut()) != 0 {
            return Err(SeccompError::Handler(std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_compiles_in_both_modes() {
        for kind in [
            Kind::Owner,
            Kind::Control,
            Kind::Vcpu,
            Kind::Events,
            Kind::Uffd,
        ] {
            for log_only in [false, true] {
                let p = build(kind, log_only).unwrap();
                assert!(!p.is_empty(), "{}", kind.name());
            }
        }
    }

    #[test]
    fn the_sigsys_message_fits_its_buffer() {
        let mut b = Buf { b: [0; 256], n: 0 };
        let _ = write!(b, "{}", "x".repeat(300));
        assert_eq!(b.n, 256);
    }
}
