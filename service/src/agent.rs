//! The host's side of a Linux guest's agent, as the CLI (and later the
//! service) uses it: waiting for the agent, re-identifying a restored or forked
//! guest, running a command with its output streamed, and moving files.
//!
//! Everything here is async on the caller's runtime; the VM's own threads are
//! never blocked by it.

use std::io::Write as _;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use guest_agent::client::{Client, ClientConfig, ClientError, Endpoint, ExecEvent, WriteOptions};
use guest_agent::protocol::{
    Bytes, Exec, FileKind, Identity, IdentityDone, DEFAULT_VSOCK_PORT, IDENTITY_ENTROPY_LEN,
};
use vmm::vcpu::ExitSignal;
use vmm::ExitReason;

/// How often the agent is pinged while the guest boots or resumes.
const POLL: Duration = Duration::from_millis(20);

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("The agent did not answer within {0:?} (last error: {1})")]
    Timeout(Duration, String),
    #[error("The VM ended ({0}) before its agent answered")]
    Ended(ExitReason),
    #[error("The agent refused the identity refresh: {0}")]
    Identity(String),
    #[error("Cannot read the host's entropy: {0}")]
    Entropy(std::io::Error),
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("{0}")]
    File(String),
}

/// A client for the agent behind a VM's vsock socket `uds` (port 1024).
pub fn client(uds: &Path) -> Client {
    Client::new(
        Endpoint::Vsock {
            uds_path: uds.to_owned(),
            port: DEFAULT_VSOCK_PORT,
        },
        ClientConfig {
            connect_timeout: Duration::from_secs(2),
            ..ClientConfig::default()
        },
    )
}

/// Waits until the agent answers (how long that took, and with `refresh` the
/// refresh's report), the VM ends, or `limit` passes.
///
/// Without `refresh` the agent is pinged. With it (a restored or forked guest,
/// whose agent is already up) the identity refresh is itself the probe: one
/// round trip to the guest instead of a ping's and then the refresh's, each
/// attempt with the clock read as it is sent. A refresh the agent answers but
/// refuses (or that did not set the clock or reseed the CRNG) is an error, not
/// retried.
pub async fn wait_ready(
    client: &Client,
    exit: &ExitSignal,
    limit: Duration,
    refresh: Option<&Refresh>,
) -> Result<(Duration, Option<IdentityDone>), AgentError> {
    let t = Instant::now();
    loop {
        if let Some(r) = exit.get() {
            return Err(AgentError::Ended(r));
        }
        match probe(client, refresh).await {
            Ok(done) => return Ok((t.elapsed(), done)),
            Err(Probe::Refused(e)) => return Err(e),
            Err(Probe::Unreachable(e)) if t.elapsed() > limit => {
                return Err(AgentError::Timeout(limit, e.to_string()))
            }
            Err(Probe::Unreachable(_)) => tokio::time::sleep(POLL).await,
        }
    }
}

/// A new identity for a restored or forked guest: [`fresh_identity`] of
/// `instance_id`, with `hostname` as its host name if given.
#[derive(Clone, Debug)]
pub struct Refresh {
    pub instance_id: u64,
    pub hostname: Option<String>,
    /// The machine id to give the guest (the host's id of the machine it
    /// is: kept across its own restores); none for a new random one. An
    /// agent that cannot take one is given a random one.
    pub machine_id: Option<String>,
}

/// Why one [`probe`] did not succeed.
#[derive(Debug)]
pub enum Probe {
    /// No answer (the agent is not up yet, or the connection failed): try again.
    Unreachable(ClientError),
    /// The agent answered, with a refusal: trying again will not help.
    Refused(AgentError),
}

/// One attempt at the agent: a ping, or with `refresh` the identity refresh
/// (see [`wait_ready`]).
pub async fn probe(
    client: &Client,
    refresh: Option<&Refresh>,
) -> Result<Option<IdentityDone>, Probe> {
    let Some(r) = refresh else {
        return match client.ping().await {
            Ok(_) => Ok(None),
            Err(e) => Err(Probe::Unreachable(e)),
        };
    };
    let mut ident = fresh_identity(r.instance_id).map_err(Probe::Refused)?;
    ident.hostname = r.hostname.clone();
    let answer = match &r.machine_id {
        Some(id) => match client.identity_refresh_as(ident.clone(), id).await {
            // An agent from before `IdentityAs` (a guest image or a sleeping
            // sandbox older than this host): the plain refresh.
            Err(ClientError::Agent {
                code: guest_agent::protocol::ErrorCode::UnknownKind,
                ..
            }) => client.identity_refresh(ident).await,
            r => r,
        },
        None => client.identity_refresh(ident).await,
    };
    match answer {
        Ok(done) => check_refresh(done).map(Some).map_err(Probe::Refused),
        Err(e @ ClientError::Agent { .. }) => Err(Probe::Refused(e.into())),
        Err(e) => Err(Probe::Unreachable(e)),
    }
}

