//! Saving and restoring a [`Net`] device (its queues are the transport's to
//! restore). A frame that waited for a receive buffer is not kept: it is
//! lost as a frame on a wire is, and TCP sends it again.

use serde::{Deserialize, Serialize};

use super::device::Net;
use super::{NetError, Tap};
use crate::state::{check_version, versions, Persist, StateError};
use crate::virtio::{VirtioDevice, VirtioDeviceState};

const WHAT: &str = "virtio-net";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetState {
    pub version: u16,
    pub virtio: VirtioDeviceState,
    pub mac: [u8; 6],
}

/// What a restore chooses again: the TAP (each restored or forked VM has
/// its own), and the MAC its config space shows (none: the saved one; a
/// fork's child gets its own, and its guest is told to take it).
pub struct NetRestoreArgs {
    pub tap: Tap,
    pub mac: Option<[u8; 6]>,
}

impl Persist for Net {
    type State = NetState;
    type RestoreArgs = NetRestoreArgs;

    /// The device's state; call it between event-loop dispatches.
    fn save(&self) -> NetState {
        NetState {
            version: versions::NET,
            virtio: VirtioDeviceState {
                activated: self.is_activated(),
                acked_features: self.acked_features(),
                needs_reset: self.needs_reset(),
            },
            mac: self.mac(),
        }
    }

    /// A new device in `state` on `args.tap`, for the transport's restore to
    /// re-activate with the saved queues (which sets the TAP's offloads).
    fn restore(args: NetRestoreArgs, state: &NetState) -> Result<Self, StateError> {
        check_version(WHAT, state.version, versions::NET)?;
        let mac = args.mac.unwrap_or(state.mac);
        let mut net = Net::new(args.tap, mac).map_err(|e| match e {
            NetError::BadMac(m) => {
                StateError::invalid(WHAT, format!("MAC {m:02x?} is not unicast"))
            }
            e => StateError::rebuild(WHAT, e),
        })?;
        state.virtio.validate(WHAT, net.avail_features())?;
        net.set_restored(state.virtio);
        Ok(net)
    }
}
