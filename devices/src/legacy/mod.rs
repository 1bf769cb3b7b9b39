//! Legacy PC devices: the 8250 serial port and the i8042 controller (for reset).

pub mod i8042;
pub mod serial;

pub use i8042::{I8042State, I8042};
pub use serial::{Serial, SerialOutput, SerialRestoreArgs, SerialState};
