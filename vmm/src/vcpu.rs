//! vCPU threads. Each vCPU runs on its own thread as an explicit state machine
//! (`Created` -> `Running` <-> `Paused` -> `Exited`) driven by a command channel.
//! A command is followed by a signal kick: the signal handler sets the vCPU's
//! `immediate_exit`, so `KVM_RUN` returns (or never enters) and the thread
//! looks at its channel. No kick is lost: the flag stays set until the thread
//! has drained its commands.
//!
//! A vCPU parks only with its last exit completed: KVM finishes an MMIO read,
//! a port read or a port write (the register load, the instruction pointer
//! step) on the next `KVM_RUN`, not when it exits to us. Saved state read
//! before that would make a restored vCPU redo the access (a second read of a
//! register whose read has side effects, a repeated port write). So before it
//! parks, the thread enters `KVM_RUN` once more with `immediate_exit` set,
//! which completes the access and returns without running guest code.

use std::cell::Cell;
use std::os::unix::thread::JoinHandleExt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Condvar, Mutex, Once};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use devices::bus::lock;
use devices::Bus;
use kvm_bindings::kvm_run;
use kvm_ioctls::{VcpuExit, VcpuFd};
use vmm_sys_util::signal::{register_signal_handler, SIGRTMIN};

use crate::arch::state::{save_vcpu, StateError, VcpuState};
use crate::run_state::{VcpuControl, Want};

/// Why a VM stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExitReason {
    /// The guest reset the machine (i8042 or a KVM reset event): a clean end.
    Reset,
    /// The guest powered off (KVM shutdown system event).
    PowerOff,
    /// The guest triple-faulted (KVM_EXIT_SHUTDOWN); `regs` is that vCPU's
    /// state at the fault (registers, descriptor tables, pending events), to
    /// tell a guest that lost its stack or IDT from one that rebooted that way.
    TripleFault { vcpu: u8, regs: String },
    /// The test guest reported a fatal error through its mailbox device.
    GuestPanic { code: u32, rip: u64 },
    /// KVM refused to run a vCPU or reported an error exit.
    VcpuFailed { vcpu: u8, message: String },
    /// A snapshot layer file backing restored guest RAM (`path`) was
    /// truncated or replaced while the VM ran, and the guest touched a page
    /// the kernel could no longer fill. What that looked like (`then`)
    /// depends on the hypervisor: `KVM_RUN` failing with `EFAULT`, or a page
    /// fault injected into the guest that ends in a triple fault.
    LayerChanged {
        path: std::path::PathBuf,
        then: Box<ExitReason>,
    },
    /// The host stopped the VM.
    Stopped,
    /// Teardown gave up on threads that did not end in time (`threads` names
    /// them); they were abandoned and the guest memory they may still touch
    /// was left mapped.
    Abandoned { threads: String },
}

impl ExitReason {
    /// Whether this ends the VM without an error.
    pub fn is_clean(&self) -> bool {
        matches!(self, Self::Reset | Self::PowerOff | Self::Stopped)
    }
}

impl std::fmt::Display for ExitReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Reset => write!(f, "guest reset"),
            Self::PowerOff => write!(f, "guest powered off"),
            Self::TripleFault { vcpu, regs } => {
                write!(f, "guest triple fault on vCPU {vcpu} ({regs})")
            }
            Self::GuestPanic { code, rip } => {
                write!(f, "guest panic: code {code:#x} at rip {rip:#x}")
            }
            Self::VcpuFailed { vcpu, message } => write!(f, "vCPU {vcpu} failed: {message}"),
            Self::LayerChanged { path, then } => write!(
                f,
                "snapshot layer {} was truncated or changed while the VM used it ({then})",
                path.display()
            ),
            Self::Stopped => write!(f, "stopped by the host"),
            Self::Abandoned { threads } => {
                write!(
                    f,
                    "stopped uncleanly: {threads} did not exit and were abandoned"
                )
            }
        }
    }
}

/// The first exit reason wins; waiters are woken.
#[derive(Default)]
pub struct ExitSignal {
    reason: Mutex<Option<ExitReason>>,
    cond: Condvar,
}

