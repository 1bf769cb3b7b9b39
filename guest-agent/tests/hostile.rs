//! The host client against a hostile agent: a fake server speaking the protocol that
//! sends answers over every bound. The client must refuse them without holding them.

use std::path::PathBuf;

use guest_agent::client::{Client, ClientConfig, ClientError, Endpoint};
use guest_agent::protocol::{
    Bytes, Entries, ErrorCode, ErrorMsg, FileInfo, FileKind, Identity, IdentityDone, Message,
    NetConfigure, NetConfigured, ReadData, ReadEnd, MAX_CHUNK,
};
use guest_agent::wire::{write_frame, FrameReader};
use tokio::net::UnixListener;

type Answer = Box<dyn Iterator<Item = Message> + Send>;

/// A fake agent on a Unix socket that answers every request with what `answer` yields
/// for it, produced lazily (so it never holds more than one frame either).
fn hostile(answer: fn(&Message) -> Answer) -> (Client, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let sock: PathBuf = dir.path().join("hostile.sock");
    let l = UnixListener::bind(&sock).unwrap();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(async move {
                let (r, mut w) = s.into_split();
                let mut r = FrameReader::new(r);
                while let Ok(Some(f)) = r.next().await {
                    for m in answer(&f.msg) {
                        if write_frame(&mut w, f.request_id, &m).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    let client = Client::new(Endpoint::Unix(sock), ClientConfig::default());
    (client, dir)
}

fn big_entry(i: usize) -> FileInfo {
    FileInfo {
        name: format!("{i:08}{}", "n".repeat(4000)),
        raw_name: None,
        kind: FileKind::File,
        size: 0,
        mode: 0o644,
        mtime_sec: 0,
        mtime_nsec: 0,
    }
}

/// 120 frames of 250 entries with 4 KB names each: 30 000 entries (far under the count
/// limit) but about 120 MB.
fn huge_listing(m: &Message) -> Answer {
    match m {
        Message::List(_) => Box::new((0..120).map(|f| {
            Entries {
                entries: (0..250).map(|i| big_entry(f * 250 + i)).collect(),
                more: f < 119,
            }
            .into()
        })),
        _ => Box::new(std::iter::empty()),
    }
}

#[tokio::test]
async fn a_listing_over_the_byte_budget_is_refused() {
    let (client, _dir) = hostile(huge_listing);
    match client.list("d").await {
        Err(ClientError::TooLarge { .. }) => {}
        Err(e) => panic!("refused for the wrong reason: {e}"),
        Ok(v) => panic!("accepted a listing of {} entries", v.len()),
    }
}

/// 16 MiB of data for any read, whatever length was asked.
fn long_read(m: &Message) -> Answer {
    match m {
        Message::Read(_) => Box::new(
            (0..64)
                .map(|_| {
                    ReadData {
                        data: Bytes::from(vec![b'x'; MAX_CHUNK]),
                    }
                    .into()
                })
                .chain(std::iter::once(
                    ReadEnd {
                        bytes: 64 * MAX_CHUNK as u64,
                        eof: true,
                    }
                    .into(),
                )),
        ),
        _ => Box::new(std::iter::empty()),
    }
}

#[tokio::test]
async fn a_read_longer_than_asked_is_refused() {
    let (client, _dir) = hostile(long_read);
    let mut r = client.read_file("f", 0, Some(16)).await.unwrap();
    let mut got = 0usize;
    let end = loop {
        match r.next_chunk().await {
            Ok(Some(c)) => got += c.len(),
            Ok(None) => break None,
            Err(e) => break Some(e),
        }
    };
    assert!(got <= 16, "asked for 16 bytes, was handed {got}");
    let e = end.expect("a read of 16 MiB for 16 bytes ended cleanly");
    assert!(
        matches!(e, ClientError::Overrun { asked: 16, .. }),
        "unclear error: {e}"
    );
    assert!(e.is_connection());

    // A download bounded to 16 bytes writes no more than that, and fails.
    let mut sink = Vec::new();
    let e = client.download("f", &mut sink, 16).await.unwrap_err();
    assert!(sink.len() <= 16, "{} bytes written", sink.len());
    assert!(matches!(e, ClientError::Overrun { .. }), "{e}");
}

/// Near-1-MiB texts wherever the agent may send text.
fn long_texts(m: &Message) -> Answer {
    let msg: Message = match m {
        Message::Stat(_) => ErrorMsg::new(ErrorCode::Io, "E".repeat(1_000_000)).into(),
        Message::Identity(_) => IdentityDone {
            errors: vec!["x".repeat(990); 1000],
            hostname: Some("h".repeat(10_000)),
            ..IdentityDone::default()
        }
        .into(),
        Message::NetConfigure(_) => NetConfigured {
            interface: "i".repeat(1_000_000),
        }
        .into(),
        _ => return Box::new(std::iter::empty()),
    };
    Box::new(std::iter::once(msg))
}

#[tokio::test]
async fn agent_texts_are_clipped() {
    let (client, _dir) = hostile(long_texts);
    let e = client.stat("f").await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::Io));
    assert!(
        e.to_string().len() < 8 << 10,
        "{} bytes",
        e.to_string().len()
    );

    let d = client.identity_refresh(Identity::default()).await.unwrap();
    let kept: usize = d.errors.iter().map(String::len).sum();
    assert!(kept < 128 << 10, "kept {kept} bytes of errors");
    assert!(d.hostname.unwrap().len() < 8 << 10);

    let name = client.net_configure(NetConfigure::default()).await.unwrap();
    assert!(name.len() < 8 << 10, "{} bytes", name.len());
}

/// Empty frames without end: `Entries { more: true }` for a listing, empty `ReadData`
/// for a read.
fn endless_empty_frames(m: &Message) -> Answer {
    match m {
        Message::List(_) => Box::new(std::iter::repeat_with(|| {
            Entries {
                entries: Vec::new(),
                more: true,
            }
            .into()
        })),
        Message::Read(_) => Box::new(std::iter::repeat_with(|| ReadData::default().into())),
        _ => Box::new(std::iter::empty()),
    }
}

#[tokio::test]
async fn endless_empty_frames_are_refused() {
    let (client, _dir) = hostile(endless_empty_frames);
    let limit = std::time::Duration::from_secs(10);
    let e = tokio::time::timeout(limit, client.list("d"))
        .await
        .expect("a listing of endless empty frames kept the client looping")
        .unwrap_err();
    assert!(matches!(e, ClientError::Unexpected { .. }), "{e}");
    let e = tokio::time::timeout(limit, client.read_to_vec("f", 16))
        .await
        .expect("a read of endless empty chunks kept the client looping")
        .unwrap_err();
    assert!(matches!(e, ClientError::Unexpected { .. }), "{e}");
}

/// A background process's events that go backwards, and an endless process listing.
fn lying_procs(m: &Message) -> Answer {
    use guest_agent::protocol::{Attached, ProcInfo, ProcOutput, Procs, StreamKind};
    match m {
        Message::Attach(_) => Box::new(
            [
                Attached {
                    exec_id: 1,
                    pid: 2,
                    running: true,
                    first_seq: 1,
                    next_seq: 9,
                }
                .into(),
                ProcOutput {
                    seq: 5,
                    stream: StreamKind::Stdout,
                    data: Bytes::from(b"x".to_vec()),
                }
                .into(),
                // Replayed again: a guest that numbers events backwards.
                ProcOutput {
                    seq: 5,
                    stream: StreamKind::Stdout,
                    data: Bytes::from(b"y".to_vec()),
                }
                .into(),
            ]
            .into_iter(),
        ),
        // Batches forever, each process with a 4 KiB command line.
        Message::ProcList(_) => Box::new((0..).map(|i| {
            Procs {
                procs: (0..8)
                    .map(|j| ProcInfo {
                        exec_id: i * 8 + j,
                        command: "c".repeat(4 << 10),
                        ..ProcInfo::default()
                    })
                    .collect(),
                more: true,
            }
            .into()
        })),
        _ => Box::new(std::iter::empty()),
    }
}

#[tokio::test]
async fn background_answers_over_the_bounds_are_refused() {
    let (client, _dir) = hostile(lying_procs);
    let mut s = client.attach(1, None).await.unwrap();
    assert_eq!(s.attached.next_seq, 9);
    assert!(s.next_event().await.unwrap().is_some());
    match s.next_event().await {
        Err(ClientError::Unexpected { .. }) => {}
        other => panic!("accepted an event numbered backwards: {other:?}"),
    }
    // The stream is over after a broken event.
    assert!(s.next_event().await.unwrap().is_none());
    match client.proc_list().await {
        Err(ClientError::TooLarge { limit, .. }) => {
            assert_eq!(limit, client.config().max_procs as u64)
        }
        other => panic!("accepted an endless listing: {:?}", other.map(|v| v.len())),
    }
}
