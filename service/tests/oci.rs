//! OCI images made into Sprout base images (`sprout image pull`), against a
//! real registry on loopback (Debian's docker-registry) and a local OCI
//! layout, with images built by umoci and pushed by skopeo. What the
//! conversion made is read back from the ext4 image with debugfs.
//!
//! The image booting in a VM is lab_oci.rs.

mod common;
use common::oci::*;

use std::path::Path;

use serde_json::Value;

/// The failed pull's message (stderr), checked to name `code`.
fn failed(out: &std::process::Output, code: &str) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "the pull succeeded: {err}");
    assert!(err.contains(&format!("({code})")), "expected {code}: {err}");
    err
}

/// Nothing half-built or unverified is left in the cache.
fn assert_nothing_cached_for(cache: &Path, digest: &str) {
    let hex = &digest[7..];
    let images = cache.join("oci/images");
    if let Ok(rd) = std::fs::read_dir(&images) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            assert!(
                !name.starts_with(hex),
                "an image directory {name} was left for {digest}"
            );
        }
    }
    if let Ok(rd) = std::fs::read_dir(cache.join("oci/tmp")) {
        let left: Vec<_> = rd.flatten().map(|e| e.path()).collect();
        assert!(left.is_empty(), "builds left in tmp: {left:?}");
    }
    if let Ok(rd) = std::fs::read_dir(cache.join("oci/blobs/sha256")) {
        let temps: Vec<_> = rd
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".tmp"))
            .collect();
        assert!(temps.is_empty(), "partial blobs left: {temps:?}");
    }
}

#[test]
fn a_registry_image_becomes_a_base_image_with_its_layers_applied() {
    require_tools();
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let layout = build_test_image(&dir.path().join("layout"), "1", "registry");
    let reg = Registry::start(&dir.path().join("registry"));
    reg.push(&layout, "sprout-test/img:1");
    let reference = format!("{}/sprout-test/img:1", reg.addr);

    let out = pull(&cache, &reference);
    let img = ok_json(&out);
    let progress = String::from_utf8_lossy(&out.stderr);
    for step in ["3 layers", "pulled", "unpacking layer 3/3", "mkfs.ext4"] {
        assert!(
            progress.contains(step),
            "no {step:?} in the progress: {progress}"
        );
    }
    assert_eq!(img["digest"], layout.digest().as_str());
    assert_eq!(img["layers"], 3);
    let path = Path::new(img["path"].as_str().unwrap()).to_owned();
    assert!(path.starts_with(&cache), "{}", path.display());

    // The layers, in order: whiteouts and the opaque marker hide what lower
    // layers made; the rest is there with its metadata.
    assert_eq!(
        read_in(&path, "/etc/os-release").unwrap(),
        "ID=sprout-oci-test\n"
    );
    assert_eq!(read_in(&path, "/etc/motd").unwrap(), "second\n");
    assert_eq!(
        read_in(&path, "/etc/x"),
        None,
        "a whiteout did not delete /etc/x"
    );
    assert_eq!(
        read_in(&path, "/etc/gone"),
        None,
        "a whiteout did not delete /etc/gone"
    );
    assert_eq!(
        read_in(&path, "/data/opq/lower"),
        None,
        "the opaque marker kept a lower file"
    );
    assert_eq!(read_in(&path, "/data/opq/upper").unwrap(), "upper\n");
    assert_eq!(
        read_in(&path, "/usr/lib/marker").unwrap(),
        "via the symlink\n",
        "an entry under a symlinked directory did not land where the guest looks"
    );
    let a = stat_in(&path, "/data/original");
    let b = stat_in(&path, "/data/hardlink");
    let inode = |s: &str| s.split_whitespace().nth(1).map(str::to_owned);
    assert_eq!(
        inode(&a),
        inode(&b),
        "the hard link is not one inode:\n{a}\n{b}"
    );
    assert!(a.contains("Links: 2"), "{a}");
    let p = stat_in(&path, "/home/user/private");
    assert!(
        p.contains("Mode:  0600") || p.contains("Mode:  00600"),
        "{p}"
    );
    assert!(
        p.contains("User:  1000") && p.contains("Group:  1000"),
        "{p}"
    );
    // Sprout's own files, which boot it.
    assert!(read_in(&path, "/sbin/sprout-init")
        .unwrap()
        .starts_with("#!/.sprout/bin/sh\n"));
    assert!(stat_in(&path, "/sbin/sprout-agent").contains("Mode:  0755"));
    assert!(stat_in(&path, "/.sprout/bin/busybox").contains("Mode:  0755"));
    assert!(read_in(&path, "/workspace").is_some());

    // How the image asks to be run.
    let c = &img["config"];
    assert_eq!(c["entrypoint"], serde_json::json!(["/bin/sh", "-c"]));
    assert_eq!(c["cmd"], serde_json::json!([MAIN_CMD]));
    assert!(
        c["env"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e == "GREETING=hello"),
        "{c}"
    );
    assert_eq!(c["workingDir"], "/data");
    assert_eq!(c["user"], "user");
    assert_eq!(c["exposedPorts"], serde_json::json!(["8000/tcp"]));
    // What the agent starts as the sandbox's main process: the entrypoint
    // and cmd, the image's env (with PATH and HOME filled in), its working
    // dir, its user as the image's /etc/passwd names it.
    let main: serde_json::Value =
        serde_json::from_str(&read_in(&path, "/.sprout/main.json").unwrap()).unwrap();
    assert_eq!(
        main["args"],
        serde_json::json!(["/bin/sh", "-c", MAIN_CMD]),
        "{main}"
    );
    assert_eq!((&main["uid"], &main["gid"]), (&1000.into(), &1000.into()));
    assert_eq!(main["cwd"], "/data");
    let env = main["env"].as_array().unwrap();
    for kv in [["GREETING", "hello"], ["HOME", "/home/user"]] {
        assert!(env.contains(&serde_json::json!(kv)), "{kv:?} in {main}");
    }
    assert!(env.iter().any(|e| e[0] == "PATH"), "{main}");

    // Again by tag: one manifest request, no blob fetched, the same image.
    let blobs = reg.requests("/blobs/");
    assert!(blobs >= 4, "the first pull fetched {blobs} blobs");
    let manifests = reg.requests("/manifests/");
    let again = ok_json(&pull(&cache, &reference));
    assert_eq!(again["path"], img["path"]);
    assert_eq!(
        reg.requests("/blobs/"),
        blobs,
        "a cached image fetched blobs again"
    );
    assert_eq!(reg.requests("/manifests/"), manifests + 1);
    // By digest: no request at all.
    let by_digest = format!("{}/sprout-test/img@{}", reg.addr, layout.digest());
    let again = ok_json(&pull(&cache, &by_digest));
    assert_eq!(again["path"], img["path"]);
    assert_eq!(reg.requests("/manifests/"), manifests + 1);
    assert_eq!(reg.requests("/blobs/"), blobs);

    // The same image from its local layout is the same base image.
    let from_layout = ok_json(&pull(&cache, &layout.reference()));
    assert_eq!(from_layout["path"], img["path"]);
    assert_eq!(read_in(&path, "/etc/unique").unwrap(), "registry\n");
}

