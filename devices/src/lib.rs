//! Devices of the Sprout VMM: the bus they sit on, legacy devices (serial, i8042)
//! and virtio devices over the virtio-mmio transport.
//!
//! Every value a guest writes (registers, descriptor chains, packets) is hostile:
//! a bad one fails that request or marks the device as needing reset, never panics.

pub mod bus;
pub mod legacy;
pub mod state;
pub mod virtio;

pub use bus::{Bus, BusDevice, BusError};
pub use state::StateError;
