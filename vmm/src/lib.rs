//! The Sprout VMM: KVM virtual machines with guest memory, vCPU threads, an
//! event loop for devices, and the x86_64 boot path.
//!
//! The entry point is [`Vm::start`] with a [`VmConfig`]: it validates the
//! config, creates the KVM VM and its memory, loads the kernel, attaches the
//! devices one `attach_*` step at a time, and starts one thread per vCPU plus
//! the device event loop.

pub mod arch;
mod builder;
pub mod config;
mod create;
pub mod event_loop;
pub mod fork;
pub mod inspect;
pub mod kvm;
pub mod lease;
pub mod lineage;
pub mod mailbox;
pub mod memory;
mod options;
mod persist;
mod restore;
pub mod run_state;
pub mod shell;
pub mod vcpu;
pub mod vm;
mod vm_devices;
pub mod vm_state;

/// The guest physical layout: every guest address the VMM uses comes from here.
pub use guest_abi::layout;
pub use snapshot::thread_hook;

pub use config::{ConfigError, DiskConfig, VmConfig, VsockConfig, DEFAULT_VSOCK_CONNECTIONS};
pub use create::minor_faults;
pub use devices::legacy::serial::{ConsoleBuffer, SerialOutput};
pub use fork::{ForkError, ForkLayer, ForkOptions};
pub use inspect::{VcpuRegs, VcpuReport};
pub use lease::{LayerLease, LeaseError};
pub use lineage::{new_instance_id, Lineage, LineageError, MAX_CHAIN_DEPTH};
pub use options::{MemoryBackend, RestoreOptions, SnapshotKind};
pub use persist::{SnapshotError, STAGE_LIMIT};
pub use restore::RestoreError;
pub use run_state::{InvalidState, VmRunState};
pub use shell::{ShellPool, VmShell};
pub use vm::{ExitReason, Vm, VmError};
pub use vm_state::{RecordedImage, StateBlobError, VmState, STATE_VERSION};
