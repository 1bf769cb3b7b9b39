//! OCI images for the tests, made with Debian's tools as a user would:
//! `umoci` builds an image layout layer by layer from real directories (its
//! deletions become whiteouts), `skopeo` pushes it to Debian's
//! `docker-registry` running on loopback. tests/oci/install.sh (run by
//! ./test) installs the three.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Panics, naming the install script, if a tool is missing.
pub fn require_tools() {
    for t in ["umoci", "skopeo", "docker-registry", "debugfs"] {
        let found = std::env::var_os("PATH")
            .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(t).is_file()));
        assert!(
            found,
            "{t} is missing: tests/oci/install.sh installs umoci, skopeo and docker-registry \
             (./test runs it)"
        );
    }
}

/// Runs `cmd`, panicking with its output if it fails; returns its stdout.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The agent ./test built (guest/build-images.sh), which the conversion
/// adds to each image.
pub fn agent() -> PathBuf {
    let cache = std::env::var_os("SPROUT_CACHE")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into()))
                .join(".cache/sprout")
        });
    let a = cache.join("images/.sprout-agent.stripped");
    assert!(
        a.is_file(),
        "no guest agent at {}: guest/build-images.sh test builds it (./test runs it)",
        a.display()
    );
    a
}

/// `sprout image pull REFERENCE --json` with its own cache directory.
pub fn pull(cache: &Path, reference: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_sprout"))
        .args(["image", "pull", "--json", reference])
        .env("SPROUT_CACHE", cache)
        .env("SPROUT_AGENT", agent())
        .stdin(Stdio::null())
        .output()
        .expect("run sprout image pull")
}

