//! Applying OCI layers, in order, to a root directory: whiteouts (`.wh.NAME`)
//! delete what a lower layer made, opaque markers (`.wh..wh..opq`) empty a
//! directory of what lower layers put there; ownership, modes, times,
//! extended attributes, hard links, symlinks and device nodes are kept.
//!
//! A layer is untrusted input unpacked as root, so no entry may reach outside
//! the root: `..` in a path is refused, and every path is resolved inside
//! the root the way the guest will see it, a symlink met on the way
//! (absolute or relative) staying confined to the root as under `chroot`.
//! Nothing is ever written through a symlink an entry names itself.

use std::collections::{HashSet, VecDeque};
use std::ffi::{OsStr, OsString};
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use super::OciError;

/// How a layer blob is compressed (from its media type).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    pub fn of(media_type: &str) -> Result<Compression, OciError> {
        let t = media_type
            .strip_prefix("application/vnd.oci.image.layer.")
            .and_then(|t| t.strip_prefix("nondistributable.").or(Some(t)));
        match (t, media_type) {
            (Some("v1.tar"), _) => Ok(Compression::None),
            (Some("v1.tar+gzip"), _) => Ok(Compression::Gzip),
            (Some("v1.tar+zstd"), _) => Ok(Compression::Zstd),
            (_, "application/vnd.docker.image.rootfs.diff.tar.gzip")
            | (_, "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip") => {
                Ok(Compression::Gzip)
            }
            _ => Err(OciError::Unsupported(format!(
                "layer media type {media_type:?} (Sprout unpacks tar, tar+gzip and tar+zstd layers)"
            ))),
        }
    }
}

/// What unpacking may write in all, across the layers of one image.
#[derive(Clone, Copy, Debug)]
pub struct Budget {
    pub bytes: u64,
    pub entries: u64,
}

impl Default for Budget {
    fn default() -> Budget {
        Budget {
            bytes: 64 << 30,
            entries: 4 << 20,
        }
    }
}

/// What one layer did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayerStats {
    pub entries: u64,
    pub bytes: u64,
    pub whiteouts: u64,
}

/// Applies the layer in `blob` to `root`.
pub fn apply_layer(
    root: &Path,
    blob: &Path,
    compression: Compression,
    budget: &mut Budget,
) -> Result<LayerStats, OciError> {
    let f = std::fs::File::open(blob).map_err(|e| OciError::io("open", blob, e))?;
    let f = std::io::BufReader::with_capacity(1 << 20, f);
    let reader: Box<dyn Read> = match compression {
        Compression::None => Box::new(f),
        Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(f)),
        Compression::Zstd => Box::new(
            ruzstd::decoding::StreamingDecoder::new(f)
                .map_err(|e| OciError::Corrupt(format!("zstd layer: {e}")))?,
        ),
    };
    let mut layer = Layer {
        root,
        created: HashSet::new(),
        stats: LayerStats::default(),
        budget,
    };
    let mut archive = tar::Archive::new(reader);
    let entries = archive
        .entries()
        .map_err(|e| OciError::Corrupt(format!("layer is not a tar archive: {e}")))?;
    for entry in entries {
        let entry = entry.map_err(|e| OciError::Corrupt(format!("layer tar: {e}")))?;
        layer.entry(entry)?;
    }
    Ok(layer.stats)
}

struct Layer<'a> {
    root: &'a Path,
    /// Paths this layer made (an opaque marker keeps them).
    created: HashSet<PathBuf>,
    stats: LayerStats,
    budget: &'a mut Budget,
}

/// The normal components of an entry's path; `..` is refused.
fn components(p: &Path) -> Result<Vec<OsString>, OciError> {
    let mut out = Vec::new();
    for c in p.components() {
        match c {
            Component::Normal(n) => out.push(n.to_owned()),
            Component::CurDir | Component::RootDir => {}
            Component::ParentDir | Component::Prefix(_) => {
                return Err(OciError::Corrupt(format!(
                    "layer entry {:?} leads out of the image with '..'",
                    p.display()
                )))
            }
        }
    }
    Ok(out)
}

