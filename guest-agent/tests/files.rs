//! File requests against the agent run as a host process.

mod common;

use std::os::unix::fs::PermissionsExt;

use common::{noise, sha256_hex, Agent};
use guest_agent::client::WriteOptions;
use guest_agent::protocol::{ErrorCode, FileKind, WriteMode};
use sha2::Digest;

#[tokio::test]
async fn fifty_mib_write_and_read_round_trip() {
    let agent = Agent::start();
    let client = agent.client();
    client.mkdir("big/nested", true).await.unwrap();
    let data = noise(50 << 20, 7);
    let want = sha256_hex(&data);

    let mut src = &data[..];
    let n = client
        .write_file("big/nested/blob", WriteOptions::default(), &mut src)
        .await
        .unwrap();
    assert_eq!(n, data.len() as u64);
    let on_disk = std::fs::read(agent.root.join("big/nested/blob")).unwrap();
    assert_eq!(sha256_hex(&on_disk), want);
    drop(on_disk);

    // Read it back chunk by chunk, hashing as it comes.
    let mut r = client.read_file("big/nested/blob", 0, None).await.unwrap();
    let mut h = sha2::Sha256::new();
    let mut chunks = 0;
    while let Some(c) = r.next_chunk().await.unwrap() {
        assert!(c.len() <= guest_agent::protocol::MAX_CHUNK);
        h.update(&c);
        chunks += 1;
    }
    assert_eq!(r.received(), data.len() as u64);
    assert!(r.hit_eof());
    assert!(
        chunks >= 200,
        "{chunks} chunks: the file did not move in chunks"
    );
    assert_eq!(common::hex(&h.finalize()), want);

    // A range from the middle.
    let mut r = client
        .read_file("big/nested/blob", (1 << 20) + 7, Some(100_000))
        .await
        .unwrap();
    let mut got = Vec::new();
    while let Some(c) = r.next_chunk().await.unwrap() {
        got.extend(c);
    }
    assert_eq!(got, &data[(1 << 20) + 7..(1 << 20) + 7 + 100_000]);
    assert!(!r.hit_eof());
    // Past the end: nothing, and eof.
    let mut r = client
        .read_file("big/nested/blob", 60 << 20, None)
        .await
        .unwrap();
    assert!(r.next_chunk().await.unwrap().is_none());
    assert!(r.hit_eof());

    let mut sink = Vec::new();
    let n = client
        .download("big/nested/blob", &mut sink, u64::MAX)
        .await
        .unwrap();
    assert_eq!(n, data.len() as u64);
    assert_eq!(sha256_hex(&sink), want);
}

#[tokio::test]
async fn list_stat_mkdir_rename_remove() {
    let agent = Agent::start();
    let client = agent.client();
    client.mkdir("a/b/c", true).await.unwrap();
    client.mkdir("a/b/c", true).await.unwrap();
    let e = client.mkdir("a/b", false).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::AlreadyExists));
    let e = client.mkdir("x/y", false).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::NotFound));
    client.write_bytes("a/f.txt", b"hello").await.unwrap();
    std::os::unix::fs::symlink("b/c", agent.root.join("a/link")).unwrap();
    std::fs::set_permissions(
        agent.root.join("a/f.txt"),
        std::fs::Permissions::from_mode(0o640),
    )
    .unwrap();

    let mut entries = client.list("a").await.unwrap();
    entries.sort_by(|x, y| x.name.cmp(&y.name));
    let got: Vec<_> = entries
        .iter()
        .map(|e| (e.name.as_str(), e.kind, e.size))
        .collect();
    assert_eq!(
        got,
        [
            ("b", FileKind::Dir, entries[0].size),
            ("f.txt", FileKind::File, 5),
            ("link", FileKind::Symlink, 3)
        ]
    );
    assert_eq!(entries[1].mode, 0o640);
    let mtime = std::fs::metadata(agent.root.join("a/f.txt"))
        .unwrap()
        .modified()
        .unwrap()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    assert_eq!(entries[1].mtime_sec, mtime.as_secs() as i64);
    assert_eq!(entries[1].mtime_nsec, mtime.subsec_nanos());

    let st = client.stat("a/f.txt").await.unwrap();
    assert_eq!(
        (st.name.as_str(), st.kind, st.size, st.mode),
        ("f.txt", FileKind::File, 5, 0o640)
    );
    assert_eq!(client.stat("a/link").await.unwrap().kind, FileKind::Symlink);
    assert_eq!(client.stat("").await.unwrap().kind, FileKind::Dir);
    assert_eq!(
        client.stat("/").await.unwrap_err().code(),
        Some(ErrorCode::PathEscape)
    );
    let e = client.stat("a/nope").await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::NotFound));
    let e = client.list("a/f.txt").await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::NotADirectory));

    // A large directory comes in several batches.
    client.mkdir("many", false).await.unwrap();
    for i in 0..700 {
        std::fs::write(agent.root.join(format!("many/{i:04}")), b"").unwrap();
    }
    assert_eq!(client.list("many").await.unwrap().len(), 700);
    // Non-UTF-8 names are reported lossily with their raw bytes.
    let raw = std::ffi::OsStr::new(unsafe_free_name());
    std::fs::write(agent.root.join("many").join(raw), b"").unwrap();
    let odd: Vec<_> = client
        .list("many")
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.raw_name.is_some())
        .collect();
    assert_eq!(odd.len(), 1);
    assert_eq!(
        odd[0].raw_name.as_ref().map(|b| b.to_vec()),
        Some(b"bad\xffname".to_vec())
    );

    client.rename("a/f.txt", "a/b/c/g.txt").await.unwrap();
    assert_eq!(
        std::fs::read(agent.root.join("a/b/c/g.txt")).unwrap(),
        b"hello"
    );
    // Reading through a symlink that stays inside works.
    assert_eq!(
        client.read_to_vec("a/link/g.txt", 100).await.unwrap(),
        b"hello"
    );
    let e = client.read_to_vec("a/link/g.txt", 2).await.unwrap_err();
    assert!(matches!(
        e,
        guest_agent::client::ClientError::TooLarge { .. }
    ));

    let e = client.remove("a", false).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::NotEmpty));
    client.remove("a/link", false).await.unwrap();
    assert!(
        agent.root.join("a/b/c/g.txt").exists(),
        "removing a symlink removed its target"
    );
    client.remove("a", true).await.unwrap();
    assert!(!agent.root.join("a").exists());
    let e = client.remove("", true).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::InvalidPath));
    assert!(agent.root.exists());
}

