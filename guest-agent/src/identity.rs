//! Identity refresh: after a restore or fork the guest takes a new instance id, the
//! host's wall-clock time and fresh entropy.
//!
//! It sets the clock, credits the entropy and reseeds the kernel CRNG, sets the hostname
//! and writes `/etc/machine-id` (which [`ensure_machine_id`] gave the machine when
//! it booted): a new random one, or the host's id for the machine
//! ([`refresh_as`]). It changes the machine it runs on, so the agent
//! serves it only when started with `--allow-identity` (as PID 1 starts it in a VM) and
//! it is tested in a VM only.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::sync::{Mutex, OnceLock};

use rustix::rand::{getrandom, GetRandomFlags};
use rustix::time::{clock_settime, ClockId, Timespec};

use crate::protocol::{Identity, IdentityDone, IDENTITY_ENTROPY_LEN};
use crate::sys;

const MACHINE_ID: &str = "/etc/machine-id";
const RANDOM_DEVICE: &str = "/dev/urandom";
/// Longest hostname Linux takes.
const MAX_HOSTNAME: usize = 64;

/// `/dev/urandom` open for writing, from [`prepare`] on. Opening it is a
/// path walk and a device open over kernel memory that a restored guest has
/// not touched yet: ~4 ms of a ~16 ms refresh where guest kernel code is
/// emulated (the lab), paid again after every restore. (Part of that cost
/// moves to the next path walk, the machine id's.)
static RANDOM: OnceLock<File> = OnceLock::new();

/// `/etc/machine-id` open for writing, from [`hold_machine_id`] on, while it
/// is still the file at that path (see [`write_held`]). The path walk and
/// open were about a third of the ~7.5 ms the id write took in a lab refresh;
/// the rest (~4.8 ms) is ext4's write path, journal and all, on kernel memory
/// a restored guest touches for the first time.
static HELD_ID: Mutex<Option<File>> = Mutex::new(None);