/// The guest's instance id (and host name) for the VMM's process-local
/// `instance_id`: `sprout-<pid>-<id>` in hex, unique on the host while this
/// process lives (restores of one snapshot in two processes differ).
pub fn instance_name(instance_id: u64) -> String {
    format!("sprout-{:x}-{instance_id:x}", std::process::id())
}

/// A fresh identity: `instance_id`'s name, the host's wall clock now and 64
/// bytes from the host's CSPRNG.
pub fn fresh_identity(instance_id: u64) -> Result<Identity, AgentError> {
    let mut entropy = vec![0u8; IDENTITY_ENTROPY_LEN];
    rustix::rand::getrandom(&mut entropy, rustix::rand::GetRandomFlags::empty())
        .map_err(|e| AgentError::Entropy(e.into()))?;
    Ok(Identity {
        instance_id: instance_name(instance_id),
        unix_time_ns: now_ns(),
        entropy: Bytes::from(entropy),
        hostname: None,
    })
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// What a refresh did, if it did what a restored guest needs: the clock set
/// and the CRNG reseeded (a guest that shares its random state with a sibling
/// is not usable); the steps it could not do are logged.
pub fn check_refresh(done: IdentityDone) -> Result<IdentityDone, AgentError> {
    if !(done.clock_set && done.entropy_added && done.crng_reseeded) {
        return Err(AgentError::Identity(done.errors.join("; ")));
    }
    for e in &done.errors {
        log::warn!("identity refresh: {e}");
    }
    Ok(done)
}

/// Runs `cmd` with `/bin/sh -c` in the guest, writing its output to this
/// process's stdout and stderr as it arrives; its exit status (128 + signal if
/// a signal ended it).
pub async fn exec_streamed(client: &Client, cmd: &str) -> Result<u8, AgentError> {
    let req = Exec {
        command: cmd.to_owned(),
        shell: true,
        ..Exec::default()
    };
    let mut s = client.exec(req).await?;
    let (mut out, mut err) = (std::io::stdout(), std::io::stderr());
    loop {
        match s.next_event().await? {
            Some(ExecEvent::Stdout(d)) => {
                let _ = out.write_all(&d).and_then(|()| out.flush());
            }
            Some(ExecEvent::Stderr(d)) => {
                let _ = err.write_all(&d).and_then(|()| err.flush());
            }
            Some(ExecEvent::Exit(e)) => {
                return Ok(match (e.code, e.signal) {
                    (Some(c), _) => c.clamp(0, 255) as u8,
                    (None, Some(sig)) => 128u8.saturating_add(sig.clamp(0, 127) as u8),
                    (None, None) => 1,
                });
            }
            None => return Err(AgentError::Client(ClientError::Disconnected)),
        }
    }
}

/// A `--put LOCAL:REMOTE` or `--get REMOTE:LOCAL` pair, split at the first `:`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transfer {
    pub from: String,
    pub to: String,
}

impl std::str::FromStr for Transfer {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once(':') {
            Some((a, b)) if !a.is_empty() && !b.is_empty() => Ok(Self {
                from: a.to_owned(),
                to: b.to_owned(),
            }),
            _ => Err(format!("{s:?} is not SOURCE:DESTINATION")),
        }
    }
}

/// Copies the host file `local` to `remote` in the guest (relative to, or
/// beneath, /workspace), streaming it; the bytes copied.
pub async fn put(client: &Client, local: &str, remote: &str) -> Result<u64, AgentError> {
    let mut f = tokio::fs::File::open(local)
        .await
        .map_err(|e| AgentError::File(format!("Cannot open {local}: {e}")))?;
    let n = client
        .write_file(remote, WriteOptions::default(), &mut f)
        .await
        .map_err(|e| AgentError::File(format!("Cannot write {remote} in the guest: {e}")))?;
    Ok(n)
}

/// Most bytes `--get` copies from the guest into one host file.
pub const MAX_GET_BYTES: u64 = 4 << 30;

/// Copies `remote` in the guest to the host file `local` (created or
/// truncated), streaming it; the bytes copied. At most the size the guest
/// announces for the file, and at most [`MAX_GET_BYTES`] (see [`get_bounded`]).
pub async fn get(client: &Client, remote: &str, local: &str) -> Result<u64, AgentError> {
    get_bounded(client, remote, local, MAX_GET_BYTES).await
}

