//! The Sprout service crate: the `sprout` CLI, which drives VMs through the
//! worker protocol (`control`), and `sproutd`, the REST service (`daemon`),
//! which the CLI also runs as `sprout daemon`.

pub mod agent;
pub mod cli;
pub mod control;
pub mod daemon;
pub mod linux;
pub mod oci;
