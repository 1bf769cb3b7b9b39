//! Paths that try to leave the files root are refused, with openat2 and with the
//! component-by-component fallback, while legitimate nested paths work.

mod common;

use std::os::unix::fs::symlink;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::Agent;
use guest_agent::client::{Client, ClientError, WriteOptions};
use guest_agent::protocol::ErrorCode;

/// Lays out `<dir>/outside/secret`, a sibling `<dir>/rootx`, and inside the root a
/// nested file plus symlinks of every kind.
fn layout(agent: &Agent) {
    let dir = agent.dir.path();
    let root = &agent.root;
    std::fs::create_dir(dir.join("outside")).unwrap();
    std::fs::write(dir.join("outside/secret"), b"SECRET").unwrap();
    std::fs::create_dir(dir.join("rootx")).unwrap();
    std::fs::write(dir.join("rootx/file"), b"SECRET").unwrap();
    std::fs::create_dir_all(root.join("a/b/c")).unwrap();
    std::fs::write(root.join("a/b/c/f"), b"inside").unwrap();
    symlink("/", root.join("slash")).unwrap();
    symlink("..", root.join("up")).unwrap();
    symlink("../outside/secret", root.join("upfile")).unwrap();
    symlink(dir.join("outside/secret"), root.join("abs")).unwrap();
    symlink(root.join("a/b/c/f"), root.join("absin")).unwrap();
    symlink("../outside", root.join("outdir")).unwrap();
    symlink("a/b", root.join("inner")).unwrap();
    symlink("../../../..", root.join("a/b/c/over")).unwrap();
    symlink("../outside/planted-dangling", root.join("dang")).unwrap();
    symlink("/proc/self/root", root.join("proc")).unwrap();
    symlink("loop", root.join("loop")).unwrap();
}

fn refused<T>(r: Result<T, ClientError>, what: &str) -> ErrorCode {
    match r {
        Err(e) => match e.code() {
            Some(c @ (ErrorCode::PathEscape | ErrorCode::InvalidPath)) => c,
            _ => panic!("{what}: refused for the wrong reason: {e}"),
        },
        Ok(_) => panic!("{what}: allowed"),
    }
}

async fn read(c: &Client, p: &str) -> Result<Vec<u8>, ClientError> {
    c.read_to_vec(p, 1 << 20).await
}

