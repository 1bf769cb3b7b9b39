//! Turning an unpacked OCI root into a Sprout base image: Sprout's init and
//! agent are added (with a static busybox of their own under `/.sprout`, so
//! they need nothing from the image), then `mkfs.ext4 -d` makes the
//! read-only ext4 every sandbox of that image shares.

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};

use super::unpack::resolve;
use super::OciError;

/// Sprout's root set-up script (guest/images/sprout-init), made to run on
/// its own busybox: `/.sprout/bin` comes last in its PATH, so the image's
/// own tools win and busybox fills in what the image lacks.
const INIT: &str = include_str!("../../../guest/images/sprout-init");
/// Applets the init script uses.
const APPLETS: [&str; 6] = ["sh", "mount", "umount", "mkdir", "cat", "pivot_root"];
/// Bumped when what this module adds to an image changes.
const LAYOUT_VERSION: &str = "sprout-oci-1";

/// What Sprout adds to every OCI image, found on this host.
pub struct SproutFiles {
    pub agent: PathBuf,
    pub busybox: PathBuf,
}

impl SproutFiles {
    /// The static agent guest/build-images.sh built (`SPROUT_AGENT`
    /// overrides), and Debian's static busybox.
    pub fn locate(cache_dir: &Path) -> Result<SproutFiles, OciError> {
        let agent = std::env::var_os("SPROUT_AGENT")
            .map(PathBuf::from)
            .unwrap_or_else(|| cache_dir.join("images/.sprout-agent.stripped"));
        if !agent.is_file() {
            return Err(OciError::Setup(format!(
                "the guest agent is not built at {} (guest/build-images.sh test builds it; \
                 ./serve and ./test run that)",
                agent.display()
            )));
        }
        let busybox = std::env::var_os("SPROUT_BUSYBOX")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/bin/busybox"));
        if !is_static_elf(&busybox) {
            return Err(OciError::Setup(format!(
                "a static busybox is needed at {} (Debian: apt-get install busybox-static)",
                busybox.display()
            )));
        }
        Ok(SproutFiles { agent, busybox })
    }

    /// A short hash of everything added, so an image is rebuilt (from its
    /// cached blobs) when the agent or the init changes.
    pub fn key(&self) -> Result<String, OciError> {
        let mut h = Sha256::new();
        h.update(LAYOUT_VERSION);
        h.update(init_script());
        for p in [&self.agent, &self.busybox] {
            let mut f = std::fs::File::open(p).map_err(|e| OciError::io("open", p, e))?;
            let mut buf = vec![0u8; 1 << 20];
            loop {
                let n = f.read(&mut buf).map_err(|e| OciError::io("read", p, e))?;
                if n == 0 {
                    break;
                }
                h.update(&buf[..n]);
            }
        }
        Ok(format!("{:x}", h.finalize())[..16].to_owned())
    }

    /// Adds Sprout's files to the unpacked root `root`.
    pub fn add_to(&self, root: &Path) -> Result<(), OciError> {
        for (dir, mode) in [
            ("dev", 0o755),
            ("proc", 0o555),
            ("sys", 0o555),
            ("tmp", 0o1777),
            ("run", 0o755),
            ("mnt", 0o755),
            ("root", 0o700),
            ("workspace", 0o755),
            ("sbin", 0o755),
            ("etc", 0o755),
        ] {
            let p = resolve(root, &[dir.into()], true)?;
            if !p.is_dir() {
                if std::fs::symlink_metadata(&p).is_ok() {
                    std::fs::remove_file(&p).map_err(|e| OciError::io("remove", &p, e))?;
                }
                std::fs::create_dir_all(&p).map_err(|e| OciError::io("create", &p, e))?;
                set_mode(&p, mode)?;
            }
        }
        let bin = root.join(".sprout/bin");
        let _ = std::fs::remove_dir_all(root.join(".sprout"));
        std::fs::create_dir_all(&bin).map_err(|e| OciError::io("create", &bin, e))?;
        install(&self.busybox, &bin.join("busybox"))?;
        for a in APPLETS {
            let p = bin.join(a);
            std::os::unix::fs::symlink("busybox", &p)
                .map_err(|e| OciError::io("symlink", &p, e))?;
        }
        let sbin = resolve(root, &["sbin".into()], true)?;
        let init = sbin.join("sprout-init");
        let _ = std::fs::remove_file(&init);
        std::fs::write(&init, init_script()).map_err(|e| OciError::io("write", &init, e))?;
        set_mode(&init, 0o755)?;
        install(&self.agent, &sbin.join("sprout-agent"))?;
        Ok(())
    }
}

