//! The test guest's command mailbox (ABI in `guest_abi::mailbox`): a doorbell
//! device on the MMIO bus, and the host-side client that posts a command into
//! a vCPU's slot in guest RAM, raises that vCPU's interrupt line and waits for
//! the doorbell.

use devices::virtio::GuestMemoryMmap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use devices::bus::lock;
use devices::BusDevice;
use guest_abi::mailbox as abi;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use crate::layout;
use crate::vcpu::{ExitReason, ExitSignal};

#[derive(Debug, thiserror::Error)]
pub enum MailboxError {
    #[error("No vCPU {0} in this VM")]
    NoSuchVcpu(u8),
    #[error("vCPU {cpu} did not answer command {cmd} within {timeout:?}")]
    Timeout {
        cpu: u8,
        cmd: u32,
        timeout: Duration,
    },
    #[error("vCPU {0} did not report ready within {1:?}")]
    NotReady(u8, Duration),
    #[error("The VM stopped: {0}")]
    VmExited(ExitReason),
    #[error("Cannot reach the mailbox in guest memory")]
    Memory(#[source] vm_memory::GuestMemoryError),
    #[error("Cannot raise the mailbox interrupt")]
    Irq(#[source] std::io::Error),
}

/// A command's results as the guest wrote them (untrusted values).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reply {
    pub status: u32,
    pub rets: [u64; 4],
}

impl Reply {
    pub fn is_ok(&self) -> bool {
        self.status == abi::STATUS_OK
    }
}

#[derive(Default)]
struct Doorbells {
    /// Doorbell writes seen per vCPU.
    done: [u64; layout::MAX_VCPUS as usize],
    /// Bit `c` set once vCPU `c` reported ready.
    ready: u8,
}

struct Shared {
    bells: Mutex<Doorbells>,
    cond: Condvar,
    exit: Arc<ExitSignal>,
    panic_rip: Mutex<u64>,
}

impl Shared {
    fn ring(&self, f: impl FnOnce(&mut Doorbells)) {
        f(&mut lock(&self.bells));
        self.cond.notify_all();
    }
}

/// The doorbell device the guest writes (see `guest_abi::mailbox::REG_*`).
pub struct MailboxDevice {
    shared: Arc<Shared>,
}

impl BusDevice for MailboxDevice {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let Ok(bytes) = <[u8; 4]>::try_from(data.get(..4).unwrap_or_default()) else {
            return;
        };
        let v = u32::from_le_bytes(bytes);
        let cpu = usize::try_from(v)
            .ok()
            .filter(|&c| c < layout::MAX_VCPUS as usize);
        match (offset, cpu) {
            (abi::REG_DONE, Some(c)) => self.shared.ring(|b| b.done[c] += 1),
            (abi::REG_READY, Some(c)) => self.shared.ring(|b| b.ready |= 1 << c),
            (abi::REG_PANIC_RIP, _) => {
                let hi = data.get(4..8).map_or(0, |h| {
                    u64::from(u32::from_le_bytes(h.try_into().unwrap_or_default()))
                });
                *lock(&self.shared.panic_rip) = u64::from(v) | (hi << 32);
            }
            (abi::REG_PANIC, _) => {
                let rip = *lock(&self.shared.panic_rip);
                self.shared
                    .exit
                    .set(ExitReason::GuestPanic { code: v, rip });
                self.shared.ring(|_| {});
            }
            _ => log::debug!("mailbox: ignored write {v:#x} at {offset:#x}"),
        }
    }
}

/// The host side: posts commands and waits for answers. One command at a time
/// per vCPU; different vCPUs run commands concurrently.
pub struct Mailbox {
    shared: Arc<Shared>,
    mem: GuestMemoryMmap,
    irqs: Vec<EventFd>,
    slots: Vec<Mutex<u32>>,
}

impl Mailbox {
    /// A mailbox for `irqs.len()` vCPUs; `irqs[c]` is routed to vCPU c's GSI.
    pub fn new(
        mem: GuestMemoryMmap,
        irqs: Vec<EventFd>,
        exit: Arc<ExitSignal>,
    ) -> (Self, MailboxDevice) {
        let shared = Arc::new(Shared {
            bells: Mutex::new(Doorbells::default()),
            cond: Condvar::new(),
            exit,
            panic_rip: Mutex::new(0),
        });
        let slots = irqs.iter().map(|_| Mutex::new(0)).collect();
        let dev = MailboxDevice {
            shared: shared.clone(),
        };
        (
            Self {
                shared,
                mem,
                irqs,
                slots,
            },
            dev,
        )
    }

    fn slot(cpu: u8) -> u64 {
        layout::MAILBOX_GPA + u64::from(cpu) * abi::SLOT_SIZE
    }

    /// Waits until vCPU `cpu` reports it serves its slot.
    pub fn wait_ready(&self, cpu: u8, timeout: Duration) -> Result<(), MailboxError> {
        if usize::from(cpu) >= self.slots.len() {
            return Err(MailboxError::NoSuchVcpu(cpu));
        }
        self.wait(timeout, |b| b.ready & (1 << cpu) != 0)
            .map_err(|e| match e {
                MailboxError::Timeout { .. } => MailboxError::NotReady(cpu, timeout),
                e => e,
            })
    }

