//! The 8250 UART (vm-superio) as a bus device, reachable both at port 0x3f8 and
//! at an MMIO alias (byte registers), with its output sent to stdout, a file or a
//! bounded in-memory buffer, and its interrupt raised through an eventfd (irqfd).
//!
//! [`SerialState`] saves the UART registers and the input the guest has not read yet;
//! where the output goes is the VMM's to choose again at restore.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Write};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use vm_superio::serial::{NoEvents, SerialState as UartState};
use vm_superio::Trigger;
use vmm_sys_util::eventfd::EventFd;

use crate::bus::{lock, BusDevice};
use crate::state::{check_version, versions, Persist, StateError};
/// Most input bytes the UART holds (its FIFO).
pub const SERIAL_FIFO_SIZE: usize = 64;

const WHAT: &str = "serial";

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

/// What restoring a [`Serial`] needs besides its state.
pub struct SerialRestoreArgs {
    /// The interrupt line (a KVM irqfd).
    pub irq_evt: EventFd,
    /// Where the output goes now.
    pub out: SerialOutput,
}

impl Persist for Serial {
    type State = SerialState;
    type RestoreArgs = SerialRestoreArgs;

    /// The UART registers and pending input.
    fn save(&self) -> SerialState {
        let s = self.uart.state();
        SerialState {
            version: versions::SERIAL,
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }

    /// A UART in `state`, raising `irq_evt` and writing to `out`. An interrupt that was
    /// pending (data ready or transmitter empty, and enabled) is raised again.
    fn restore(args: SerialRestoreArgs, state: &SerialState) -> Result<Self, StateError> {
        check_version(WHAT, state.version, versions::SERIAL)?;
        if state.in_buffer.len() > SERIAL_FIFO_SIZE {
            return Err(StateError::invalid(
                WHAT,
                format!(
                    "{} input bytes pending, the FIFO holds {SERIAL_FIFO_SIZE}",
                    state.in_buffer.len()
                ),
            ));
        }
        let uart_state = UartState {
            baud_divisor_low: state.baud_divisor_low,
            baud_divisor_high: state.baud_divisor_high,
            interrupt_enable: state.interrupt_enable,
            interrupt_identification: state.interrupt_identification,
            line_control: state.line_control,
            line_status: state.line_status,
            modem_control: state.modem_control,
            modem_status: state.modem_status,
            scratch: state.scratch,
            in_buffer: state.in_buffer.clone(),
        };
        let uart = vm_superio::Serial::from_state(
            &uart_state,
            EventFdTrigger(args.irq_evt),
            NoEvents,
            ConsoleWriter(args.out),
        )
        .map_err(|e| StateError::invalid(WHAT, format!("{e:?}")))?;
        Ok(Self { uart })
    }
}

/// The 8250's registers (vm-superio's `SerialState`, which has no serde) and the input
/// the guest has not read yet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SerialState {
    pub version: u16,
    pub baud_divisor_low: u8,
    pub baud_divisor_high: u8,
    pub interrupt_enable: u8,
    pub interrupt_identification: u8,
    pub line_control: u8,
    pub line_status: u8,
    pub modem_control: u8,
    pub modem_status: u8,
    pub scratch: u8,
    /// Received bytes not read yet, oldest first; at most [`SERIAL_FIFO_SIZE`].
    pub in_buffer: Vec<u8>,
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
    fn state_round_trips_with_pending_input() {
        let evt = EventFd::new(EFD_NONBLOCK).unwrap();
        let mut s = Serial::new(evt.try_clone().unwrap(), SerialOutput::Sink);
        // Line control 8N1 with DLAB, a divisor, then back; scratch; data interrupt on.
        s.write(3, &[0x83]);
        s.write(0, &[0x0c]);
        s.write(3, &[0x03]);
        s.write(7, &[0x5a]);
        s.write(1, &[1]);
        assert_eq!(s.enqueue_input(b"xyz"), 3);
        let _ = evt.read();

        let saved = s.save();
        assert_eq!(saved.in_buffer, b"xyz");
        let state = crate::state::postcard_round_trip(&saved);
        assert_eq!(state, saved);
        let evt2 = EventFd::new(EFD_NONBLOCK).unwrap();
        let buf = ConsoleBuffer::new(16);
        let args = SerialRestoreArgs {
            irq_evt: evt2.try_clone().unwrap(),
            out: SerialOutput::Buffer(buf.clone()),
        };
        let mut r = Serial::restore(args, &state).unwrap();
        assert_eq!(r.save(), saved);
        // The pending data interrupt is raised again, and the input reads on.
        assert_eq!(evt2.read().unwrap(), 1);
        let mut d = [0u8; 1];
        for want in b"xyz" {
            r.read(0, &mut d);
            assert_eq!(d[0], *want);
        }
        r.read(7, &mut d);
        assert_eq!(d[0], 0x5a);
        r.write(0, b"!");
        assert_eq!(buf.text(), "!");

        let mut bad = saved.clone();
        bad.in_buffer = vec![0; 65];
        let sink = |evt: &EventFd| SerialRestoreArgs {
            irq_evt: evt.try_clone().unwrap(),
            out: SerialOutput::Sink,
        };
        let err = Serial::restore(sink(&evt), &bad);
        assert!(err.err().unwrap().to_string().contains("65 input bytes"));
        let mut bad = saved;
        bad.version = 9;
        assert!(matches!(
            Serial::restore(sink(&evt), &bad),
            Err(StateError::Version { found: 9, .. })
        ));
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