#[test]
fn a_retagged_image_is_a_new_base_image_and_shares_unchanged_blobs() {
    require_tools();
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let reg = Registry::start(&dir.path().join("registry"));
    let one = build_test_image(&dir.path().join("one"), "1", "first");
    reg.push(&one, "app:latest");
    let first = ok_json(&pull(&cache, &format!("{}/app:latest", reg.addr)));
    // The tag moves to another image: a tag pull sees the new digest.
    let two = build_test_image(&dir.path().join("two"), "1", "second");
    reg.push(&two, "app:latest");
    let second = ok_json(&pull(&cache, &format!("{}/app:latest", reg.addr)));
    assert_ne!(first["digest"], second["digest"]);
    assert_ne!(first["path"], second["path"]);
    let path = |v: &Value| Path::new(v["path"].as_str().unwrap()).to_owned();
    assert_eq!(read_in(&path(&first), "/etc/unique").unwrap(), "first\n");
    assert_eq!(read_in(&path(&second), "/etc/unique").unwrap(), "second\n");
    // `sprout image ls` lists both.
    let ls = std::process::Command::new(env!("CARGO_BIN_EXE_sprout"))
        .args(["image", "ls", "--json"])
        .env("SPROUT_CACHE", &cache)
        .output()
        .unwrap();
    let all: Value = serde_json::from_slice(&ls.stdout).unwrap();
    assert_eq!(all.as_array().unwrap().len(), 2, "{all}");
}

#[test]
fn bad_references_and_bad_images_fail_clearly_and_cache_nothing() {
    require_tools();
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let reg = Registry::start(&dir.path().join("registry"));
    let good = build_test_image(&dir.path().join("layout"), "1", "good");
    reg.push(&good, "img:1");

    // Malformed references.
    for r in [
        format!("{}/UPPER:1", reg.addr),
        format!("{}/img@sha256:short", reg.addr),
        "oci:relative/path".into(),
    ] {
        failed(&pull(&cache, &r), "bad_image_reference");
    }
    // An unknown tag, an unknown repository, a layout with no such tag.
    let e = failed(
        &pull(&cache, &format!("{}/img:nope", reg.addr)),
        "image_not_found",
    );
    assert!(e.contains("img:nope"), "{e}");
    failed(
        &pull(&cache, &format!("{}/other:1", reg.addr)),
        "image_not_found",
    );
    failed(
        &pull(
            &cache,
            &format!("{}:nope", good.reference().rsplit_once(':').unwrap().0),
        ),
        "image_not_found",
    );
    // A registry nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let e = failed(
        &pull(&cache, &format!("127.0.0.1:{port}/img:1")),
        "registry_unreachable",
    );
    assert!(e.contains(&format!("127.0.0.1:{port}")), "{e}");

    // An image for another architecture.
    let arm = Layout::new(&dir.path().join("arm"), "1");
    arm.layer(|root| std::fs::write(root.join("hello"), "arm\n").unwrap());
    arm.config(&["--architecture", "arm64"]);
    reg.push(&arm, "arm:1");
    let e = failed(
        &pull(&cache, &format!("{}/arm:1", reg.addr)),
        "image_platform",
    );
    assert!(e.contains("linux/arm64"), "{e}");
    assert_nothing_cached_for(&cache, &arm.digest());

    // A layer whose bytes the registry changed after the push: refused on
    // its digest, and neither it nor a half-built image is kept.
    let bad = build_test_image(&dir.path().join("bad"), "1", "to be corrupted");
    reg.push(&bad, "bad:1");
    let layer = bad.layers()[0].clone();
    let file = reg.blob_file(&layer);
    let mut bytes = std::fs::read(&file).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&file, &bytes).unwrap();
    let e = failed(
        &pull(&cache, &format!("{}/bad:1", reg.addr)),
        "image_corrupt",
    );
    assert!(e.contains(&layer), "{e}");
    assert_nothing_cached_for(&cache, &bad.digest());
    assert!(
        !cache.join("oci/blobs/sha256").join(&layer[7..]).exists(),
        "the corrupt layer was cached"
    );

    // After all that, the good image still pulls.
    ok_json(&pull(&cache, &format!("{}/img:1", reg.addr)));
}
