//! The i8042 keyboard controller, only as far as a guest uses it to reset the
//! machine: writing 0xfe (pulse the reset line) to the command port signals the
//! VMM's reset event, which ends the VM.

use serde::{Deserialize, Serialize};
use vmm_sys_util::eventfd::EventFd;

use crate::bus::BusDevice;
use crate::state::{check_version, versions, Persist, StateError};

/// The controller keeps nothing between accesses (no keyboard, output buffer always
/// empty), so its state is only its version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct I8042State {
    pub version: u16,
}

/// Offsets from the data port (0x60): 0 = data, 4 = command/status (0x64).
const OFF_DATA: u64 = 0;
const OFF_COMMAND: u64 = 4;
const CMD_RESET_CPU: u8 = 0xfe;

pub struct I8042 {
    reset_evt: EventFd,
    resets: u64,
}

impl I8042 {
    /// `reset_evt` is written when the guest asks for a reset.
    pub fn new(reset_evt: EventFd) -> Self {
        Self {
            reset_evt,
            resets: 0,
        }
    }

    /// How many resets the guest asked for (since this device was made: a restored
    /// device starts counting again).
    pub fn resets(&self) -> u64 {
        self.resets
    }
}

impl Persist for I8042 {
    type State = I8042State;
    /// The reset eventfd.
    type RestoreArgs = EventFd;

    fn save(&self) -> I8042State {
        I8042State {
            version: versions::I8042,
        }
    }

    /// A controller in `state` that writes `reset_evt` when the guest asks for a reset.
    fn restore(reset_evt: EventFd, state: &I8042State) -> Result<Self, StateError> {
        check_version("i8042", state.version, versions::I8042)?;
        Ok(Self::new(reset_evt))
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        // No keyboard: the output buffer is always empty, status reads 0
        // (nothing to read, input buffer free), data reads 0.
        let _ = offset;
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset == OFF_COMMAND && data.first() == Some(&CMD_RESET_CPU) {
            self.resets += 1;
            if let Err(e) = self.reset_evt.write(1) {
                log::error!("i8042: cannot signal reset: {e}");
            }
        } else if offset != OFF_DATA && offset != OFF_COMMAND {
            log::debug!("i8042: write to unknown offset {offset}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm_sys_util::eventfd::EFD_NONBLOCK;

    #[test]
    fn state_round_trips() {
        let evt = EventFd::new(EFD_NONBLOCK).unwrap();
        let saved = I8042::new(evt.try_clone().unwrap()).save();
        let state = crate::state::postcard_round_trip(&saved);
        assert_eq!(state, saved);
        let mut dev = I8042::restore(evt.try_clone().unwrap(), &state).unwrap();
        dev.write(OFF_COMMAND, &[CMD_RESET_CPU]);
        assert_eq!(evt.read().unwrap(), 1);
        assert!(I8042::restore(evt, &I8042State { version: 0 }).is_err());
    }

    #[test]
    fn reset_command_signals_and_others_do_not() {
        let evt = EventFd::new(EFD_NONBLOCK).unwrap();
        let mut dev = I8042::new(evt.try_clone().unwrap());
        dev.write(OFF_COMMAND, &[0xaa]);
        dev.write(OFF_DATA, &[0xfe]);
        assert!(evt.read().is_err(), "no reset yet");
        dev.write(OFF_COMMAND, &[0xfe]);
        assert_eq!(evt.read().unwrap(), 1);
        assert_eq!(dev.resets(), 1);
        let mut b = [0xffu8; 1];
        dev.read(OFF_COMMAND, &mut b);
        assert_eq!(b[0], 0);
        dev.write(OFF_COMMAND, &[]);
    }
}