/// Like [`get`] with a byte limit of `max`. The guest first announces the
/// file's size (a stat); a file over `max`, or a guest that then sends more
/// than it announced, fails the copy, and nothing past the bound is written.
/// A failed copy removes `local`.
pub async fn get_bounded(
    client: &Client,
    remote: &str,
    local: &str,
    max: u64,
) -> Result<u64, AgentError> {
    let cannot =
        |e: ClientError| AgentError::File(format!("Cannot read {remote} from the guest: {e}"));
    // The stat does not follow a final symlink; the read does. A symlink's
    // announced size is its target's name, so it is not a bound: use `max`.
    let info = client.stat(remote).await.map_err(cannot)?;
    let bound = match info.kind {
        FileKind::File if info.size > max => {
            return Err(cannot(ClientError::TooLarge {
                what: "the file",
                limit: max,
            }))
        }
        FileKind::File => info.size,
        _ => max,
    };
    let mut f = tokio::fs::File::create(local)
        .await
        .map_err(|e| AgentError::File(format!("Cannot create {local}: {e}")))?;
    match client.download(remote, &mut f, bound).await {
        Ok(n) => {
            f.sync_all()
                .await
                .map_err(|e| AgentError::File(format!("Cannot write {local}: {e}")))?;
            Ok(n)
        }
        Err(e) => {
            drop(f);
            let _ = tokio::fs::remove_file(local).await;
            Err(cannot(e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfers_parse() {
        let t: Transfer = "a.txt:/workspace/b.txt".parse().unwrap();
        assert_eq!(t.from, "a.txt");
        assert_eq!(t.to, "/workspace/b.txt");
        let t: Transfer = "x:y:z".parse().unwrap();
        assert_eq!((t.from.as_str(), t.to.as_str()), ("x", "y:z"));
        for bad in ["", "a", ":b", "a:"] {
            assert!(bad.parse::<Transfer>().is_err(), "{bad:?}");
        }
    }

    /// A fake agent on a Unix socket (std, on a thread) that announces 16-byte
    /// files in its stat answers and then sends 2 MiB for any read.
    fn lying_agent(dir: &Path) -> Client {
        use guest_agent::protocol::{
            decode_message, encode, FileInfo, FileKind, Header, Message, ReadData, ReadEnd,
            StatResult, HEADER_LEN, MAX_CHUNK,
        };
        use std::io::Read as _;
        let sock = dir.join("lying.sock");
        let l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { return };
                std::thread::spawn(move || loop {
                    let mut h = [0u8; HEADER_LEN];
                    if s.read_exact(&mut h).is_err() {
                        return;
                    }
                    let hdr = Header::parse(&h).unwrap();
                    let mut p = vec![0u8; hdr.len as usize];
                    s.read_exact(&mut p).unwrap();
                    let answers: Vec<Message> = match decode_message(&hdr, &p).unwrap() {
                        Message::Stat(_) => vec![StatResult {
                            info: FileInfo {
                                name: "f".into(),
                                raw_name: None,
                                kind: FileKind::File,
                                size: 16,
                                mode: 0o644,
                                mtime_sec: 0,
                                mtime_nsec: 0,
                            },
                        }
                        .into()],
                        Message::Read(_) => (0..8)
                            .map(|_| {
                                ReadData {
                                    data: Bytes::from(vec![b'x'; MAX_CHUNK]),
                                }
                                .into()
                            })
                            .chain([ReadEnd {
                                bytes: 8 * MAX_CHUNK as u64,
                                eof: true,
                            }
                            .into()])
                            .collect(),
                        _ => return,
                    };
                    for m in answers {
                        if s.write_all(&encode(hdr.request_id, &m).unwrap()).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Client::new(Endpoint::Unix(sock), ClientConfig::default())
    }

    #[tokio::test]
    async fn get_refuses_more_than_the_guest_announced() {
        let dir = std::env::temp_dir().join(format!("sprout-get-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let client = lying_agent(&dir);
        let local = dir.join("copy");
        let r = get(&client, "f", local.to_str().unwrap()).await;
        let written = std::fs::metadata(&local).map_or(0, |m| m.len());
        let _ = std::fs::remove_dir_all(&dir);
        assert!(written <= 16, "{written} bytes written for a 16-byte file");
        assert!(r.is_err(), "a 2 MiB answer for a 16-byte file was accepted");
    }

    #[test]
    fn identities_differ() {
        let a = fresh_identity(7).unwrap();
        let b = fresh_identity(7).unwrap();
        assert_eq!(a.instance_id, format!("sprout-{:x}-7", std::process::id()));
        guest_agent::identity::validate(&a).unwrap();
        assert_ne!(a.entropy, b.entropy);
        let now = now_ns();
        assert!(now >= a.unix_time_ns && now - a.unix_time_ns < 10_000_000_000);
    }
}
