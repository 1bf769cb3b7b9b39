//! Turning an unpacked OCI root into a Sprout base image: Sprout's init and
//! agent are added (with a static busybox of their own under `/.sprout`, so
//! they need nothing from the image), then `mkfs.ext4 -d` makes the
//! read-only ext4 every sandbox of that image shares.

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};

use guest_agent::main_process::{MainProcess, DEFAULT_PATH, SPEC_PATH};

use super::unpack::resolve;
use super::{OciError, RunConfig};

/// Sprout's root set-up script (guest/images/sprout-init), made to run on
/// its own busybox: `/.sprout/bin` comes last in its PATH, so the image's
/// own tools win and busybox fills in what the image lacks.
const INIT: &str = include_str!("../../../guest/images/sprout-init");
/// Applets the init script uses.
const APPLETS: [&str; 6] = ["sh", "mount", "umount", "mkdir", "cat", "pivot_root"];
/// The systemd unit that starts the agent in the `vm` runtime: early (no
/// default dependencies: /proc, /sys and /dev are systemd's own, /workspace
/// was mounted by sprout-init), restarted if it dies.
const AGENT_UNIT_NAME: &str = "sprout-agent.service";
const AGENT_UNIT: &str = "[Unit]
Description=Sprout guest agent (exec and files over vsock)
DefaultDependencies=no
After=systemd-remount-fs.service

[Service]
ExecStart=/sbin/sprout-agent --listen-vsock 1024 --root /workspace --allow-identity
Restart=always
RestartSec=1
Environment=RUST_LOG=info

[Install]
WantedBy=multi-user.target
";
/// Bumped when what this module adds to an image changes.
const LAYOUT_VERSION: &str = "sprout-oci-2";

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

    /// Adds Sprout's files to the unpacked root `root`, with the main
    /// process spec when the image has one.
    pub fn add_to(&self, root: &Path, main: Option<&MainProcess>) -> Result<(), OciError> {
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
        // The `vm` runtime: the image's own init (systemd) is PID 1 and
        // starts the agent as a service; unused by the container runtime.
        let units = resolve(
            root,
            &["etc".into(), "systemd".into(), "system".into()],
            true,
        )?;
        let wants = units.join("multi-user.target.wants");
        std::fs::create_dir_all(&wants).map_err(|e| OciError::io("create", &wants, e))?;
        let unit = units.join(AGENT_UNIT_NAME);
        let _ = std::fs::remove_file(&unit);
        std::fs::write(&unit, AGENT_UNIT).map_err(|e| OciError::io("write", &unit, e))?;
        set_mode(&unit, 0o644)?;
        let link = wants.join(AGENT_UNIT_NAME);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(format!("../{AGENT_UNIT_NAME}"), &link)
            .map_err(|e| OciError::io("symlink", &link, e))?;
        if let Some(m) = main {
            let p = root.join(SPEC_PATH.trim_start_matches('/'));
            std::fs::write(&p, m.to_json()).map_err(|e| OciError::io("write", &p, e))?;
            set_mode(&p, 0o444)?;
        }
        Ok(())
    }
}