fn unsafe_free_name() -> &'static std::ffi::OsStr {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::OsStr::from_bytes(b"bad\xffname")
}

#[tokio::test]
async fn write_modes_and_permissions() {
    let agent = Agent::start();
    let client = agent.client();
    let new = WriteOptions {
        mode: WriteMode::CreateNew,
        perm: Some(0o600),
    };
    client.write_file("f", new, &mut &b"one"[..]).await.unwrap();
    let mode = std::fs::metadata(agent.root.join("f"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let e = client
        .write_file("f", new, &mut &b"two"[..])
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::AlreadyExists));
    let append = WriteOptions {
        mode: WriteMode::Append,
        perm: None,
    };
    client
        .write_file("f", append, &mut &b"+two"[..])
        .await
        .unwrap();
    assert_eq!(std::fs::read(agent.root.join("f")).unwrap(), b"one+two");
    client.write_bytes("f", b"3").await.unwrap();
    assert_eq!(std::fs::read(agent.root.join("f")).unwrap(), b"3");
    // Directories and special files are not written or read as files.
    client.mkdir("d", false).await.unwrap();
    let e = client.write_bytes("d", b"x").await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::IsADirectory));
    let e = client.read_to_vec("d", 10).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::IsADirectory));
    rustix::fs::mknodat(
        rustix::fs::CWD,
        agent.root.join("fifo"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();
    let e = client.read_to_vec("fifo", 10).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::BadRequest), "{e}");
    // An empty file.
    client.write_bytes("empty", b"").await.unwrap();
    assert_eq!(client.read_to_vec("empty", 10).await.unwrap(), b"");
    // The connection pool survived all the errors.
    client.ping().await.unwrap();
}

/// Threads of process `pid`.
fn threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .count()
}

/// The blocking-pool thread a file request ran on is still there after more
/// than tokio's default 10 s of idleness. A guest snapshotted after a quiet
/// spell then still has one, and the identity refresh after a restore (a
/// blocking job on the path to the first exec) does not have to start a
/// thread, which costs milliseconds where guest kernel code is emulated.
#[tokio::test]
async fn an_idle_blocking_pool_thread_outlives_ten_quiet_seconds() {
    let agent = Agent::start();
    let client = agent.client();
    client.mkdir("d", false).await.unwrap();
    let busy = threads(agent.pid());
    assert!(busy >= 2, "{busy} threads after a file request");
    // The quiet spell itself is what is tested: tokio's default would let
    // the idle thread go after 10 s.
    tokio::time::sleep(std::time::Duration::from_secs(12)).await;
    assert_eq!(
        threads(agent.pid()),
        busy,
        "an idle thread of the agent exited"
    );
    // And the request after the quiet spell is answered.
    assert_eq!(client.stat("d").await.unwrap().kind, FileKind::Dir);
}
