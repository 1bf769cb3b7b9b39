//! The Sprout service crate: the `sprout` CLI, which drives VMs through the
//! worker protocol (`control`), today;
//! `sproutd`, the REST service, joins it later.

pub mod agent;
pub mod control;
pub mod linux;
