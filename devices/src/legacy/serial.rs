//! The 8250 UART (vm-superio) as a bus device, reachable both at port 0x3f8 and
//! at an MMIO alias (byte registers), with its output sent to stdout, a file or a
//! bounded in-memory buffer, and its interrupt raised through an eventfd (irqfd).

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Write};
use std::sync::{Arc, Mutex};

use vm_superio::serial::NoEvents;
use vm_superio::Trigger;
use vmm_sys_util::eventfd::EventFd;

use crate::bus::{lock, BusDevice};

/// Where the guest console goes.
#[derive(Clone)]
pub enum SerialOutput {
    /// Discard.
    Sink,
    /// The VMM's standard output.
    Stdout,
    /// Append to a file.
    File(Arc<Mutex<File>>),
    /// Keep the last `cap` bytes in memory (tests, the service's console log).
    Buffer(ConsoleBuffer),
}

/// A bounded console capture: keeps only the most recent `cap` bytes, so a
/// guest that prints forever cannot grow host memory.
#[derive(Clone)]
pub struct ConsoleBuffer {
    inner: Arc<Mutex<VecDeque<u8>>>,
    cap: usize,
}

impl ConsoleBuffer {
    pub fn new(cap: usize) -> Self {
        Self {
            inner: Arc::new(Mutex::new(VecDeque::new())),
            cap,
        }
    }

    fn push(&self, data: &[u8]) {
        let mut q = lock(&self.inner);
        let data = &data[data.len().saturating_sub(self.cap)..];
        let overflow = (q.len() + data.len()).saturating_sub(self.cap);
        q.drain(..overflow);
        q.extend(data);
    }

    /// A copy of what is held, lossily decoded.
    pub fn text(&self) -> String {
        let q = lock(&self.inner);
        let (a, b) = q.as_slices();
        let mut v = Vec::with_capacity(q.len());
        v.extend_from_slice(a);
        v.extend_from_slice(b);
        String::from_utf8_lossy(&v).into_owned()
    }
}

/// The console writer handed to vm-superio.
pub struct ConsoleWriter(SerialOutput);

impl Write for ConsoleWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match &self.0 {
            SerialOutput::Sink => {}
            SerialOutput::Stdout => {
                let mut out = io::stdout().lock();
                out.write_all(buf)?;
                out.flush()?;
            }
            SerialOutput::File(f) => lock(f).write_all(buf)?,
            SerialOutput::Buffer(b) => b.push(buf),
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Raises the serial interrupt line through an eventfd (a KVM irqfd).
pub struct EventFdTrigger(EventFd);

impl Trigger for EventFdTrigger {
    type E = io::Error;
    fn trigger(&self) -> io::Result<()> {
        self.0.write(1)
    }
}

pub struct Serial {
    uart: vm_superio::Serial<EventFdTrigger, NoEvents, ConsoleWriter>,
}

impl Serial {
    pub fn new(irq_evt: EventFd, out: SerialOutput) -> Self {
        Self {
            uart: vm_superio::Serial::new(EventFdTrigger(irq_evt), ConsoleWriter(out)),
        }
    }

    /// Bytes for the guest to read (console input). Returns how many were taken.
    pub fn enqueue_input(&mut self, input: &[u8]) -> usize {
        self.uart.enqueue_raw_bytes(input).unwrap_or(0)
    }
}

impl BusDevice for Serial {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if let (Ok(off), Some(first)) = (u8::try_from(offset), data.first_mut()) {
            if off < 8 {
                *first = self.uart.read(off);
            }
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let (Ok(off), Some(&value)) = (u8::try_from(offset), data.first()) {
            if off < 8 {
                if let Err(e) = self.uart.write(off, value) {
                    log::debug!("serial: write failed: {e:?}");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm_sys_util::eventfd::EFD_NONBLOCK;

    #[test]
    fn output_goes_to_a_bounded_buffer() {
        let buf = ConsoleBuffer::new(8);
        let evt = EventFd::new(EFD_NONBLOCK).unwrap();
        let mut s = Serial::new(evt, SerialOutput::Buffer(buf.clone()));
        for b in b"hello, world" {
            s.write(0, &[*b]);
        }
        assert_eq!(buf.text(), "o, world");
        // Reads outside the 8 registers and empty accesses do nothing.
        let mut d = [0xffu8; 1];
        s.read(100, &mut d);
        assert_eq!(d[0], 0);
        s.write(100, &[1]);
        s.write(0, &[]);
    }

    #[test]
    fn input_raises_the_interrupt() {
        let evt = EventFd::new(EFD_NONBLOCK).unwrap();
        let mut s = Serial::new(evt.try_clone().unwrap(), SerialOutput::Sink);
        // Enable the received-data interrupt (IER bit 0).
        s.write(1, &[1]);
        assert_eq!(s.enqueue_input(b"ab"), 2);
        assert!(evt.read().unwrap() >= 1);
        let mut d = [0u8; 1];
        s.read(0, &mut d);
        assert_eq!(d[0], b'a');
    }
}
