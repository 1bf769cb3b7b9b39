//! Identity refresh: after a restore or fork the guest takes a new instance id, the
//! host's wall-clock time and fresh entropy.
//!
//! It sets the clock, credits the entropy and reseeds the kernel CRNG, sets the hostname
//! and writes a new `/etc/machine-id`: it changes the machine it runs on, so the agent
//! serves it only when started with `--allow-identity` (as PID 1 starts it in a VM) and
//! it is tested in a VM only.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;

use rustix::rand::{getrandom, GetRandomFlags};
use rustix::time::{clock_settime, ClockId, Timespec};

use crate::protocol::{Identity, IdentityDone, IDENTITY_ENTROPY_LEN};
use crate::sys;

const MACHINE_ID: &str = "/etc/machine-id";
const RANDOM_DEVICE: &str = "/dev/urandom";
/// Longest hostname Linux takes.
const MAX_HOSTNAME: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("Instance id {0:?} is invalid: use 1 to 64 characters of [A-Za-z0-9-]")]
    InstanceId(String),
    #[error("Identity entropy is {0} bytes, exactly 64 are needed")]
    Entropy(usize),
    #[error("Hostname {0:?} is invalid: use 1 to 64 characters of [A-Za-z0-9.-]")]
    Hostname(String),
}

fn valid_name(s: &str, extra: &[u8]) -> bool {
    !s.is_empty()
        && s.len() <= MAX_HOSTNAME
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || extra.contains(&b))
}

/// Checks a request without acting on it.
pub fn validate(req: &Identity) -> Result<(), IdentityError> {
    if !valid_name(&req.instance_id, b"") {
        return Err(IdentityError::InstanceId(req.instance_id.clone()));
    }
    if req.entropy.len() != IDENTITY_ENTROPY_LEN {
        return Err(IdentityError::Entropy(req.entropy.len()));
    }
    if let Some(h) = &req.hostname {
        if !valid_name(h, b".") {
            return Err(IdentityError::Hostname(h.clone()));
        }
    }
    Ok(())
}

/// Applies `req` to this machine. Every step is tried; failures are listed in the
/// answer rather than stopping the rest.
pub fn refresh(req: &Identity) -> Result<IdentityDone, IdentityError> {
    validate(req)?;
    let mut done = IdentityDone::default();

    let ts = Timespec {
        tv_sec: (req.unix_time_ns / 1_000_000_000) as i64,
        tv_nsec: (req.unix_time_ns % 1_000_000_000) as _,
    };
    match clock_settime(ClockId::Realtime, ts) {
        Ok(()) => done.clock_set = true,
        Err(e) => done.errors.push(format!("Cannot set the clock: {e}")),
    }

    match OpenOptions::new().write(true).open(RANDOM_DEVICE) {
        Ok(random) => reseed(&random, &req.entropy, &mut done),
        Err(e) => done
            .errors
            .push(format!("Cannot open {RANDOM_DEVICE}: {e}")),
    }

    let hostname = req.hostname.as_deref().unwrap_or(&req.instance_id);
    match rustix::system::sethostname(hostname.as_bytes()) {
        Ok(()) => done.hostname = Some(hostname.to_owned()),
        Err(e) => done.errors.push(format!("Cannot set the hostname: {e}")),
    }

    match new_machine_id().and_then(|id| write_machine_id(Path::new(MACHINE_ID), &id).map(|()| id))
    {
        Ok(id) => done.machine_id = Some(id),
        Err(e) => done.errors.push(format!("Cannot write {MACHINE_ID}: {e}")),
    }
    Ok(done)
}

fn reseed(random: &File, entropy: &[u8], done: &mut IdentityDone) {
    match sys::add_entropy(random, entropy) {
        Ok(()) => done.entropy_added = true,
        Err(e) => {
            // Without CAP_SYS_ADMIN a plain write still mixes the bytes in, uncredited.
            done.errors.push(format!("Cannot credit entropy: {e}"));
            let mut w = random;
            if w.write_all(entropy).is_ok() {
                done.entropy_added = true;
            }
        }
    }
    match sys::reseed_crng(random) {
        Ok(()) => done.crng_reseeded = true,
        Err(e) => done.errors.push(format!("Cannot reseed the CRNG: {e}")),
    }
}

/// 128 random bits as 32 lowercase hex digits, drawn after the reseed.
fn new_machine_id() -> std::io::Result<String> {
    let mut b = [0u8; 16];
    getrandom(&mut b, GetRandomFlags::empty())?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Replaces `path` atomically with `id` and a newline.
fn write_machine_id(path: &Path, id: &str) -> std::io::Result<()> {
    let tmp = path.with_extension("sprout-tmp");
    std::fs::write(&tmp, format!("{id}\n"))?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Bytes;

    fn req() -> Identity {
        Identity {
            instance_id: "vm-1234".into(),
            unix_time_ns: 1,
            entropy: Bytes::from(vec![1; 64]),
            hostname: None,
        }
    }

    // Only validation and the machine-id writer run here: refresh() itself changes the
    // host and is exercised in a VM.
    #[test]
    fn validation() {
        validate(&req()).unwrap();
        let mut r = req();
        r.instance_id = "a b".into();
        assert!(matches!(validate(&r), Err(IdentityError::InstanceId(_))));
        r = req();
        r.instance_id = "x".repeat(65);
        assert!(matches!(validate(&r), Err(IdentityError::InstanceId(_))));
        r = req();
        r.entropy = Bytes::from(vec![0; 63]);
        assert!(matches!(validate(&r), Err(IdentityError::Entropy(63))));
        r = req();
        r.hostname = Some("bad/host".into());
        assert!(matches!(validate(&r), Err(IdentityError::Hostname(_))));
        r.hostname = Some("box.local".into());
        validate(&r).unwrap();
    }

    #[test]
    fn machine_id_is_replaced_whole() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("machine-id");
        std::fs::write(&p, "old\n").unwrap();
        let id = new_machine_id().unwrap();
        assert_eq!(id.len(), 32);
        assert!(id.bytes().all(|b| b.is_ascii_hexdigit()));
        write_machine_id(&p, &id).unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), format!("{id}\n"));
        assert_eq!(std::fs::read_dir(t.path()).unwrap().count(), 1);
    }
}