async fn escape_suite(agent: &Agent) {
    layout(agent);
    let c = agent.client();
    let dir = agent.dir.path().display().to_string();
    let root = agent.root.display().to_string();
    let long = "a/".repeat(2100);
    let reads = [
        "../outside/secret".to_string(),
        "/etc/passwd".into(),
        "a/../../outside/secret".into(),
        "a/b/c/../../../../outside/secret".into(),
        "a\0b".into(),
        "slash/etc/passwd".into(),
        "up/outside/secret".into(),
        "upfile".into(),
        "abs".into(),
        "absin".into(),
        "outdir/secret".into(),
        "a/b/c/over/outside/secret".into(),
        "inner/../../outside/secret".into(),
        "proc/etc/passwd".into(),
        format!("{dir}/rootx/file"),
        format!("{root}/../outside/secret"),
        format!("{dir}/outside/secret"),
        "..".into(),
        long.clone(),
    ];
    let mut codes = Vec::new();
    for p in &reads {
        let shown: String = p.chars().take(60).collect();
        codes.push(refused(read(&c, p).await, &format!("read {shown:?}")));
    }
    assert!(codes.contains(&ErrorCode::InvalidPath) && codes.contains(&ErrorCode::PathEscape));
    let loop_err = read(&c, "loop").await.unwrap_err();
    assert_eq!(loop_err.code(), Some(ErrorCode::InvalidPath), "{loop_err}");

    for p in ["up", "/tmp", "..", "outdir", "slash"] {
        refused(c.list(p).await, &format!("list {p:?}"));
    }
    for p in ["../outside", "outdir/secret", "up/outside", "/etc"] {
        refused(c.stat(p).await, &format!("stat {p:?}"));
    }
    for p in [
        "dang",
        "outdir/planted",
        "up/outside/planted",
        "a/b/c/over/outside/planted",
        "abs",
    ] {
        refused(c.write_bytes(p, b"owned").await, &format!("write {p:?}"));
    }
    for (p, parents) in [
        ("outdir/newdir", false),
        ("up/x/y", true),
        ("../newdir", true),
    ] {
        refused(c.mkdir(p, parents).await, &format!("mkdir {p:?}"));
    }
    for p in [
        "outdir/secret",
        "../outside",
        "up/outside/secret",
        "/etc/hostname",
    ] {
        refused(c.remove(p, true).await, &format!("remove {p:?}"));
    }
    for (from, to) in [
        ("a/b/c/f", "../stolen"),
        ("outdir/secret", "stolen"),
        ("a/b/c/f", "outdir/stolen"),
        ("/etc/hostname", "stolen"),
    ] {
        refused(c.rename(from, to).await, &format!("rename {from:?} {to:?}"));
    }

    // Nothing outside changed.
    let outside = agent.dir.path().join("outside");
    assert_eq!(std::fs::read(outside.join("secret")).unwrap(), b"SECRET");
    let mut names: Vec<_> = std::fs::read_dir(&outside)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert_eq!(names, ["secret"]);
    assert!(!agent.dir.path().join("newdir").exists() && !agent.dir.path().join("stolen").exists());

    // Legitimate nested paths work, through symlinks that stay inside too.
    for p in ["a/b/c/f", "inner/c/f", "a/./b/../b/c/f", "inner/../b/c/f"] {
        assert_eq!(read(&c, p).await.unwrap(), b"inside", "{p}");
    }
    assert_eq!(
        read(&c, &format!("{root}/a/b/c/f")).await.unwrap(),
        b"inside"
    );
    c.mkdir("inner/c/d/e", true).await.unwrap();
    c.write_file("inner/c/d/e/new", WriteOptions::default(), &mut &b"n"[..])
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(agent.root.join("a/b/c/d/e/new")).unwrap(),
        b"n"
    );
    c.rename("inner/c/d/e/new", "a/moved").await.unwrap();
    assert_eq!(c.stat("a/moved").await.unwrap().size, 1);
    // Removing a symlink to outside removes the link only.
    c.remove("outdir", true).await.unwrap();
    assert!(outside.join("secret").exists());
}

#[tokio::test]
async fn escapes_are_refused_with_openat2() {
    let agent = Agent::start();
    escape_suite(&agent).await;
}

#[tokio::test]
async fn escapes_are_refused_with_the_fallback_walk() {
    let agent = Agent::start_with(&["--no-openat2"]);
    escape_suite(&agent).await;
}

