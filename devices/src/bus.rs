//! An address bus: ranges mapped to devices, for port I/O or MMIO exits.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// A device reachable through a [`Bus`]. `offset` is relative to the range base.
pub trait BusDevice: Send {
    fn read(&mut self, offset: u64, data: &mut [u8]);
    fn write(&mut self, offset: u64, data: &[u8]);
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BusError {
    #[error("Bus range {base:#x}+{len:#x} overlaps an existing device")]
    Overlap { base: u64, len: u64 },
    #[error("Bus range {base:#x}+{len:#x} is empty or wraps")]
    BadRange { base: u64, len: u64 },
}

#[derive(Clone)]
struct Entry {
    len: u64,
    dev: Arc<Mutex<dyn BusDevice>>,
}

/// Ranges `[base, base+len)` mapped to devices. Cloning shares the devices.
#[derive(Clone, Default)]
pub struct Bus {
    ranges: BTreeMap<u64, Entry>,
}

impl Bus {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(
        &mut self,
        dev: Arc<Mutex<dyn BusDevice>>,
        base: u64,
        len: u64,
    ) -> Result<(), BusError> {
        let end = base.checked_add(len).filter(|_| len > 0);
        let Some(end) = end else {
            return Err(BusError::BadRange { base, len });
        };
        if let Some((b, e)) = self.ranges.range(..end).next_back() {
            if b + e.len > base {
                return Err(BusError::Overlap { base, len });
            }
        }
        self.ranges.insert(base, Entry { len, dev });
        Ok(())
    }

    fn find(&self, addr: u64) -> Option<(u64, &Entry)> {
        let (base, e) = self.ranges.range(..=addr).next_back()?;
        (addr - base < e.len).then_some((*base, e))
    }

    /// Reads from the device at `addr`. Returns false (data untouched) if none is there.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr) {
            Some((base, e)) => {
                lock(&e.dev).read(addr - base, data);
                true
            }
            None => false,
        }
    }

    /// Writes to the device at `addr`. Returns false if none is there.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr) {
            Some((base, e)) => {
                lock(&e.dev).write(addr - base, data);
                true
            }
            None => false,
        }
    }
}

/// Locks a device mutex; a device that panicked while locked is still usable
/// (its state is whatever it left), so a poisoned lock is taken anyway.
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Reg(u8);
    impl BusDevice for Reg {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data[0] = self.0 + offset as u8;
        }
        fn write(&mut self, _offset: u64, data: &[u8]) {
            self.0 = data[0];
        }
    }

    #[test]
    fn routes_by_range_and_refuses_overlap() {
        let mut bus = Bus::new();
        let d = Arc::new(Mutex::new(Reg(10)));
        bus.insert(d.clone(), 0x100, 0x10).unwrap();
        assert_eq!(
            bus.insert(d.clone(), 0x10f, 1),
            Err(BusError::Overlap {
                base: 0x10f,
                len: 1
            })
        );
        assert_eq!(
            bus.insert(d.clone(), 0xf8, 0x10),
            Err(BusError::Overlap {
                base: 0xf8,
                len: 0x10
            })
        );
        assert!(bus.insert(d.clone(), u64::MAX, 2).is_err());
        assert!(bus.insert(d.clone(), 0x200, 0).is_err());
        bus.insert(d, 0x110, 0x10).unwrap();
        let mut b = [0u8];
        assert!(bus.read(0x103, &mut b));
        assert_eq!(b[0], 13);
        assert!(bus.write(0x100, &[20]));
        assert!(bus.read(0x100, &mut b));
        assert_eq!(b[0], 20);
        assert!(!bus.read(0x120, &mut b));
        assert!(!bus.read(0xff, &mut b));
    }
}