/// Whether the image's `/sbin/init` is systemd (followed through its
/// symlinks inside the image): the `vm` runtime needs it, since systemd is
/// what starts the agent there (the unit [`SproutFiles::add_to`] adds).
pub fn init_is_systemd(root: &Path) -> bool {
    let Ok(p) = resolve(root, &["sbin".into(), "init".into()], true) else {
        return false;
    };
    p.file_name().is_some_and(|n| n == "systemd")
        && std::fs::metadata(&p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The main process of image `c` (its entrypoint then its cmd), with its
/// user resolved in the image's own /etc/passwd and /etc/group (as a
/// container runtime would); `None` when the image names no program.
pub fn main_process(root: &Path, c: &RunConfig) -> Result<Option<MainProcess>, OciError> {
    let args: Vec<String> = c.entrypoint.iter().chain(&c.cmd).cloned().collect();
    if args.first().is_none_or(|a| a.is_empty()) {
        return Ok(None);
    }
    let mut env: Vec<(String, String)> = Vec::new();
    for e in &c.env {
        // "NAME=value"; a bare name (no '=') sets nothing, as in Docker.
        if let Some((k, v)) = e.split_once('=') {
            if k.is_empty() || e.contains('\0') {
                return Err(OciError::Unsupported(format!(
                    "the image's environment entry {e:?} is not NAME=value"
                )));
            }
            env.retain(|(old, _)| old != k);
            env.push((k.to_owned(), v.to_owned()));
        }
    }
    let (uid, gid, home) = user_of(root, c.user.as_deref().unwrap_or(""))?;
    for (k, v) in [("PATH", DEFAULT_PATH.to_owned()), ("HOME", home)] {
        if !env.iter().any(|(n, _)| n == k) {
            env.push((k.into(), v));
        }
    }
    let cwd = match c.working_dir.as_deref() {
        Some(w) if w.starts_with('/') => w.to_owned(),
        Some(w) => format!("/{w}"),
        None => "/".to_owned(),
    };
    Ok(Some(MainProcess {
        args,
        env,
        cwd,
        uid,
        gid,
    }))
}

/// `user`, `uid`, `user:group`, `uid:gid` (any mix) as the image's files
/// name them: (uid, gid, home). An empty user is root.
fn user_of(root: &Path, user: &str) -> Result<(u32, u32, String), OciError> {
    let passwd = read_in_root(root, "etc/passwd");
    let group = read_in_root(root, "etc/group");
    // name:x:uid:gid:gecos:home:shell
    let entry = |pred: &dyn Fn(&[&str]) -> bool| -> Option<(u32, u32, String)> {
        passwd.lines().find_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            if f.len() < 6 || !pred(&f) {
                return None;
            }
            Some((f[2].parse().ok()?, f[3].parse().ok()?, f[5].to_owned()))
        })
    };
    let (u, g) = match user.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (user, None),
    };
    let (uid, mut gid, home) = if u.is_empty() {
        (0, 0, "/root".to_owned())
    } else if let Ok(n) = u.parse::<u32>() {
        entry(&|f| f[2] == u).unwrap_or((n, 0, "/".to_owned()))
    } else {
        entry(&|f| f[0] == u).ok_or_else(|| {
            OciError::Unsupported(format!("the image's user {u:?} is not in its /etc/passwd"))
        })?
    };
    if let Some(g) = g.filter(|g| !g.is_empty()) {
        gid = match g.parse::<u32>() {
            Ok(n) => n,
            Err(_) => group
                .lines()
                .find_map(|l| {
                    let f: Vec<&str> = l.split(':').collect();
                    if f.len() < 3 || f[0] != g {
                        return None;
                    }
                    f[2].parse().ok()
                })
                .ok_or_else(|| {
                    OciError::Unsupported(format!(
                        "the image's group {g:?} is not in its /etc/group"
                    ))
                })?,
        };
    }
    Ok((uid, gid, if home.is_empty() { "/".into() } else { home }))
}