impl ExitSignal {
    pub fn set(&self, r: ExitReason) {
        let mut g = lock(&self.reason);
        if g.is_none() {
            *g = Some(r);
        }
        self.cond.notify_all();
    }

    /// Records `r` even over an earlier reason: what teardown found out
    /// (threads abandoned) matters more than why the VM was being stopped.
    pub fn overwrite(&self, r: ExitReason) {
        *lock(&self.reason) = Some(r);
        self.cond.notify_all();
    }

    pub fn get(&self) -> Option<ExitReason> {
        lock(&self.reason).clone()
    }

    /// Waits for the VM to exit, at most `timeout` (forever with `None`).
    pub fn wait(&self, timeout: Option<Duration>) -> Option<ExitReason> {
        let g = lock(&self.reason);
        let g = match timeout {
            None => self
                .cond
                .wait_while(g, |r| r.is_none())
                .unwrap_or_else(|p| p.into_inner()),
            Some(t) => {
                self.cond
                    .wait_timeout_while(g, t, |r| r.is_none())
                    .unwrap_or_else(|p| p.into_inner())
                    .0
            }
        };
        g.clone()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunState {
    Created,
    Running,
    Paused,
    Exited,
}

enum Command {
    Run,
    Pause,
    /// Capture the vCPU's state (only while parked) with these MSRs.
    Save(Arc<Vec<u32>>),
    Exit,
}

enum Ack {
    State(RunState),
    Saved(Result<Box<VcpuState>, StateError>),
}

/// The last exit a vCPU thread handled, as [`VcpuStats::last_exit`] keeps it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ExitKind {
    None = 0,
    IoIn,
    IoOut,
    MmioRead,
    MmioWrite,
    Hlt,
    /// `KVM_RUN` returned EINTR or EAGAIN (a kick, or a signal).
    Interrupted,
    Other,
}

impl ExitKind {
    fn from_u8(v: u8) -> Self {
        use ExitKind::*;
        [None, IoIn, IoOut, MmioRead, MmioWrite, Hlt, Interrupted]
            .get(usize::from(v))
            .copied()
            .unwrap_or(Other)
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::IoIn => "io-in",
            Self::IoOut => "io-out",
            Self::MmioRead => "mmio-read",
            Self::MmioWrite => "mmio-write",
            Self::Hlt => "hlt",
            Self::Interrupted => "interrupted",
            Self::Other => "other",
        }
    }

    fn of(exit: &VcpuExit<'_>) -> Self {
        match exit {
            VcpuExit::IoIn(..) => Self::IoIn,
            VcpuExit::IoOut(..) => Self::IoOut,
            VcpuExit::MmioRead(..) => Self::MmioRead,
            VcpuExit::MmioWrite(..) => Self::MmioWrite,
            VcpuExit::Hlt => Self::Hlt,
            _ => Self::Other,
        }
    }
}

/// What a vCPU thread does, readable from any thread without stopping it: a
/// hang is told apart from a guest that spins (entries go up) or a thread that
/// never returns from `KVM_RUN` (`in_kvm_run` stays set, entries do not move).
#[derive(Debug, Default)]
pub struct VcpuStats {
    in_kvm_run: AtomicBool,
    entries: AtomicU64,
    last_exit: AtomicU8,
    /// Milliseconds since [`VcpuStats::epoch`] at the last return from `KVM_RUN`.
    last_return_ms: AtomicU64,
    /// The exit the thread had handled when it was last asked to park: an
    /// access KVM completes on the parking `KVM_RUN` (see the module docs).
    parked_after: AtomicU8,
    /// Further exits served while parking (a string port access).
    park_exits: AtomicU64,
    epoch: std::sync::OnceLock<Instant>,
}

/// A copy of [`VcpuStats`] at one moment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VcpuStatsView {
    pub in_kvm_run: bool,
    pub entries: u64,
    pub last_exit: ExitKind,
    /// Time since the thread last came back from `KVM_RUN`.
    pub since_last_return: Duration,
    /// The exit handled before the last park.
    pub parked_after: ExitKind,
    pub park_exits: u64,
}