/// Resolves `rel` inside `root` as the guest would, with `root` as `/`:
/// symlinks on the way are followed but never leave the root (`..` stops
/// at it, an absolute target starts from it). The last component is
/// followed only with `follow_last`.
pub fn resolve(root: &Path, rel: &[OsString], follow_last: bool) -> Result<PathBuf, OciError> {
    let mut out: Vec<OsString> = Vec::new();
    let mut todo: VecDeque<OsString> = rel.iter().cloned().collect();
    let mut hops = 0;
    while let Some(c) = todo.pop_front() {
        if c == ".." {
            out.pop();
            continue;
        }
        if c == "." || c.is_empty() {
            continue;
        }
        let here: PathBuf = root.join(out.iter().collect::<PathBuf>()).join(&c);
        let is_link = std::fs::symlink_metadata(&here).is_ok_and(|m| m.file_type().is_symlink());
        if is_link && (!todo.is_empty() || follow_last) {
            hops += 1;
            if hops > 40 {
                return Err(OciError::Corrupt(format!(
                    "too many levels of symbolic links at {:?}",
                    rel.iter().collect::<PathBuf>()
                )));
            }
            let target =
                std::fs::read_link(&here).map_err(|e| OciError::io("readlink", &here, e))?;
            if target.is_absolute() {
                out.clear();
            }
            let parts: Vec<OsString> = target
                .components()
                .filter_map(|c| match c {
                    Component::Normal(n) => Some(n.to_owned()),
                    Component::ParentDir => Some(OsString::from("..")),
                    _ => None,
                })
                .collect();
            for p in parts.into_iter().rev() {
                todo.push_front(p);
            }
            continue;
        }
        out.push(c);
    }
    Ok(root.join(out.iter().collect::<PathBuf>()))
}

/// Removes whatever is at `p` (not following a symlink there).
fn remove_any(p: &Path) -> Result<(), OciError> {
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(p).map_err(|e| OciError::io("remove", p, e)),
        Ok(_) => std::fs::remove_file(p).map_err(|e| OciError::io("remove", p, e)),
        Err(_) => Ok(()),
    }
}