/// Opens ahead of time what a refresh writes to, so that the refresh after a
/// restore does not: the agent calls it when it starts in a VM, and the open
/// file is in every snapshot taken after. A refresh opens what is missing.
pub fn prepare() {
    if RANDOM.get().is_none() {
        match OpenOptions::new().write(true).open(RANDOM_DEVICE) {
            Ok(f) => {
                let _ = RANDOM.set(f);
            }
            Err(e) => log::warn!("cannot open {RANDOM_DEVICE} ahead of a refresh: {e}"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("Instance id {0:?} is invalid: use 1 to 64 characters of [A-Za-z0-9-]")]
    InstanceId(String),
    #[error("Identity entropy is {0} bytes, exactly 64 are needed")]
    Entropy(usize),
    #[error("Hostname {0:?} is invalid: use 1 to 64 characters of [A-Za-z0-9.-]")]
    Hostname(String),
    #[error("Machine id {0:?} is invalid: use 32 lowercase hex digits, not all zero")]
    MachineId(String),
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
/// answer rather than stopping the rest. The machine gets a new random id.
pub fn refresh(req: &Identity) -> Result<IdentityDone, IdentityError> {
    refresh_as(req, None)
}

/// [`refresh`], giving the machine the id `machine_id` (the host's for it:
/// [`IdentityAs`](crate::protocol::IdentityAs)) when there is one.
pub fn refresh_as(req: &Identity, machine_id: Option<&str>) -> Result<IdentityDone, IdentityError> {
    validate(req)?;
    if let Some(id) = machine_id {
        if !is_machine_id(format!("{id}\n").as_bytes()) {
            return Err(IdentityError::MachineId(id.to_owned()));
        }
    }
    let mut done = IdentityDone::default();

    let ts = Timespec {
        tv_sec: (req.unix_time_ns / 1_000_000_000) as i64,
        tv_nsec: (req.unix_time_ns % 1_000_000_000) as _,
    };
    match clock_settime(ClockId::Realtime, ts) {
        Ok(()) => done.clock_set = true,
        Err(e) => done.errors.push(format!("Cannot set the clock: {e}")),
    }

    match RANDOM.get() {
        Some(random) => reseed(random, &req.entropy, &mut done),
        None => match OpenOptions::new().write(true).open(RANDOM_DEVICE) {
            Ok(random) => reseed(&random, &req.entropy, &mut done),
            Err(e) => done
                .errors
                .push(format!("Cannot open {RANDOM_DEVICE}: {e}")),
        },
    }

    let hostname = req.hostname.as_deref().unwrap_or(&req.instance_id);
    match rustix::system::sethostname(hostname.as_bytes()) {
        Ok(()) => done.hostname = Some(hostname.to_owned()),
        Err(e) => done.errors.push(format!("Cannot set the hostname: {e}")),
    }

    // Drawn after the reseed, when it is new.
    let id = match machine_id {
        Some(id) => Ok(id.to_owned()),
        None => new_machine_id(),
    };
    match id.and_then(|id| write_held(&HELD_ID, Path::new(MACHINE_ID), &id).map(|()| id)) {
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

/// Gives `path` the id `id` (and a newline).
///
/// An id file already there of that length is overwritten in place: after a
/// restore that is a page the guest already holds, where creating a new file
/// and renaming it over the old one allocates an inode and reads metadata from
/// the writable disk (27-137 ms of a 50-190 ms refresh in the lab, against
/// about 1 ms in place). It also keeps an id that is a bind mount or a
/// symbolic link (systemd's `/run/machine-id`) working, where a rename fails or
/// replaces the link. Anything else is replaced whole by a rename.
fn write_machine_id(path: &Path, id: &str) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let line = format!("{id}\n");
    if let Some(f) = same_size_file(path, line.len()) {
        return f.write_all_at(line.as_bytes(), 0);
    }
    let tmp = path.with_extension("sprout-tmp");
    std::fs::write(&tmp, &line)?;
    std::fs::rename(&tmp, path)
}

/// Holds the machine id file open for the next refresh (after
/// [`ensure_machine_id`] gave the machine one), as [`prepare`] does
/// `/dev/urandom`.
pub fn hold_machine_id() {
    let mut held = HELD_ID.lock().unwrap_or_else(|e| e.into_inner());
    *held = same_size_file(Path::new(MACHINE_ID), MACHINE_ID_LINE);
}

/// Length of a machine id file: 32 hex digits and a newline.
const MACHINE_ID_LINE: usize = 33;

/// [`write_machine_id`] through the file `held` keeps open while it is still
/// the id file: a regular file of an id's length that has a name (replaced by
/// a rename, it has none; a link or bind mount to it is still it). Else the id
/// goes to `path` and its file is held from then on.
fn write_held(held: &Mutex<Option<File>>, path: &Path, id: &str) -> std::io::Result<()> {
    use std::os::unix::fs::{FileExt, MetadataExt};
    let line = format!("{id}\n");
    let mut held = held.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(f) = held.as_ref() {
        let same = f
            .metadata()
            .is_ok_and(|m| m.is_file() && m.nlink() > 0 && m.len() == line.len() as u64);
        if same {
            return f.write_all_at(line.as_bytes(), 0);
        }
    }
    *held = None;
    write_machine_id(path, id)?;
    *held = same_size_file(path, line.len());
    Ok(())
}

/// `path` open for writing if it is a regular file of `len` bytes. Never
/// creates it, and does not block on a FIFO someone put there.
fn same_size_file(path: &Path, len: usize) -> Option<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    let m = f.metadata().ok()?;
    (m.is_file() && m.len() == len as u64).then_some(f)
}

/// Whether `text` is a machine id as `machine-id(5)` has it: 32 lowercase hex
/// digits and a newline, not all zero.
fn is_machine_id(text: &[u8]) -> bool {
    text.len() == MACHINE_ID_LINE
        && text[32] == b'\n'
        && text[..32]
            .iter()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
        && text[..32].iter().any(|&b| b != b'0')
}

/// Gives a booted machine an id of its own unless it has one: Debian's images
/// ship none or `uninitialized`, and every VM booted from one image would
/// share whatever the image has. A valid id is kept, as systemd keeps it
/// across reboots. Run by the agent in a VM when it starts; a refresh after a
/// restore then overwrites this file in place (see [`write_machine_id`]).
pub fn ensure_machine_id(path: &Path) -> std::io::Result<Option<String>> {
    use std::io::Read;
    let mut head = Vec::with_capacity(34);
    if let Ok(f) = File::open(path) {
        f.take(34).read_to_end(&mut head)?;
    }
    if is_machine_id(&head) {
        return Ok(None);
    }
    let id = new_machine_id()?;
    write_machine_id(path, &id)?;
    Ok(Some(id))
}

/// Where [`refresh`] and [`ensure_machine_id`] keep the id in a VM.
pub fn machine_id_path() -> &'static Path {
    Path::new(MACHINE_ID)
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

    /// The host's machine id is checked before anything changes.
    #[test]
    fn a_given_machine_id_must_be_one() {
        for bad in [
            "",
            "0123456789abcdef0123456789abcde",
            "0123456789ABCDEF0123456789ABCDEF",
            "00000000000000000000000000000000",
            "0123456789abcdef0123456789abcdef\n",
            "0123456789abcdef0123456789abcdeg",
        ] {
            assert!(
                matches!(
                    refresh_as(&req(), Some(bad)),
                    Err(IdentityError::MachineId(_))
                ),
                "{bad:?}"
            );
        }
        let mut r = req();
        r.entropy = Bytes::from(vec![0; 1]);
        // The request itself is checked first.
        assert!(matches!(
            refresh_as(&r, Some("bad")),
            Err(IdentityError::Entropy(1))
        ));
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

    #[test]
    fn an_id_of_the_same_length_is_overwritten_in_place() {
        use std::os::unix::fs::MetadataExt;
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("machine-id");
        let first = new_machine_id().unwrap();
        write_machine_id(&p, &first).unwrap();
        let inode = std::fs::metadata(&p).unwrap().ino();
        // A link to it (as systemd's /etc/machine-id -> /run/machine-id) stays one.
        let link = t.path().join("link");
        std::os::unix::fs::symlink(&p, &link).unwrap();
        let second = new_machine_id().unwrap();
        assert_ne!(first, second);
        write_machine_id(&link, &second).unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), format!("{second}\n"));
        assert_eq!(std::fs::metadata(&p).unwrap().ino(), inode);
        assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());
        // A FIFO in its place is replaced, without blocking on it.
        let fifo = t.path().join("fifo-id");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o644),
            0,
        )
        .unwrap();
        write_machine_id(&fifo, &second).unwrap();
        assert_eq!(
            std::fs::read_to_string(&fifo).unwrap(),
            format!("{second}\n")
        );
    }

    /// The held file is written while it is still the id file; once replaced
    /// (renamed over, or of another length) the id goes to the path, whose
    /// file is held from then on.
    #[test]
    fn the_held_id_file_is_written_only_while_it_is_the_id_file() {
        use std::os::unix::fs::MetadataExt;
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("machine-id");
        let held = Mutex::new(None);
        let ids: Vec<String> = (0..5).map(|_| new_machine_id().unwrap()).collect();
        // Nothing held yet: written by path, then held.
        write_held(&held, &p, &ids[0]).unwrap();
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            format!("{}\n", ids[0])
        );
        assert!(held.lock().unwrap().is_some());
        // Held: written in place, through the open file.
        let inode = std::fs::metadata(&p).unwrap().ino();
        write_held(&held, &p, &ids[1]).unwrap();
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            format!("{}\n", ids[1])
        );
        assert_eq!(std::fs::metadata(&p).unwrap().ino(), inode);
        // Renamed over (as systemd-machine-id-setup would): the held file has
        // no name left, so the new one at the path gets the id.
        let other = t.path().join("other");
        std::fs::write(&other, format!("{}\n", "1".repeat(32))).unwrap();
        std::fs::rename(&other, &p).unwrap();
        write_held(&held, &p, &ids[2]).unwrap();
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            format!("{}\n", ids[2])
        );
        assert_ne!(std::fs::metadata(&p).unwrap().ino(), inode);
        // ... and is held from then on.
        let inode = std::fs::metadata(&p).unwrap().ino();
        write_held(&held, &p, &ids[3]).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().ino(), inode);
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            format!("{}\n", ids[3])
        );
        // Truncated in place: not an id file's length, replaced whole.
        std::fs::write(&p, "uninitialized\n").unwrap();
        write_held(&held, &p, &ids[4]).unwrap();
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            format!("{}\n", ids[4])
        );
        assert_eq!(std::fs::read_dir(t.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_booted_machine_gets_an_id_unless_it_has_a_valid_one() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("machine-id");
        // None, Debian's placeholder, an empty file, all zeros, upper case.
        for before in [
            None,
            Some("uninitialized\n"),
            Some(""),
            Some(&*format!("{}\n", "0".repeat(32))),
            Some(&*format!("{}\n", "A".repeat(32))),
        ] {
            match before {
                None => drop(std::fs::remove_file(&p)),
                Some(b) => std::fs::write(&p, b).unwrap(),
            }
            let id = ensure_machine_id(&p).unwrap().expect("a new id");
            assert_eq!(std::fs::read_to_string(&p).unwrap(), format!("{id}\n"));
            assert!(is_machine_id(format!("{id}\n").as_bytes()));
        }
        // A valid one is kept.
        let kept = std::fs::read_to_string(&p).unwrap();
        assert_eq!(ensure_machine_id(&p).unwrap(), None);
        assert_eq!(std::fs::read_to_string(&p).unwrap(), kept);
    }
}