impl VcpuStats {
    fn now_ms(&self) -> u64 {
        let epoch = self.epoch.get_or_init(Instant::now);
        u64::try_from(epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn entering(&self) {
        self.entries.fetch_add(1, Ordering::Relaxed);
        self.in_kvm_run.store(true, Ordering::Release);
    }

    fn returned(&self, kind: ExitKind) {
        self.in_kvm_run.store(false, Ordering::Release);
        self.last_exit.store(kind as u8, Ordering::Relaxed);
        self.last_return_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    pub fn view(&self) -> VcpuStatsView {
        let now = self.now_ms();
        let last = self.last_return_ms.load(Ordering::Relaxed);
        VcpuStatsView {
            in_kvm_run: self.in_kvm_run.load(Ordering::Acquire),
            entries: self.entries.load(Ordering::Relaxed),
            last_exit: ExitKind::from_u8(self.last_exit.load(Ordering::Relaxed)),
            since_last_return: Duration::from_millis(now.saturating_sub(last)),
            parked_after: ExitKind::from_u8(self.parked_after.load(Ordering::Relaxed)),
            park_exits: self.park_exits.load(Ordering::Relaxed),
        }
    }
}

/// Most exits one parking `KVM_RUN` sequence handles (a string port access
/// can take several) before the thread parks anyway.
const MAX_PARK_EXITS: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    #[error("Cannot start vCPU thread")]
    Spawn(#[source] std::io::Error),
    #[error("Cannot install the vCPU kick signal handler")]
    Signal(#[source] vmm_sys_util::errno::Error),
    #[error("vCPU {0} thread is gone")]
    Gone(u8),
    #[error("vCPU {0} did not answer within {1:?}")]
    Timeout(u8, Duration),
    #[error("vCPU {0} must be paused to save its state")]
    NotPaused(u8),
    #[error("Cannot save vCPU state")]
    Save(#[source] StateError),
}

thread_local! {
    static KVM_RUN: Cell<*mut kvm_run> = const { Cell::new(std::ptr::null_mut()) };
}

fn kick_signal() -> i32 {
    SIGRTMIN()
}

extern "C" fn handle_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    let p = KVM_RUN.with(|c| c.get());
    if !p.is_null() {
        // SAFETY: p is this thread's mapped kvm_run, set by the vCPU thread while it
        // owns the VcpuFd and cleared before the fd (and mapping) is dropped. A
        // volatile byte store is async-signal-safe.
        unsafe { std::ptr::addr_of_mut!((*p).immediate_exit).write_volatile(1) };
    }
}

fn install_kick_handler() -> Result<(), VcpuError> {
    static ONCE: Once = Once::new();
    let mut res = Ok(());
    ONCE.call_once(|| res = register_signal_handler(kick_signal(), handle_kick));
    res.map_err(VcpuError::Signal)
}

/// The i8042's command port, and the command that pulses the CPU reset line.
const I8042_COMMAND_PORT: u16 = crate::layout::I8042_PORT + 4;
const I8042_RESET_CPU: u8 = 0xfe;

/// What a vCPU thread needs besides its fd.
pub struct VcpuContext {
    pub pio: Arc<Bus>,
    pub mmio: Arc<Bus>,
    pub exit: Arc<ExitSignal>,
}

/// The host's handle on a vCPU thread.
pub struct Vcpu {
    index: u8,
    state: RunState,
    tx: Sender<(u64, Command)>,
    acks: Receiver<(u64, Ack)>,
    /// Sequence number of the last command sent: every ack carries its
    /// command's, so a late ack (after a timeout) is told apart and dropped.
    seq: u64,
    exit_requested: bool,
    stats: Arc<VcpuStats>,
    thread: Option<JoinHandle<()>>,
}

/// How long the host waits for a vCPU to answer a command.
pub const ACK_TIMEOUT: Duration = Duration::from_secs(5);

impl Vcpu {
    /// Starts the thread for `fd`, parked in `Created` until [`Vcpu::resume`].
    pub fn spawn(index: u8, fd: VcpuFd, ctx: VcpuContext) -> Result<Self, VcpuError> {
        install_kick_handler()?;
        let (tx, rx) = mpsc::channel();
        let (ack_tx, acks) = mpsc::channel();
        let stats = Arc::new(VcpuStats::default());
        stats.now_ms();
        let thread_stats = stats.clone();
        let thread = std::thread::Builder::new()
            .name(format!("sprout-vcpu{index}"))
            .spawn(move || {
                crate::thread_hook::thread_started(crate::thread_hook::ThreadKind::Vcpu);
                run_thread(index, fd, ctx, rx, ack_tx, &thread_stats)
            })
            .map_err(VcpuError::Spawn)?;
        Ok(Self {
            index,
            state: RunState::Created,
            tx,
            acks,
            seq: 0,
            exit_requested: false,
            stats,
            thread: Some(thread),
        })
    }

    /// What the thread does now (see [`VcpuStats`]).
    pub fn stats(&self) -> VcpuStatsView {
        self.stats.view()
    }

    pub fn index(&self) -> u8 {
        self.index
    }

    pub fn state(&self) -> RunState {
        self.state
    }

    fn kick(&self) {
        if let Some(t) = &self.thread {
            // SAFETY: the pthread id belongs to a thread we own and have not joined;
            // pthread_kill with a handled signal has no other effect.
            unsafe { libc::pthread_kill(t.as_pthread_t(), kick_signal()) };
        }
    }

    /// Sends `cmd` and kicks the thread out of `KVM_RUN`; `wait_ack`
    /// collects the answer. Sending to several vCPUs before waiting on any
    /// lets them all stop at once.
    fn send_cmd(&mut self, cmd: Command) -> Result<u64, VcpuError> {
        self.seq += 1;
        self.tx
            .send((self.seq, cmd))
            .map_err(|_| VcpuError::Gone(self.index))?;
        self.kick();
        Ok(self.seq)
    }

    /// Waits (at most [`ACK_TIMEOUT`]) for the answer to command `seq`,
    /// dropping answers to earlier commands that came too late.
    fn wait_ack(&mut self, seq: u64) -> Result<Ack, VcpuError> {
        let deadline = Instant::now() + ACK_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.acks.recv_timeout(left) {
                Ok((n, _)) if n < seq => continue,
                Ok((_, Ack::State(s))) => {
                    self.state = s;
                    return Ok(Ack::State(s));
                }
                Ok((_, a)) => return Ok(a),
                Err(RecvTimeoutError::Timeout) => {
                    return Err(VcpuError::Timeout(self.index, ACK_TIMEOUT))
                }
                Err(RecvTimeoutError::Disconnected) => {
                    self.state = RunState::Exited;
                    return Err(VcpuError::Gone(self.index));
                }
            }
        }
    }

    fn send(&mut self, cmd: Command) -> Result<Ack, VcpuError> {
        let seq = self.send_cmd(cmd)?;
        self.wait_ack(seq)
    }

    /// Starts or resumes running guest code.
    pub fn resume(&mut self) -> Result<(), VcpuError> {
        self.send(Command::Run).map(|_| ())
    }

    /// Leaves `KVM_RUN` and parks the thread; returns once it is parked.
    pub fn pause(&mut self) -> Result<(), VcpuError> {
        self.send(Command::Pause).map(|_| ())
    }

    /// Captures the vCPU's KVM state; the vCPU must be paused (or not yet started).
    pub fn save_state(&mut self, msrs: Arc<Vec<u32>>) -> Result<VcpuState, VcpuError> {
        if !matches!(self.state, RunState::Paused | RunState::Created) {
            return Err(VcpuError::NotPaused(self.index));
        }
        match self.send(Command::Save(msrs))? {
            Ack::Saved(r) => r.map(|b| *b).map_err(VcpuError::Save),
            Ack::State(_) => Err(VcpuError::NotPaused(self.index)),
        }
    }

    /// Asks the thread to end (and kicks it out of `KVM_RUN`) without
    /// waiting: [`Vcpu::join_until`] collects it. Sending to every vCPU first
    /// lets them all end at once.
    pub fn request_exit(&mut self) {
        if self.thread.is_none() || self.exit_requested {
            return;
        }
        self.exit_requested = true;
        self.seq += 1;
        let _ = self.tx.send((self.seq, Command::Exit));
        self.kick();
    }

    /// Joins the thread if it ends by `deadline`; otherwise detaches it (with
    /// a logged error) and returns false. A thread stuck in a device handler
    /// is never kicked again once detached: its pthread id may be reused.
    pub fn join_until(&mut self, deadline: Instant) -> bool {
        let Some(t) = self.thread.take() else {
            return true;
        };
        self.state = RunState::Exited;
        while !t.is_finished() {
            if Instant::now() >= deadline {
                log::error!(
                    "vCPU {} did not exit in time: abandoning its thread",
                    self.index
                );
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let _ = t.join();
        true
    }

    /// Ends the thread and joins it, giving up (and detaching it) after
    /// [`ACK_TIMEOUT`]. Returns whether it ended.
    pub fn stop(&mut self) -> bool {
        self.request_exit();
        self.join_until(Instant::now() + ACK_TIMEOUT)
    }
}

impl VcpuControl for Vcpu {
    fn request(&mut self, want: Want) -> Result<u64, VcpuError> {
        self.send_cmd(match want {
            Want::Run => Command::Run,
            Want::Park => Command::Pause,
        })
    }

    fn wait(&mut self, seq: u64) -> Result<(), VcpuError> {
        self.wait_ack(seq).map(|_| ())
    }
}

impl Drop for Vcpu {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

enum Flow {
    Continue,
    Stop,
    /// KVM_EXIT_SHUTDOWN: the caller, which holds the fd, records it with
    /// the vCPU's registers.
    TripleFault,
    Fail(String),
}

/// Records a triple fault of vCPU `index` with its state as KVM has it now.
fn triple_fault(index: u8, fd: &VcpuFd, ctx: &VcpuContext) {
    ctx.exit.set(ExitReason::TripleFault {
        vcpu: index,
        regs: fault_state(fd),
    });
}

/// A one-line account of a vCPU's state at a triple fault.
fn fault_state(fd: &VcpuFd) -> String {
    let mut out = Vec::new();
    // AMD's KVM reinitializes a vCPU when it intercepts a shutdown (the VMCB
    // is undefined after one): what it reports then is the reset state.
    let reset = fd.get_regs().is_ok_and(|r| r.rip == 0xfff0)
        && fd.get_sregs().is_ok_and(|s| s.cs.selector == 0xf000);
    if reset {
        out.push("state lost: KVM reset the vCPU at the shutdown (as AMD's does);".to_string());
    }
    match fd.get_regs() {
        Ok(r) => out.push(format!(
            "rip={:#x} rsp={:#x} rflags={:#x} rax={:#x}",
            r.rip, r.rsp, r.rflags, r.rax
        )),
        Err(e) => out.push(format!("no registers: {e}")),
    }
    match fd.get_sregs() {
        Ok(s) => out.push(format!(
            "cs={:#x} ss.dpl={} cr0={:#x} cr2={:#x} cr3={:#x} cr4={:#x} efer={:#x} idt={:#x}/{:#x} gdt={:#x}/{:#x} tr={:#x}",
            s.cs.selector,
            s.ss.dpl,
            s.cr0,
            s.cr2,
            s.cr3,
            s.cr4,
            s.efer,
            s.idt.base,
            s.idt.limit,
            s.gdt.base,
            s.gdt.limit,
            s.tr.base
        )),
        Err(e) => out.push(format!("no special registers: {e}")),
    }
    if let Ok(ev) = fd.get_vcpu_events() {
        out.push(format!(
            "exception={}:{} nmi_pending={} interrupt={}:{}",
            ev.exception.injected,
            ev.exception.nr,
            ev.nmi.pending,
            ev.interrupt.injected,
            ev.interrupt.nr
        ));
    }
    out.join(" ")
}

fn run_thread(
    index: u8,
    mut fd: VcpuFd,
    ctx: VcpuContext,
    rx: Receiver<(u64, Command)>,
    acks: Sender<(u64, Ack)>,
    stats: &VcpuStats,
) {
    KVM_RUN.with(|c| c.set(fd.get_kvm_run() as *mut kvm_run));
    let mut state = RunState::Created;
    loop {
        if state != RunState::Running {
            // Parked: block for the next command.
            let (seq, cmd) = match rx.recv() {
                Ok(c) => c,
                Err(_) => break,
            };
            match cmd {
                Command::Run if state != RunState::Exited => state = RunState::Running,
                Command::Run | Command::Pause => {}
                Command::Save(msrs) => {
                    let r = save_vcpu(&fd, index, &msrs).map(Box::new);
                    let _ = acks.send((seq, Ack::Saved(r)));
                    continue;
                }
                Command::Exit => break,
            }
            let _ = acks.send((seq, Ack::State(state)));
            continue;
        }
        fd.set_kvm_immediate_exit(0);
        match rx.try_recv() {
            Ok((seq, Command::Pause)) => {
                state = match complete_last_exit(index, &mut fd, &ctx, stats) {
                    Flow::Continue => RunState::Paused,
                    Flow::Stop | Flow::TripleFault | Flow::Fail(_) => RunState::Exited,
                };
                let _ = acks.send((seq, Ack::State(state)));
                continue;
            }
            Ok((seq, Command::Run)) => {
                let _ = acks.send((seq, Ack::State(state)));
            }
            Ok((seq, Command::Save(_))) => {
                let _ = acks.send((seq, Ack::Saved(Err(StateError::Running(index)))));
            }
            Ok((_, Command::Exit)) | Err(TryRecvError::Disconnected) => break,
            Err(TryRecvError::Empty) => {}
        }
        stats.entering();
        let flow = match fd.run() {
            Ok(exit) => {
                stats.returned(ExitKind::of(&exit));
                handle_exit(exit, &ctx)
            }
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                stats.returned(ExitKind::Interrupted);
                Flow::Continue
            }
            Err(e) => {
                stats.returned(ExitKind::Other);
                ctx.exit.set(ExitReason::VcpuFailed {
                    vcpu: index,
                    message: format!("KVM_RUN: {e}"),
                });
                Flow::Stop
            }
        };
        match flow {
            Flow::Continue => {}
            Flow::Stop => state = RunState::Exited,
            Flow::TripleFault => {
                triple_fault(index, &fd, &ctx);
                state = RunState::Exited;
            }
            Flow::Fail(message) => {
                let rip = fd.get_regs().map(|r| r.rip).unwrap_or(0);
                ctx.exit.set(ExitReason::VcpuFailed {
                    vcpu: index,
                    message: format!("{message} at rip {rip:#x}"),
                });
                // Park until the host tells us to exit, so the VM's teardown joins us.
                state = RunState::Exited;
            }
        }
    }
    KVM_RUN.with(|c| c.set(std::ptr::null_mut()));
    drop(fd);
}

/// Completes the access of the last exit (see the module docs): `KVM_RUN`
/// with `immediate_exit` set finishes it and returns EINTR without running
/// guest code. An access that needs another exit (a string port access) is
/// served and completed the same way, at most [`MAX_PARK_EXITS`] times.
fn complete_last_exit(index: u8, fd: &mut VcpuFd, ctx: &VcpuContext, stats: &VcpuStats) -> Flow {
    stats
        .parked_after
        .store(stats.last_exit.load(Ordering::Relaxed), Ordering::Relaxed);
    fd.set_kvm_immediate_exit(1);
    let mut flow = Flow::Continue;
    for _ in 0..MAX_PARK_EXITS {
        stats.entering();
        match fd.run() {
            Ok(exit) => {
                stats.returned(ExitKind::of(&exit));
                stats.park_exits.fetch_add(1, Ordering::Relaxed);
                flow = handle_exit(exit, ctx);
                if !matches!(flow, Flow::Continue) {
                    break;
                }
            }
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                stats.returned(ExitKind::Interrupted);
                break;
            }
            Err(e) => {
                stats.returned(ExitKind::Other);
                ctx.exit.set(ExitReason::VcpuFailed {
                    vcpu: index,
                    message: format!("KVM_RUN (completing before a pause): {e}"),
                });
                flow = Flow::Stop;
                break;
            }
        }
    }
    fd.set_kvm_immediate_exit(0);
    if let Flow::TripleFault = flow {
        triple_fault(index, fd, ctx);
    }
    if let Flow::Fail(message) = &flow {
        let rip = fd.get_regs().map(|r| r.rip).unwrap_or(0);
        ctx.exit.set(ExitReason::VcpuFailed {
            vcpu: index,
            message: format!("{message} at rip {rip:#x}"),
        });
    }
    flow
}

fn handle_exit(exit: VcpuExit<'_>, ctx: &VcpuContext) -> Flow {
    match exit {
        VcpuExit::IoIn(port, data) => {
            if !ctx.pio.read(u64::from(port), data) {
                data.fill(0xff);
            }
            Flow::Continue
        }
        VcpuExit::IoOut(port, data) => {
            ctx.pio.write(u64::from(port), data);
            if port == I8042_COMMAND_PORT && data == [I8042_RESET_CPU] {
                // The guest pulsed the reset line: this vCPU stops here. (The
                // event loop learns of it from the i8042's eventfd too, but
                // later: a panicking Linux goes on to other reboot methods, a
                // triple fault last, and that must not be what the VM ends on.)
                ctx.exit.set(ExitReason::Reset);
                return Flow::Stop;
            }
            Flow::Continue
        }
        VcpuExit::MmioRead(addr, data) => {
            if !ctx.mmio.read(addr, data) {
                data.fill(0xff);
            }
            Flow::Continue
        }
        VcpuExit::MmioWrite(addr, data) => {
            ctx.mmio.write(addr, data);
            Flow::Continue
        }
        VcpuExit::Hlt | VcpuExit::IrqWindowOpen | VcpuExit::Intr => Flow::Continue,
        VcpuExit::Shutdown => Flow::TripleFault,
        VcpuExit::SystemEvent(ty, _) => match ty {
            kvm_bindings::KVM_SYSTEM_EVENT_RESET => {
                ctx.exit.set(ExitReason::Reset);
                Flow::Stop
            }
            kvm_bindings::KVM_SYSTEM_EVENT_SHUTDOWN => {
                ctx.exit.set(ExitReason::PowerOff);
                Flow::Stop
            }
            other => Flow::Fail(format!("unexpected system event {other}")),
        },
        other => Flow::Fail(format!("unhandled exit {other:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> VcpuContext {
        VcpuContext {
            pio: Arc::new(Bus::new()),
            mmio: Arc::new(Bus::new()),
            exit: Arc::new(ExitSignal::default()),
        }
    }

    /// A guest that pulses the i8042 reset line ends the VM as reset right
    /// there, on its vCPU: a panicking Linux that went on to its last reboot
    /// method (a triple fault) before the event loop read the i8042's eventfd
    /// must not be reported as having triple-faulted.
    #[test]
    fn an_i8042_reset_stops_the_vcpu_as_a_reset() {
        let c = ctx();
        let mut data = [I8042_RESET_CPU];
        assert!(matches!(
            handle_exit(VcpuExit::IoOut(I8042_COMMAND_PORT, &data), &c),
            Flow::Stop
        ));
        assert_eq!(c.exit.get(), Some(ExitReason::Reset));
        // Other writes to the controller, and a read, are not resets.
        let c = ctx();
        data[0] = 0xd1;
        assert!(matches!(
            handle_exit(VcpuExit::IoOut(I8042_COMMAND_PORT, &data), &c),
            Flow::Continue
        ));
        data[0] = I8042_RESET_CPU;
        assert!(matches!(
            handle_exit(VcpuExit::IoOut(crate::layout::I8042_PORT, &data), &c),
            Flow::Continue
        ));
        assert!(matches!(
            handle_exit(VcpuExit::Shutdown, &c),
            Flow::TripleFault
        ));
        assert_eq!(c.exit.get(), None);
    }
}
