//! Sprout's guest agent and its host client.
//!
//! - [`protocol`]: the versioned frame format and every message (no I/O runtime);
//! - [`wire`]: reading and writing frames on tokio streams, shared by both sides;
//! - [`client`]: the async host client the VMM and the service use;
//! - [`server`]: the agent proper (exec and files), run by the `sprout-agent` binary;
//! - [`files`]: file operations confined beneath a root directory;
//! - [`identity`]: re-identifying the guest after a restore or fork;
//! - [`init`]: what the agent does first when it is PID 1 in a VM;
//! - [`main_process`]: the main process a `container`-runtime image starts.
//!
//! `docs/protocol.md` describes the protocol, its limits and its errors.

pub mod client;
pub mod files;
pub mod identity;
pub mod init;
pub mod main_process;
pub mod protocol;
pub mod server;
mod sys;
pub mod wire;