impl Layer<'_> {
    fn entry<R: Read>(&mut self, mut e: tar::Entry<'_, R>) -> Result<(), OciError> {
        self.stats.entries += 1;
        if self.budget.entries == 0 {
            return Err(OciError::TooLarge("the image has too many files".into()));
        }
        self.budget.entries -= 1;
        let raw = e
            .path()
            .map_err(|err| OciError::Corrupt(format!("layer entry path: {err}")))?
            .into_owned();
        let comps = components(&raw)?;
        let Some((name, dirs)) = comps.split_last() else {
            // The root itself ("./"): its metadata is the image's business
            // only for a directory entry; keep the root as it is.
            return Ok(());
        };
        let parent = resolve(self.root, dirs, true)?;
        std::fs::create_dir_all(&parent).map_err(|err| OciError::io("create", &parent, err))?;
        let name_bytes = name.as_bytes();
        if name_bytes == b".wh..wh..opq" {
            self.stats.whiteouts += 1;
            return self.opaque(&parent);
        }
        if let Some(hidden) = name_bytes.strip_prefix(b".wh.") {
            self.stats.whiteouts += 1;
            if hidden.is_empty() || hidden == b"." || hidden == b".." {
                return Err(OciError::Corrupt(format!(
                    "bad whiteout {:?}",
                    raw.display()
                )));
            }
            return remove_any(&parent.join(OsStr::from_bytes(hidden)));
        }
        let path = parent.join(name);
        let kind = e.header().entry_type();
        let mode = e.header().mode().unwrap_or(0o644) & 0o7777;
        let uid = e.header().uid().unwrap_or(0) as u32;
        let gid = e.header().gid().unwrap_or(0) as u32;
        let mtime = e.header().mtime().unwrap_or(0);
        match kind {
            tar::EntryType::Directory => {
                let is_dir = std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir());
                if !is_dir {
                    remove_any(&path)?;
                    std::fs::create_dir(&path).map_err(|err| OciError::io("create", &path, err))?;
                }
            }
            tar::EntryType::Regular | tar::EntryType::Continuous | tar::EntryType::GNUSparse => {
                remove_any(&path)?;
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&path)
                    .map_err(|err| OciError::io("create", &path, err))?;
                let size = e.header().size().unwrap_or(0);
                if size > self.budget.bytes {
                    return Err(OciError::TooLarge(format!(
                        "the image unpacks to more than its limit ({:?} alone is {size} bytes)",
                        raw.display()
                    )));
                }
                let n = std::io::copy(&mut (&mut e).take(self.budget.bytes), &mut f).map_err(
                    |err| OciError::Corrupt(format!("layer data of {:?}: {err}", raw.display())),
                )?;
                self.budget.bytes -= n;
                self.stats.bytes += n;
            }
            tar::EntryType::Symlink => {
                let target = e
                    .link_name()
                    .map_err(|err| OciError::Corrupt(format!("symlink target: {err}")))?
                    .ok_or_else(|| {
                        OciError::Corrupt(format!("symlink {:?} has no target", raw.display()))
                    })?
                    .into_owned();
                remove_any(&path)?;
                std::os::unix::fs::symlink(&target, &path)
                    .map_err(|err| OciError::io("symlink", &path, err))?;
            }
            tar::EntryType::Link => {
                let target = e
                    .link_name()
                    .map_err(|err| OciError::Corrupt(format!("hard link target: {err}")))?
                    .ok_or_else(|| {
                        OciError::Corrupt(format!("hard link {:?} has no target", raw.display()))
                    })?
                    .into_owned();
                let tcomps = components(&target)?;
                let (tname, tdirs) = tcomps.split_last().ok_or_else(|| {
                    OciError::Corrupt(format!("hard link {:?} to the root", raw.display()))
                })?;
                let src = resolve(self.root, tdirs, true)?.join(tname);
                if std::fs::symlink_metadata(&src).is_ok_and(|m| m.is_dir()) {
                    return Err(OciError::Corrupt(format!(
                        "hard link {:?} to a directory",
                        raw.display()
                    )));
                }
                if src != path {
                    remove_any(&path)?;
                    std::fs::hard_link(&src, &path)
                        .map_err(|err| OciError::io("link", &path, err))?;
                }
                // A hard link shares its target's metadata: nothing to set.
                self.created.insert(path);
                return Ok(());
            }
            tar::EntryType::Char | tar::EntryType::Block | tar::EntryType::Fifo => {
                remove_any(&path)?;
                let ft = match kind {
                    tar::EntryType::Char => rustix::fs::FileType::CharacterDevice,
                    tar::EntryType::Block => rustix::fs::FileType::BlockDevice,
                    _ => rustix::fs::FileType::Fifo,
                };
                let dev = rustix::fs::makedev(
                    e.header().device_major().ok().flatten().unwrap_or(0),
                    e.header().device_minor().ok().flatten().unwrap_or(0),
                );
                if let Err(err) = rustix::fs::mknodat(
                    rustix::fs::CWD,
                    &path,
                    ft,
                    rustix::fs::Mode::from_raw_mode(mode),
                    dev,
                ) {
                    // Only root may make device nodes; the guest's /dev is a
                    // devtmpfs anyway.
                    log::warn!("oci: skipping device node {}: {err}", raw.display());
                    return Ok(());
                }
            }
            // Metadata-only entries the tar reader already folded in.
            tar::EntryType::XGlobalHeader | tar::EntryType::XHeader => return Ok(()),
            other => {
                log::warn!("oci: skipping {:?} of type {other:?}", raw.display());
                return Ok(());
            }
        }
        self.metadata(&mut e, &path, kind, mode, uid, gid, mtime);
        self.created.insert(path);
        Ok(())
    }

    /// Owner, mode, time and extended attributes of what `path` now is.
    #[allow(clippy::too_many_arguments)]
    fn metadata<R: Read>(
        &self,
        e: &mut tar::Entry<'_, R>,
        path: &Path,
        kind: tar::EntryType,
        mode: u32,
        uid: u32,
        gid: u32,
        mtime: u64,
    ) {
        if let Err(err) = std::os::unix::fs::lchown(path, Some(uid), Some(gid)) {
            log::warn!("oci: cannot chown {}: {err}", path.display());
        }
        let symlink = kind == tar::EntryType::Symlink;
        if !symlink {
            use std::os::unix::fs::PermissionsExt;
            // After chown, which clears set-id bits.
            let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode));
        }
        if kind != tar::EntryType::Directory {
            let at = rustix::fs::Timespec {
                tv_sec: mtime as i64,
                tv_nsec: 0,
            };
            let t = rustix::fs::Timestamps {
                last_access: at,
                last_modification: at,
            };
            let _ = rustix::fs::utimensat(
                rustix::fs::CWD,
                path,
                &t,
                rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
            );
        }
        if let Ok(Some(exts)) = e.pax_extensions() {
            for ext in exts.flatten() {
                let Some(name) = ext.key_bytes().strip_prefix(b"SCHILY.xattr.") else {
                    continue;
                };
                let name = OsStr::from_bytes(name);
                if let Err(err) = rustix::fs::lsetxattr(
                    path,
                    name,
                    ext.value_bytes(),
                    rustix::fs::XattrFlags::empty(),
                ) {
                    log::warn!(
                        "oci: cannot set xattr {} on {}: {err}",
                        name.to_string_lossy(),
                        path.display()
                    );
                }
            }
        }
    }

    /// Empties `dir` of everything a lower layer put there.
    fn opaque(&mut self, dir: &Path) -> Result<(), OciError> {
        let rd = std::fs::read_dir(dir).map_err(|e| OciError::io("list", dir, e))?;
        for child in rd.flatten() {
            let p = child.path();
            if !self.created.contains(&p) {
                remove_any(&p)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(parts: &[&str]) -> Vec<OsString> {
        parts.iter().map(OsString::from).collect()
    }

    #[test]
    fn symlinks_resolve_inside_the_root_and_never_above_it() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path();
        std::fs::create_dir_all(root.join("usr/bin")).unwrap();
        std::os::unix::fs::symlink("usr/bin", root.join("bin")).unwrap();
        std::os::unix::fs::symlink("/etc", root.join("abs")).unwrap();
        std::os::unix::fs::symlink("../../../../..", root.join("up")).unwrap();
        std::os::unix::fs::symlink("loop", root.join("loop")).unwrap();
        assert_eq!(
            resolve(root, &os(&["bin", "sh"]), true).unwrap(),
            root.join("usr/bin/sh")
        );
        assert_eq!(
            resolve(root, &os(&["abs", "passwd"]), true).unwrap(),
            root.join("etc/passwd")
        );
        assert_eq!(
            resolve(root, &os(&["up", "etc"]), true).unwrap(),
            root.join("etc")
        );
        assert_eq!(
            resolve(root, &os(&["bin"]), false).unwrap(),
            root.join("bin")
        );
        assert!(resolve(root, &os(&["loop", "x"]), true).is_err());
    }

    #[test]
    fn parent_components_are_refused() {
        assert!(components(Path::new("a/../../etc/passwd")).is_err());
        assert_eq!(components(Path::new("./a/b/")).unwrap(), os(&["a", "b"]));
        assert_eq!(components(Path::new("/a")).unwrap(), os(&["a"]));
    }

    #[test]
    fn media_types_name_their_compression() {
        use Compression::*;
        for (t, c) in [
            ("application/vnd.oci.image.layer.v1.tar", None),
            ("application/vnd.oci.image.layer.v1.tar+gzip", Gzip),
            (
                "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
                Gzip,
            ),
            ("application/vnd.oci.image.layer.v1.tar+zstd", Zstd),
            ("application/vnd.docker.image.rootfs.diff.tar.gzip", Gzip),
        ] {
            assert_eq!(Compression::of(t).unwrap(), c, "{t}");
        }
        assert!(Compression::of("application/vnd.oci.image.layer.v1.tar+bzip2").is_err());
    }

    /// A tar of (path, kind) entries: "f:TEXT" a file, "d" a directory,
    /// "l:TARGET" a symlink, "h:TARGET" a hard link, "w" an empty file
    /// (for whiteout names).
    fn layer(dir: &Path, name: &str, entries: &[(&str, &str)]) -> PathBuf {
        let path = dir.join(name);
        let mut b = tar::Builder::new(std::fs::File::create(&path).unwrap());
        for (p, kind) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_mode(0o644);
            h.set_uid(1000);
            h.set_gid(1000);
            h.set_mtime(1_700_000_000);
            let (k, arg) = kind.split_once(':').unwrap_or((kind, ""));
            match k {
                "f" | "w" if p.contains("..") => {
                    // The builder refuses such names: write the header's
                    // name field by hand, as a hostile layer would.
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_size(arg.len() as u64);
                    h.as_old_mut().name[..p.len()].copy_from_slice(p.as_bytes());
                    h.set_cksum();
                    b.append(&h, arg.as_bytes()).unwrap();
                }
                "f" | "w" => {
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_size(arg.len() as u64);
                    b.append_data(&mut h, p, arg.as_bytes()).unwrap();
                }
                "d" => {
                    h.set_entry_type(tar::EntryType::Directory);
                    h.set_mode(0o750);
                    h.set_size(0);
                    b.append_data(&mut h, p, std::io::empty()).unwrap();
                }
                "l" | "h" => {
                    h.set_entry_type(if k == "l" {
                        tar::EntryType::Symlink
                    } else {
                        tar::EntryType::Link
                    });
                    h.set_size(0);
                    b.append_link(&mut h, p, arg).unwrap();
                }
                _ => panic!("{k}"),
            }
        }
        b.finish().unwrap();
        path
    }

    fn apply(root: &Path, blob: &Path) -> Result<LayerStats, OciError> {
        apply_layer(root, blob, Compression::None, &mut Budget::default())
    }

    #[test]
    fn whiteouts_and_opaque_directories_hide_lower_layers_only() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("root");
        std::fs::create_dir(&root).unwrap();
        let l1 = layer(
            d.path(),
            "l1.tar",
            &[
                ("etc", "d"),
                ("etc/gone", "f:1"),
                ("etc/kept", "f:2"),
                ("etc/dir", "d"),
                ("etc/dir/deep", "f:3"),
                ("opq", "d"),
                ("opq/lower", "f:4"),
                ("etc/hard", "h:etc/kept"),
            ],
        );
        let l2 = layer(
            d.path(),
            "l2.tar",
            &[
                ("etc/.wh.gone", "w"),
                ("etc/.wh.dir", "w"),
                ("opq/upper-before", "f:5"),
                ("opq/.wh..wh..opq", "w"),
                ("opq/upper-after", "f:6"),
            ],
        );
        apply(&root, &l1).unwrap();
        let s = apply(&root, &l2).unwrap();
        assert_eq!(s.whiteouts, 3);
        assert!(!root.join("etc/gone").exists());
        assert!(!root.join("etc/dir").exists());
        assert_eq!(std::fs::read_to_string(root.join("etc/kept")).unwrap(), "2");
        assert!(!root.join("opq/lower").exists());
        assert!(root.join("opq/upper-before").exists());
        assert!(root.join("opq/upper-after").exists());
        use std::os::unix::fs::MetadataExt;
        let (a, b) = (
            std::fs::metadata(root.join("etc/kept")).unwrap(),
            std::fs::metadata(root.join("etc/hard")).unwrap(),
        );
        assert_eq!(a.ino(), b.ino(), "the hard link is one inode");
        assert_eq!(a.uid(), 1000);
        assert_eq!(a.mode() & 0o7777, 0o644);
        assert_eq!(a.mtime(), 1_700_000_000);
        assert_eq!(
            std::fs::metadata(root.join("etc")).unwrap().mode() & 0o7777,
            0o750
        );
    }

    #[test]
    fn entries_through_symlinks_stay_inside_the_root() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("root");
        let outside = d.path().join("outside");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        let l1 = layer(
            d.path(),
            "l1.tar",
            &[
                ("esc", &format!("l:{}", outside.display())),
                ("rel", "l:../../../outside"),
                ("esc/a", "f:x"),
                ("rel/b", "f:y"),
                ("hl", &format!("h:{}", "esc/a")),
            ],
        );
        apply(&root, &l1).unwrap();
        assert_eq!(
            std::fs::read_dir(&outside).unwrap().count(),
            0,
            "wrote outside the root"
        );
        // Both landed where the guest will look for them.
        assert_eq!(
            std::fs::read_to_string(root.join(outside.strip_prefix("/").unwrap()).join("a"))
                .unwrap(),
            "x"
        );
        assert_eq!(
            std::fs::read_to_string(root.join("outside/b")).unwrap(),
            "y"
        );
        // A whiteout or a file named by an entry replaces the symlink itself.
        let l2 = layer(d.path(), "l2.tar", &[("esc", "f:plain")]);
        apply(&root, &l2).unwrap();
        assert!(std::fs::symlink_metadata(root.join("esc"))
            .unwrap()
            .is_file());
        let l3 = layer(d.path(), "l3.tar", &[("../x", "f:bad")]);
        assert!(matches!(apply(&root, &l3), Err(OciError::Corrupt(_))));
    }

    #[test]
    fn the_byte_budget_stops_a_layer_that_unpacks_too_large() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("root");
        std::fs::create_dir(&root).unwrap();
        let l = layer(
            d.path(),
            "l.tar",
            &[("a", "f:0123456789"), ("b", "f:0123456789")],
        );
        let mut b = Budget {
            bytes: 15,
            entries: 100,
        };
        assert!(matches!(
            apply_layer(&root, &l, Compression::None, &mut b),
            Err(OciError::TooLarge(_))
        ));
        let mut b = Budget {
            bytes: 100,
            entries: 1,
        };
        assert!(matches!(
            apply_layer(&root, &l, Compression::None, &mut b),
            Err(OciError::TooLarge(_))
        ));
    }
}
