//! Attaching devices to a VM, one `attach_*` step each: put the device on a
//! bus, route its interrupt (KVM irqfd), its queue notifications (KVM
//! ioeventfd) and its events (the event loop).

use devices::virtio::GuestMemoryMmap;
use std::sync::{Arc, Mutex};

use devices::legacy::{Serial, I8042};
use devices::virtio::block::Block;
use devices::virtio::mmio::{MmioTransport, NOTIFY_REG_OFFSET};
use devices::virtio::net::Net;
use devices::virtio::rng::Rng;
use devices::virtio::vsock::Vsock;
use devices::virtio::VirtioDevice;
use devices::Bus;
use event_manager::{MutEventSubscriber, SubscriberOps};
use kvm_ioctls::{IoEventAddress, VmFd};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::event_loop::{Manager, ResetWatcher};
use crate::layout;
use crate::mailbox::Mailbox;
use crate::vcpu::ExitSignal;

#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error("Cannot create an eventfd for {0}")]
    EventFd(&'static str, #[source] std::io::Error),
    #[error("KVM refused the interrupt route for {0}")]
    Irqfd(&'static str, #[source] kvm_ioctls::Error),
    #[error("KVM refused the queue notifier for {0}")]
    Ioeventfd(&'static str, #[source] kvm_ioctls::Error),
    #[error("Cannot place {0} on the bus")]
    Bus(&'static str, #[source] devices::BusError),
    #[error("No room for another virtio-mmio device")]
    NoSlot,
    #[error("Cannot restore the {0} from its saved state")]
    Restore(
        &'static str,
        #[source] Box<dyn std::error::Error + Send + Sync>,
    ),
}

/// A virtio device of a VM, kept for its state at snapshot time.
#[derive(Clone)]
pub enum VirtioDev {
    Block(Arc<Mutex<Block>>),
    Vsock(Arc<Mutex<Vsock>>),
    Rng(Arc<Mutex<Rng>>),
    Net(Arc<Mutex<Net>>),
}

/// The transport and device of one virtio-mmio slot.
#[derive(Clone)]
pub struct VirtioHandle {
    pub transport: Arc<Mutex<MmioTransport>>,
    pub dev: VirtioDev,
}

/// Every device of a VM whose state a snapshot captures.
pub struct DeviceHandles {
    pub serial: Arc<Mutex<Serial>>,
    pub i8042: Arc<Mutex<I8042>>,
    pub virtio: Vec<VirtioHandle>,
}

/// The buses and routing being built for one VM, kept between attach steps.
pub struct Wiring {
    pub pio: Bus,
    pub mmio: Bus,
    pub em: Manager,
    pub exit: Arc<ExitSignal>,
    /// `virtio_mmio.device=` entries for the kernel command line.
    pub cmdline_devices: Vec<String>,
    next_virtio: u32,
}

impl Wiring {
    pub fn new(em: Manager, exit: Arc<ExitSignal>) -> Self {
        Self {
            pio: Bus::new(),
            mmio: Bus::new(),
            em,
            exit,
            cmdline_devices: Vec::new(),
            next_virtio: 0,
        }
    }
}

/// One attach step's view of a VM: its KVM VM, guest memory and wiring.
pub struct Attach<'a> {
    pub vm: &'a VmFd,
    pub mem: &'a GuestMemoryMmap,
    pub w: &'a mut Wiring,
}

impl Attach<'_> {
    fn irq_eventfd(&self, what: &'static str, gsi: u32) -> Result<EventFd, AttachError> {
        let evt = EventFd::new(EFD_NONBLOCK).map_err(|e| AttachError::EventFd(what, e))?;
        self.vm
            .register_irqfd(&evt, gsi)
            .map_err(|e| AttachError::Irqfd(what, e))?;
        Ok(evt)
    }

    /// The 8250 at port 0x3f8 (Linux's ttyS0) and at its MMIO alias (the test
    /// guest's, since port I/O from guest user mode traps), on GSI 4, built by
    /// `make` from its interrupt eventfd.
    pub fn attach_serial_with(
        &mut self,
        make: impl FnOnce(EventFd) -> Result<Serial, AttachError>,
    ) -> Result<Arc<Mutex<Serial>>, AttachError> {
        let evt = self.irq_eventfd("serial", layout::SERIAL_GSI)?;
        let serial = Arc::new(Mutex::new(make(evt)?));
        self.w
            .pio
            .insert(
                serial.clone(),
                u64::from(layout::SERIAL_PORT),
                u64::from(layout::SERIAL_PORT_SIZE),
            )
            .map_err(|e| AttachError::Bus("serial", e))?;
        self.w
            .mmio
            .insert(
                serial.clone(),
                layout::SERIAL_MMIO,
                layout::SERIAL_MMIO_SIZE,
            )
            .map_err(|e| AttachError::Bus("serial", e))?;
        Ok(serial)
    }

    /// The i8042, built by `make` from its reset eventfd: a guest reset
    /// through it ends the VM with `ExitReason::Reset`.
    pub fn attach_i8042_with(
        &mut self,
        make: impl FnOnce(EventFd) -> Result<I8042, AttachError>,
    ) -> Result<Arc<Mutex<I8042>>, AttachError> {
        let evt = EventFd::new(EFD_NONBLOCK).map_err(|e| AttachError::EventFd("i8042", e))?;
        let watch = evt
            .try_clone()
            .map_err(|e| AttachError::EventFd("i8042", e))?;
        let dev = Arc::new(Mutex::new(make(evt)?));
        self.w
            .pio
            .insert(
                dev.clone(),
                u64::from(layout::I8042_PORT),
                u64::from(layout::I8042_PORT_SIZE),
            )
            .map_err(|e| AttachError::Bus("i8042", e))?;
        self.w.em.add_subscriber(Arc::new(Mutex::new(ResetWatcher {
            evt: watch,
            exit: self.w.exit.clone(),
        })));
        Ok(dev)
    }

    /// A virtio device on the next virtio-mmio window and its GSI; `transport`
    /// builds its transport (fresh, or restored from a snapshot).
    pub fn attach_virtio<D>(
        &mut self,
        what: &'static str,
        dev: Arc<Mutex<D>>,
        transport: impl FnOnce(
            &GuestMemoryMmap,
            Arc<Mutex<dyn VirtioDevice>>,
        ) -> Result<MmioTransport, AttachError>,
    ) -> Result<Arc<Mutex<MmioTransport>>, AttachError>
    where
        D: VirtioDevice + MutEventSubscriber + Send + 'static,
    {
        let i = self.w.next_virtio;
        if i >= layout::VIRTIO_MMIO_MAX {
            return Err(AttachError::NoSlot);
        }
        let base = layout::virtio_mmio_addr(i);
        let gsi = layout::VIRTIO_GSI_BASE + i;
        {
            let d = devices::bus::lock(&dev);
            self.vm
                .register_irqfd(d.interrupt().eventfd(), gsi)
                .map_err(|e| AttachError::Irqfd(what, e))?;
            for (q, evt) in d.queue_events().iter().enumerate() {
                self.vm
                    .register_ioevent(
                        evt,
                        &IoEventAddress::Mmio(base + NOTIFY_REG_OFFSET),
                        q as u32,
                    )
                    .map_err(|e| AttachError::Ioeventfd(what, e))?;
            }
        }
        let transport = Arc::new(Mutex::new(transport(self.mem, dev.clone())?));
        self.w
            .mmio
            .insert(transport.clone(), base, layout::VIRTIO_MMIO_SIZE)
            .map_err(|e| AttachError::Bus(what, e))?;
        self.w.em.add_subscriber(dev);
        self.w
            .cmdline_devices
            .push(format!("virtio_mmio.device=4K@{base:#x}:{gsi}"));
        self.w.next_virtio += 1;
        Ok(transport)
    }

    /// The test guest's mailbox: the doorbell device and one interrupt line per vCPU.
    pub fn attach_mailbox(&mut self, vcpus: u8) -> Result<Mailbox, AttachError> {
        let irqs = (0..vcpus)
            .map(|c| self.irq_eventfd("mailbox", layout::MAILBOX_GSI_BASE + u32::from(c)))
            .collect::<Result<Vec<_>, _>>()?;
        let (mailbox, dev) = Mailbox::new(self.mem.clone(), irqs, self.w.exit.clone());
        self.w
            .mmio
            .insert(
                Arc::new(Mutex::new(dev)),
                layout::MAILBOX_MMIO,
                layout::MAILBOX_MMIO_SIZE,
            )
            .map_err(|e| AttachError::Bus("mailbox", e))?;
        Ok(mailbox)
    }
}