/// The init script for OCI images (see [`INIT`]).
fn init_script() -> String {
    let mut s = INIT.replacen("#!/bin/sh", "#!/.sprout/bin/sh", 1);
    s = s.replacen(
        "PATH=/usr/sbin:/usr/bin:/sbin:/bin\n",
        "PATH=/usr/sbin:/usr/bin:/sbin:/bin:/.sprout/bin\n",
        1,
    );
    s
}

fn set_mode(p: &Path, mode: u32) -> Result<(), OciError> {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))
        .map_err(|e| OciError::io("chmod", p, e))
}

fn install(src: &Path, dst: &Path) -> Result<(), OciError> {
    let _ = std::fs::remove_file(dst);
    std::fs::copy(src, dst).map_err(|e| OciError::io("copy", src, e))?;
    let _ = std::os::unix::fs::lchown(dst, Some(0), Some(0));
    set_mode(dst, 0o755)
}

/// Whether `p` is an ELF executable with no program interpreter.
fn is_static_elf(p: &Path) -> bool {
    let Ok(data) = std::fs::read(p) else {
        return false;
    };
    let u16_at = |o: usize| data.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32_at = |o: usize| {
        data.get(o..o + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let u64_at = |o: usize| {
        data.get(o..o + 8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
    };
    if data.get(..5) != Some(b"\x7fELF\x02") {
        return false;
    }
    let (Some(phoff), Some(phentsize), Some(phnum)) = (u64_at(0x20), u16_at(0x36), u16_at(0x38))
    else {
        return false;
    };
    (0..usize::from(phnum)).all(|i| {
        let o = phoff as usize + i * usize::from(phentsize);
        u32_at(o).is_some_and(|t| t != 3) // PT_INTERP
    })
}

/// Size of what `mkfs.ext4 -d root` must hold: (bytes in whole blocks, inodes).
fn measure(root: &Path) -> Result<(u64, u64), OciError> {
    let mut bytes = 0u64;
    let mut inodes = 0u64;
    let mut todo = vec![root.to_owned()];
    while let Some(d) = todo.pop() {
        let rd = std::fs::read_dir(&d).map_err(|e| OciError::io("list", &d, e))?;
        for e in rd {
            let e = e.map_err(|e| OciError::io("list", &d, e))?;
            let m = e
                .metadata()
                .map_err(|err| OciError::io("stat", &e.path(), err))?;
            inodes += 1;
            bytes += m.len().div_ceil(4096) * 4096 + 4096;
            if m.is_dir() {
                todo.push(e.path());
            }
        }
    }
    Ok((bytes, inodes))
}

/// `mkfs.ext4 -d root out`, sized for what `root` holds with room to spare.
pub fn make_ext4(root: &Path, out: &Path) -> Result<u64, OciError> {
    let (bytes, inodes) = measure(root)?;
    let kib = bytes / 1024;
    let size_kib = kib + kib / 4 + 16384;
    let inodes = inodes + inodes / 4 + 1024;
    let o = std::process::Command::new("mkfs.ext4")
        .args([
            "-q",
            "-F",
            "-L",
            "sprout-oci",
            "-O",
            "^has_journal",
            "-m",
            "0",
        ])
        .arg("-N")
        .arg(inodes.to_string())
        .args(["-E", "root_owner=0:0", "-d"])
        .arg(root)
        .arg(out)
        .arg(format!("{size_kib}k"))
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                OciError::Setup("mkfs.ext4 is missing (Debian: apt-get install e2fsprogs)".into())
            }
            _ => OciError::io("run mkfs.ext4 for", out, e),
        })?;
    if !o.status.success() {
        return Err(OciError::Build(format!(
            "mkfs.ext4 failed ({}): {}",
            o.status,
            String::from_utf8_lossy(&o.stderr).trim()
        )));
    }
    Ok(size_kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_init_script_runs_on_sprouts_own_busybox_and_prefers_the_images_tools() {
        let s = init_script();
        assert!(s.starts_with("#!/.sprout/bin/sh\n"), "{}", &s[..40]);
        assert!(s.contains("\nPATH=/usr/sbin:/usr/bin:/sbin:/bin:/.sprout/bin\n"));
    }

    #[test]
    fn a_static_busybox_is_told_from_a_dynamic_binary() {
        if Path::new("/bin/busybox").exists() {
            assert!(is_static_elf(Path::new("/bin/busybox")));
        }
        assert!(!is_static_elf(Path::new("/bin/ls")), "/bin/ls is dynamic");
        assert!(!is_static_elf(Path::new("/etc/passwd")));
    }
}