/// A thread swaps `flip` between a real directory and a symlink to outside, atomically
/// (RENAME_EXCHANGE), while the client reads and writes through it.
async fn swap_race(agent: &Agent) {
    let outside = agent.dir.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::fs::write(outside.join("f"), b"SECRET").unwrap();
    std::fs::create_dir(agent.root.join("flip")).unwrap();
    std::fs::write(agent.root.join("flip/f"), b"inside").unwrap();
    symlink("../outside", agent.root.join("other")).unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let flipper = {
        let stop = stop.clone();
        let root = agent.root.clone();
        std::thread::spawn(move || {
            let mut swaps = 0u64;
            while !stop.load(Ordering::Relaxed) {
                rustix::fs::renameat_with(
                    rustix::fs::CWD,
                    root.join("flip"),
                    rustix::fs::CWD,
                    root.join("other"),
                    rustix::fs::RenameFlags::EXCHANGE,
                )
                .unwrap();
                swaps += 1;
            }
            swaps
        })
    };
    let c = agent.client();
    let (mut inside, mut refusals) = (0, 0);
    // At least 400 rounds, and on until the race has hit both sides (a loaded
    // machine may starve the flipper for a while), within a generous limit.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let mut i = 0;
    while (i < 400 || inside == 0 || refusals == 0) && std::time::Instant::now() < deadline {
        i += 1;
        match read(&c, "flip/f").await {
            Ok(d) => {
                assert_eq!(d, b"inside", "read through a swapped-in symlink");
                inside += 1;
            }
            Err(e) => {
                let code = e.code();
                assert!(
                    matches!(
                        code,
                        Some(
                            ErrorCode::PathEscape | ErrorCode::NotFound | ErrorCode::NotADirectory
                        )
                    ),
                    "unexpected error {e}"
                );
                refusals += 1;
            }
        }
        let _ = c.write_bytes(&format!("flip/planted{i}"), b"x").await;
        let _ = c.mkdir(&format!("flip/dir{i}"), false).await;
    }
    stop.store(true, Ordering::Relaxed);
    let swaps = flipper.join().unwrap();
    let leaked: Vec<_> = std::fs::read_dir(&outside)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n != "f")
        .collect();
    assert!(leaked.is_empty(), "created outside the root: {leaked:?}");
    assert_eq!(std::fs::read(outside.join("f")).unwrap(), b"SECRET");
    eprintln!("{swaps} swaps: {inside} reads inside, {refusals} refused");
    assert!(swaps > 100, "the race did not run");
    assert!(
        refusals > 0 && inside > 0,
        "the race never hit one side: {inside} / {refusals}"
    );
}

#[tokio::test]
async fn symlink_swapped_in_after_the_check_is_refused() {
    let agent = Agent::start();
    swap_race(&agent).await;
}

#[tokio::test]
async fn symlink_swapped_in_is_refused_by_the_fallback_walk() {
    let agent = Agent::start_with(&["--no-openat2"]);
    swap_race(&agent).await;
}

#[test]
fn layout_paths_are_what_the_suite_assumes() {
    // The suite's refusals rely on the temp dir being outside the root.
    let agent = Agent::start();
    assert!(!agent.dir.path().starts_with(&agent.root));
    assert!(Path::new(&agent.root).starts_with(agent.dir.path()));
}

/// A hard link made inside the root to a file outside it: neither a read nor any kind
/// of write goes through it to the outside inode, while a single-link file still works.
#[tokio::test]
async fn hard_links_to_outside_inodes_are_neither_read_nor_written() {
    use guest_agent::protocol::WriteMode;
    let agent = Agent::start();
    let outside = agent.dir.path().join("outside-secret");
    std::fs::write(&outside, b"SECRET").unwrap();
    std::fs::hard_link(&outside, agent.root.join("link")).unwrap();
    let c = agent.client();

    let r = read(&c, "link").await;
    assert!(
        !matches!(&r, Ok(d) if d == b"SECRET"),
        "read the outside inode through a hard link"
    );
    assert_eq!(r.unwrap_err().code(), Some(ErrorCode::PermissionDenied));
    let r = c
        .read_file("link", 0, None)
        .await
        .unwrap()
        .next_chunk()
        .await;
    assert_eq!(r.unwrap_err().code(), Some(ErrorCode::PermissionDenied));

    for mode in [WriteMode::Truncate, WriteMode::Append] {
        let opts = WriteOptions { mode, perm: None };
        let mut data = &b"OVERWRITTEN"[..];
        let r = c.write_file("link", opts, &mut data).await;
        assert_eq!(
            std::fs::read(&outside).unwrap(),
            b"SECRET",
            "{mode:?} changed the outside inode"
        );
        assert_eq!(r.unwrap_err().code(), Some(ErrorCode::PermissionDenied));
    }

    // Once the outside name is gone the file has one link and is the root's own.
    std::fs::remove_file(&outside).unwrap();
    assert_eq!(read(&c, "link").await.unwrap(), b"SECRET");
    c.write_bytes("link", b"mine").await.unwrap();
    assert_eq!(read(&c, "link").await.unwrap(), b"mine");
}