/// A small file of the image (at most 1 MiB read), or "" if it has none.
fn read_in_root(root: &Path, rel: &str) -> String {
    let parts: Vec<std::ffi::OsString> = rel.split('/').map(Into::into).collect();
    let Ok(p) = resolve(root, &parts, true) else {
        return String::new();
    };
    let mut s = String::new();
    if let Ok(f) = std::fs::File::open(&p) {
        let _ = f.take(1 << 20).read_to_string(&mut s);
    }
    s
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

    fn root_with_users() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("etc")).unwrap();
        std::fs::write(
            d.path().join("etc/passwd"),
            "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1001:App:/home/app:/bin/sh\n",
        )
        .unwrap();
        std::fs::write(d.path().join("etc/group"), "root:x:0:\nstaff:x:50:app\n").unwrap();
        d
    }

    fn config(user: Option<&str>) -> RunConfig {
        RunConfig {
            entrypoint: vec!["/bin/sh".into(), "-c".into()],
            cmd: vec!["exec server".into()],
            env: vec!["A=1".into(), "A=2".into(), "BARE".into(), "B=x=y".into()],
            working_dir: Some("srv".into()),
            user: user.map(Into::into),
            ..RunConfig::default()
        }
    }

    #[test]
    fn the_main_process_is_the_entrypoint_then_the_cmd_with_the_images_env_and_user() {
        let d = root_with_users();
        let m = main_process(d.path(), &config(Some("app:staff")))
            .unwrap()
            .unwrap();
        assert_eq!(m.args, ["/bin/sh", "-c", "exec server"]);
        assert_eq!((m.uid, m.gid), (1000, 50));
        assert_eq!(m.cwd, "/srv");
        let env: Vec<(&str, &str)> = m.env.iter().map(|(k, v)| (&**k, &**v)).collect();
        assert_eq!(
            env,
            [
                ("A", "2"),
                ("B", "x=y"),
                ("PATH", DEFAULT_PATH),
                ("HOME", "/home/app")
            ]
        );
        for (user, want) in [
            (None, (0, 0)),
            (Some(""), (0, 0)),
            (Some("app"), (1000, 1001)),
            (Some("1000"), (1000, 1001)),
            (Some("4242"), (4242, 0)),
            (Some("4242:7"), (4242, 7)),
            (Some("root:staff"), (0, 50)),
        ] {
            let m = main_process(d.path(), &config(user)).unwrap().unwrap();
            assert_eq!((m.uid, m.gid), want, "{user:?}");
        }
    }

    #[test]
    fn an_unknown_user_or_group_is_refused_and_no_program_is_no_main_process() {
        let d = root_with_users();
        for bad in ["nobody", "app:nogroup"] {
            let e = main_process(d.path(), &config(Some(bad))).unwrap_err();
            assert_eq!(e.code(), "image_unsupported", "{bad}: {e}");
        }
        let none = RunConfig::default();
        assert!(main_process(d.path(), &none).unwrap().is_none());
    }

    #[test]
    fn systemd_as_init_is_found_through_the_images_own_symlinks() {
        use std::os::unix::fs::symlink;
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        assert!(!init_is_systemd(r), "no /sbin/init");
        // Debian's merged /usr: /sbin -> usr/sbin, init -> ../lib/systemd/systemd.
        std::fs::create_dir_all(r.join("usr/sbin")).unwrap();
        std::fs::create_dir_all(r.join("usr/lib/systemd")).unwrap();
        symlink("usr/sbin", r.join("sbin")).unwrap();
        symlink("../lib/systemd/systemd", r.join("usr/sbin/init")).unwrap();
        assert!(!init_is_systemd(r), "a dangling link");
        std::fs::write(r.join("usr/lib/systemd/systemd"), b"elf").unwrap();
        assert!(!init_is_systemd(r), "not executable");
        set_mode(&r.join("usr/lib/systemd/systemd"), 0o755).unwrap();
        assert!(init_is_systemd(r));
        // An absolute link resolves inside the image, never on the host.
        std::fs::remove_file(r.join("usr/sbin/init")).unwrap();
        symlink("/bin/busybox", r.join("usr/sbin/init")).unwrap();
        assert!(!init_is_systemd(r), "busybox init is not systemd");
        std::fs::remove_file(r.join("usr/sbin/init")).unwrap();
        symlink("/lib/systemd/systemd", r.join("usr/sbin/init")).unwrap();
        assert!(!init_is_systemd(r), "no /lib in the image");
        symlink("usr/lib", r.join("lib")).unwrap();
        assert!(init_is_systemd(r));
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