    fn wait(
        &self,
        timeout: Duration,
        mut done: impl FnMut(&Doorbells) -> bool,
    ) -> Result<(), MailboxError> {
        let deadline = Instant::now() + timeout;
        let mut g = lock(&self.shared.bells);
        loop {
            if done(&g) {
                return Ok(());
            }
            if let Some(r) = self.shared.exit.get() {
                return Err(MailboxError::VmExited(r));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(MailboxError::Timeout {
                    cpu: 0,
                    cmd: 0,
                    timeout,
                });
            }
            // Wake periodically to notice a VM exit signalled elsewhere.
            let step = (deadline - now).min(Duration::from_millis(50));
            g = self
                .shared
                .cond
                .wait_timeout(g, step)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Runs `cmd` with `args` on vCPU `cpu` and returns the guest's reply.
    pub fn call(
        &self,
        cpu: u8,
        cmd: u32,
        args: [u64; 4],
        timeout: Duration,
    ) -> Result<Reply, MailboxError> {
        let slot_lock = self
            .slots
            .get(usize::from(cpu))
            .ok_or(MailboxError::NoSuchVcpu(cpu))?;
        let mut seq = lock(slot_lock);
        let base = Self::slot(cpu);
        let at = |off: u64| GuestAddress(base + off);
        let new_seq = seq.wrapping_add(1);
        self.mem
            .write_obj(cmd, at(abi::OFF_CMD))
            .map_err(MailboxError::Memory)?;
        self.mem
            .write_obj(args, at(abi::OFF_ARGS))
            .map_err(MailboxError::Memory)?;
        self.mem
            .store(new_seq, at(abi::OFF_SEQ), Ordering::Release)
            .map_err(MailboxError::Memory)?;
        *seq = new_seq;
        self.irqs[usize::from(cpu)]
            .write(1)
            .map_err(MailboxError::Irq)?;
        let mem = &self.mem;
        self.wait(timeout, |_| {
            mem.load::<u32>(at(abi::OFF_DONE_SEQ), Ordering::Acquire)
                .is_ok_and(|d| d == new_seq)
        })
        .map_err(|e| match e {
            MailboxError::Timeout { timeout, .. } => MailboxError::Timeout { cpu, cmd, timeout },
            e => e,
        })?;
        let status = self
            .mem
            .read_obj::<u32>(at(abi::OFF_STATUS))
            .map_err(MailboxError::Memory)?;
        let rets = self
            .mem
            .read_obj::<[u64; 4]>(at(abi::OFF_RETS))
            .map_err(MailboxError::Memory)?;
        Ok(Reply { status, rets })
    }

    /// vCPUs that reported ready, as a bit mask.
    pub fn ready_mask(&self) -> u8 {
        lock(&self.shared.bells).ready
    }

    /// After a restore: take the sequence numbers from the slots in guest RAM
    /// (so the next command is new to the guest) and the ready mask the
    /// snapshot recorded (the restored guest is already serving).
    pub fn resync(&self, ready: u8) -> Result<(), MailboxError> {
        for (cpu, slot) in self.slots.iter().enumerate() {
            let seq: u32 = self
                .mem
                .read_obj(GuestAddress(Self::slot(cpu as u8) + abi::OFF_SEQ))
                .map_err(MailboxError::Memory)?;
            *lock(slot) = seq;
        }
        self.shared.ring(|b| b.ready = ready);
        Ok(())
    }

    /// The counter `CMD_COUNT` advances on vCPU `cpu`, read from guest RAM.
    pub fn counter(&self, cpu: u8) -> Result<u64, MailboxError> {
        self.mem
            .read_obj(GuestAddress(Self::slot(cpu) + abi::OFF_COUNTER))
            .map_err(MailboxError::Memory)
    }

    pub fn vcpus(&self) -> u8 {
        self.slots.len() as u8
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm_sys_util::eventfd::EFD_NONBLOCK;

    /// A host thread plays the guest: it watches the slot and answers through
    /// the doorbell device, as the test guest does.
    #[test]
    fn call_round_trip_and_timeout() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        let exit = Arc::new(ExitSignal::default());
        let (mb, mut dev) = Mailbox::new(mem.clone(), vec![irq.try_clone().unwrap()], exit.clone());
        dev.write(abi::REG_READY, &0u32.to_le_bytes());
        mb.wait_ready(0, Duration::from_secs(1)).unwrap();
        assert!(matches!(
            mb.wait_ready(3, Duration::from_millis(1)),
            Err(MailboxError::NoSuchVcpu(3))
        ));
        let guest = std::thread::spawn(move || {
            let base = layout::MAILBOX_GPA;
            loop {
                let seq: u32 = mem.load(GuestAddress(base), Ordering::Acquire).unwrap();
                if seq == 1 {
                    let args: [u64; 4] = mem.read_obj(GuestAddress(base + abi::OFF_ARGS)).unwrap();
                    mem.write_obj([args[0], 0, 0, 0], GuestAddress(base + abi::OFF_RETS))
                        .unwrap();
                    mem.store(
                        1u32,
                        GuestAddress(base + abi::OFF_DONE_SEQ),
                        Ordering::Release,
                    )
                    .unwrap();
                    dev.write(abi::REG_DONE, &0u32.to_le_bytes());
                    return;
                }
                std::thread::yield_now();
            }
        });
        let r = mb
            .call(0, abi::CMD_ECHO, [42, 0, 0, 0], Duration::from_secs(5))
            .unwrap();
        guest.join().unwrap();
        assert!(r.is_ok());
        assert_eq!(r.rets[0], 42);
        assert_eq!(irq.read().unwrap(), 1);
        // Nobody answers the second command.
        let e = mb
            .call(0, abi::CMD_ECHO, [1, 0, 0, 0], Duration::from_millis(50))
            .unwrap_err();
        assert!(matches!(e, MailboxError::Timeout { cpu: 0, .. }), "{e}");
        exit.set(ExitReason::Stopped);
        let e = mb
            .call(0, abi::CMD_ECHO, [1, 0, 0, 0], Duration::from_secs(5))
            .unwrap_err();
        assert!(matches!(e, MailboxError::VmExited(ExitReason::Stopped)));
    }
}
