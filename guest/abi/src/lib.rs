//! What the VMM and the guests it boots agree on, with no dependencies so the
//! `no_std` test guest can use it too.
//!
//! * [`layout`]: every guest physical address and interrupt line the VMM uses.
//! * [`mailbox`]: the command mailbox the host drives the test guest with.
#![no_std]

pub mod layout;
pub mod mailbox;