/// The record (`--json`) of a pull that must have succeeded.
pub fn ok_json(out: &std::process::Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "sprout image pull failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

/// Pulls `reference` with its own cache `cache`; the base image's path.
pub fn pulled_image(cache: &Path, reference: &str) -> PathBuf {
    let img = ok_json(&pull(cache, reference));
    PathBuf::from(img["path"].as_str().expect("the record has a path"))
}

/// The contents of `path` in the ext4 image `img` (debugfs, no mount);
/// `None` if it is not there.
pub fn read_in(img: &Path, path: &str) -> Option<String> {
    let stat = Command::new("debugfs")
        .args(["-R", &format!("stat {path}")])
        .arg(img)
        .output()
        .unwrap();
    if String::from_utf8_lossy(&stat.stderr).contains("File not found") {
        return None;
    }
    let out = Command::new("debugfs")
        .args(["-R", &format!("cat {path}")])
        .arg(img)
        .output()
        .unwrap();
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `debugfs stat` of `path` in `img` (inode, mode, owner lines).
pub fn stat_in(img: &Path, path: &str) -> String {
    let out = Command::new("debugfs")
        .args(["-R", &format!("stat {path}")])
        .arg(img)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A `umoci` layout under construction, one tag.
pub struct Layout {
    pub dir: PathBuf,
    pub tag: String,
    work: PathBuf,
}

impl Layout {
    /// An empty image `tag` in a new layout `dir`.
    pub fn new(dir: &Path, tag: &str) -> Layout {
        if !dir.join("index.json").exists() {
            run(Command::new("umoci").args(["init", "--layout"]).arg(dir));
        }
        run(Command::new("umoci")
            .args(["new", "--image"])
            .arg(format!("{}:{tag}", dir.display())));
        Layout {
            dir: dir.to_owned(),
            tag: tag.into(),
            work: dir.with_extension(format!("work-{tag}")),
        }
    }

    pub fn image(&self) -> String {
        format!("{}:{}", self.dir.display(), self.tag)
    }

    /// `oci:/path:tag`, Sprout's name for it.
    pub fn reference(&self) -> String {
        format!("oci:{}", self.image())
    }

    /// Adds a layer: the image so far is unpacked, `change` edits its root
    /// directory, and umoci packs what changed (deletions as whiteouts).
    pub fn layer(&self, change: impl FnOnce(&Path)) {
        let _ = std::fs::remove_dir_all(&self.work);
        run(Command::new("umoci")
            .args(["unpack", "--image", &self.image()])
            .arg(&self.work));
        change(&self.work.join("rootfs"));
        run(Command::new("umoci")
            .args(["repack", "--image", &self.image()])
            .arg(&self.work));
        let _ = std::fs::remove_dir_all(&self.work);
    }

    /// Appends `tar` (an uncompressed layer made by hand) verbatim.
    pub fn raw_layer(&self, tar: &Path) {
        run(Command::new("umoci")
            .args(["raw", "add-layer", "--image", &self.image()])
            .arg(tar));
    }

    /// `umoci config` with `args`.
    pub fn config(&self, args: &[&str]) {
        run(Command::new("umoci")
            .args(["config", "--image", &self.image()])
            .args(args));
    }

    /// The image manifest's digest.
    pub fn digest(&self) -> String {
        let index: serde_json::Value =
            serde_json::from_slice(&std::fs::read(self.dir.join("index.json")).unwrap()).unwrap();
        index["manifests"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == self.tag.as_str())
            .expect("the tag is in index.json")["digest"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    /// The digests of the image's layers, in order.
    pub fn layers(&self) -> Vec<String> {
        let d = self.digest();
        let m: serde_json::Value = serde_json::from_slice(
            &std::fs::read(self.dir.join("blobs/sha256").join(&d[7..])).unwrap(),
        )
        .unwrap();
        m["layers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["digest"].as_str().unwrap().to_owned())
            .collect()
    }
}

/// Debian's docker-registry on a loopback port, its storage and log in a
/// temporary directory; stopped on drop.
pub struct Registry {
    child: Child,
    pub addr: String,
    pub storage: PathBuf,
    log: PathBuf,
}

impl Registry {
    pub fn start(dir: &Path) -> Registry {
        let storage = dir.join("storage");
        std::fs::create_dir_all(&storage).unwrap();
        // A port taken between choosing it and the registry's bind makes the
        // registry exit: choose again.
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let addr = format!("127.0.0.1:{port}");
            let config = dir.join("registry.yml");
            std::fs::write(
                &config,
                format!(
                    "version: 0.1\nlog:\n  level: info\n  accesslog:\n    disabled: false\n\
                     storage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\n\
                     http:\n  addr: {addr}\n",
                    storage.display()
                ),
            )
            .unwrap();
            let log = dir.join("registry.log");
            let mut child = Command::new("docker-registry")
                .arg("serve")
                .arg(&config)
                .stdin(Stdio::null())
                .stdout(std::fs::File::create(&log).unwrap())
                .stderr(std::fs::File::options().append(true).open(&log).unwrap())
                .spawn()
                .expect("start docker-registry");
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                if child.try_wait().unwrap().is_some() {
                    break;
                }
                if let Ok(mut s) = std::net::TcpStream::connect(&addr) {
                    use std::io::Write;
                    let _ = s.write_all(b"GET /v2/ HTTP/1.0\r\n\r\n");
                    let mut answer = String::new();
                    let _ = s.read_to_string(&mut answer);
                    if answer.starts_with("HTTP/1.0 200") || answer.starts_with("HTTP/1.1 200") {
                        return Registry {
                            child,
                            addr,
                            storage,
                            log,
                        };
                    }
                }
                assert!(
                    Instant::now() < deadline,
                    "docker-registry did not answer in 60 s: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        panic!("docker-registry did not start (five ports tried)");
    }

    /// Pushes the layout's image as `name:tag` (skopeo, plain HTTP).
    pub fn push(&self, layout: &Layout, name: &str) {
        self.push_image(&layout.image(), name);
    }

    /// Pushes `image` (`/layout/dir:tag`) as `name:tag`.
    pub fn push_image(&self, image: &str, name: &str) {
        run(Command::new("skopeo").args([
            "copy",
            "--quiet",
            "--dest-tls-verify=false",
            &format!("oci:{image}"),
            &format!("docker://{}/{name}", self.addr),
        ]));
    }

    /// The registry's access log lines that are requests matching `what`
    /// (`/blobs/`, `/manifests/`).
    pub fn requests(&self, what: &str) -> usize {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("\"GET /v2/") && l.contains(what))
            .count()
    }

    /// Where the registry keeps blob `digest`'s bytes.
    pub fn blob_file(&self, digest: &str) -> PathBuf {
        let hex = &digest[7..];
        self.storage
            .join("docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A tar of hand-made entries (for what umoci never writes: an opaque
/// directory marker): (path, contents); a path ending in `/` is a directory.
pub fn tar_layer(path: &Path, entries: &[(&str, &str)]) {
    let mut b = tar::Builder::new(std::fs::File::create(path).unwrap());
    for (p, data) in entries {
        let mut h = tar::Header::new_gnu();
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        if p.ends_with('/') {
            h.set_entry_type(tar::EntryType::Directory);
            h.set_mode(0o755);
            h.set_size(0);
            b.append_data(&mut h, p, std::io::empty()).unwrap();
        } else {
            h.set_entry_type(tar::EntryType::Regular);
            h.set_mode(0o644);
            h.set_size(data.len() as u64);
            b.append_data(&mut h, p, data.as_bytes()).unwrap();
        }
    }
    b.finish().unwrap();
}

/// The test image's cmd (after its entrypoint `/bin/sh -c`): it writes
/// what it was started with, then serves /data over HTTP on port 8000.
pub const MAIN_CMD: &str =
    "echo \"$GREETING from $(pwd) as $(id -u):$(id -g)\" >/tmp/entrypoint.out \
     && exec httpd -f -p 8000 -h /data";

/// The image the OCI tests share, in layout `dir` as tag `tag`:
/// 1. busybox (its applets linked into /bin), /etc/os-release, files to be
///    deleted later, `/data/opq/lower`, a hard link, a private file owned
///    by 1000:1000, and `/lib -> usr/lib`;
/// 2. deletes `/etc/gone` (a directory) and `/etc/x` (whiteouts), rewrites
///    `/etc/motd`;
/// 3. (by hand) marks `/data/opq` opaque, adds `/data/opq/upper`, and
///    writes `lib/marker` (through the symlink, into `/usr/lib`).
///
/// Its config: entrypoint `/bin/sh -c`, cmd [`MAIN_CMD`], env, working dir,
/// user (`user`, 1000:1000 in its /etc/passwd) and an exposed port. `unique` goes into a file, so images built with
/// different values have different layers.
pub fn build_test_image(dir: &Path, tag: &str, unique: &str) -> Layout {
    let l = Layout::new(dir, tag);
    let unique = unique.to_owned();
    l.layer(move |root| {
        for d in ["bin", "etc/gone", "data/opq", "usr/lib", "home/user"] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
        for a in [
            "sh", "cat", "ls", "echo", "test", "stat", "id", "httpd", "wget", "sleep", "seq",
        ] {
            std::os::unix::fs::symlink("busybox", root.join("bin").join(a)).unwrap();
        }
        std::fs::write(root.join("etc/os-release"), "ID=sprout-oci-test\n").unwrap();
        std::fs::write(
            root.join("etc/passwd"),
            "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:User:/home/user:/bin/sh\n",
        )
        .unwrap();
        std::fs::write(root.join("etc/group"), "root:x:0:\nuser:x:1000:\n").unwrap();
        std::fs::write(root.join("etc/x"), "to be whited out\n").unwrap();
        std::fs::write(root.join("etc/gone/y"), "gone with its dir\n").unwrap();
        std::fs::write(root.join("etc/motd"), "first\n").unwrap();
        std::fs::write(root.join("etc/unique"), format!("{unique}\n")).unwrap();
        std::fs::write(root.join("data/opq/lower"), "lower\n").unwrap();
        std::fs::write(root.join("data/original"), "linked\n").unwrap();
        std::fs::hard_link(root.join("data/original"), root.join("data/hardlink")).unwrap();
        let private = root.join("home/user/private");
        std::fs::write(&private, "mine\n").unwrap();
        std::os::unix::fs::chown(&private, Some(1000), Some(1000)).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::symlink("usr/lib", root.join("lib")).unwrap();
    });
    l.layer(|root| {
        std::fs::remove_dir_all(root.join("etc/gone")).unwrap();
        std::fs::remove_file(root.join("etc/x")).unwrap();
        std::fs::write(root.join("etc/motd"), "second\n").unwrap();
    });
    let tar = dir.with_extension(format!("opaque-{tag}.tar"));
    tar_layer(
        &tar,
        &[
            ("data/opq/", ""),
            ("data/opq/.wh..wh..opq", ""),
            ("data/opq/upper", "upper\n"),
            // Through the symlink /lib -> usr/lib of layer 1.
            ("lib/marker", "via the symlink\n"),
        ],
    );
    l.raw_layer(&tar);
    l.config(&[
        "--config.entrypoint",
        "/bin/sh",
        "--config.entrypoint",
        "-c",
        "--config.cmd",
        MAIN_CMD,
        "--config.env",
        "GREETING=hello",
        "--config.workingdir",
        "/data",
        "--config.user",
        "user",
        "--config.exposedports",
        "8000/tcp",
    ]);
    l
}

/// The Debian image (minbase, python3, systemd) tests/oci/build-debian-image.sh
/// builds (cached), as `/layout/dir:1`.
pub fn debian_image() -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/oci/build-debian-image.sh");
    let out = run(&mut Command::new(script));
    format!("{}:1", out.trim())
}
