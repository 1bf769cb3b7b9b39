//! The Sprout service crate: the `sprout` CLI and its VM control socket today;
//! `sproutd`, the REST service, joins it later.

pub mod agent;
pub mod api_sock;
pub mod linux;
