//! [`Client::net_configure`]: the guest's network interface, default route
//! and resolver.

use super::{clip, unexpected, Client, ClientError, MAX_AGENT_TEXT};
use crate::protocol::{Message, NetConfigure};

impl Client {
    /// Configures a guest network interface (MAC, IPv4 address, default route,
    /// name servers); the name of the interface configured. Only an agent run
    /// with `--allow-identity` accepts it (else `Forbidden`); a bad request is
    /// `BadRequest`, an interface the guest does not have `NotFound`, a step that
    /// failed `Io`, and an agent that predates it answers `UnknownKind`.
    pub async fn net_configure(&self, req: NetConfigure) -> Result<String, ClientError> {
        match self.unary(req.into()).await? {
            Message::NetConfigured(d) => Ok(clip(d.interface, MAX_AGENT_TEXT)),
            m => Err(unexpected("NetConfigured", m)),
        }
    }
}
