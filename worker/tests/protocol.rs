//! The worker protocol against a real worker process: bad frames, unknown
//! versions and oversized lengths close only their own connection; impossible
//! transitions are typed errors; a reconnecting client gets the same describe.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use sprout_tests::{require_kvm, testguest, TempDir};
use sprout_worker::protocol::{
    encode, read_frame, BootSpec, ErrorCode, Request, Response, Shape, WorkerState, HEADER_LEN,
};
use sprout_worker::{Client, WorkerCommand, WorkerProcess};

fn booted(dir: &std::path::Path) -> WorkerProcess {
    require_kvm();
    let cmd = WorkerCommand::new(env!("CARGO_BIN_EXE_sprout-worker"));
    let mut w = cmd.spawn(&dir.join("w.sock"), None, None).unwrap();
    let mut c = vmm::VmConfig::new(testguest());
    c.mem_mib = 128;
    w.client
        .call(&Request::Boot(BootSpec {
            spec: c.spec(),
            instance_id: None,
        }))
        .unwrap();
    w
}

/// Sends raw bytes on a new connection; the error code answered, then
/// checks the worker closed that connection.
fn raw(sock: &std::path::Path, bytes: &[u8]) -> ErrorCode {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(bytes).unwrap();
    let code = match read_frame::<Response>(&mut s).unwrap() {
        Some(Response::Error(e)) => e.code,
        other => panic!("expected an error, got {other:?}"),
    };
    let mut rest = Vec::new();
    assert_eq!(s.read_to_end(&mut rest).unwrap(), 0, "connection closed");
    code
}

#[test]
fn bad_frames_close_only_their_connection() {
    let dir = TempDir::new("wproto");
    let mut w = booted(dir.path());
    // A second connection held open across the bad ones.
    let mut other = Client::connect(&w.socket).unwrap();
    let before = other.describe().unwrap();

    assert_eq!(
        raw(&w.socket, b"GET / HTTP/1.1\r\n\r\n"),
        ErrorCode::BadFrame
    );
    let mut v9 = encode(&Request::Describe).unwrap();
    v9[4..6].copy_from_slice(&9u16.to_le_bytes());
    assert_eq!(raw(&w.socket, &v9), ErrorCode::UnsupportedVersion);
    let mut huge = encode(&Request::Describe).unwrap();
    huge[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(
        raw(&w.socket, &huge[..HEADER_LEN]),
        ErrorCode::FrameTooLarge
    );
    let mut junk = encode(&Request::Describe).unwrap();
    junk.truncate(HEADER_LEN);
    junk[8..12].copy_from_slice(&3u32.to_le_bytes());
    junk.extend_from_slice(&[0xff, 0xff, 0xff]);
    assert_eq!(raw(&w.socket, &junk), ErrorCode::BadRequest);
    // A client that hangs up mid-frame harms nobody.
    drop(UnixStream::connect(&w.socket).unwrap().write_all(&v9[..5]));

    // The held connection and a new one both still work, and agree.
    assert_eq!(other.describe().unwrap(), before);
    let mut again = Client::connect(&w.socket).unwrap();
    assert_eq!(
        again.describe().unwrap(),
        before,
        "re-adoption sees the same worker"
    );
    assert_eq!(before.state, WorkerState::Running);
    assert_eq!(before.pid, w.pid());
    w.client.stop().unwrap();
    w.child.wait().unwrap();
}

#[test]
fn impossible_transitions_are_typed_errors() {
    let dir = TempDir::new("wtrans");
    let mut w = booted(dir.path());
    let c = &mut w.client;
    assert_eq!(
        c.resume().unwrap_err().code(),
        Some(ErrorCode::InvalidState)
    );
    c.pause().unwrap();
    let e = c.pause().unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::InvalidState), "{e}");
    assert!(e.to_string().contains("paused"), "{e}");
    assert_eq!(c.describe().unwrap().state, WorkerState::Paused);
    c.resume().unwrap();
    let e = c.snapshot(&dir.path().join("d"), true).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::NoParent), "{e}");
    let e = c
        .call(&Request::Boot(BootSpec {
            spec: vmm::VmConfig::new(testguest()).spec(),
            instance_id: None,
        }))
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::HasVm));
    // A snapshot into an existing directory is refused, the VM unharmed.
    let e = c.snapshot(dir.path(), false).unwrap_err();
    assert!(e.code().is_some(), "{e}");
    c.snapshot(&dir.path().join("full"), false).unwrap();
    c.snapshot(&dir.path().join("diff"), true).unwrap();
    let m = c.metrics().unwrap();
    assert!(m.rss_kib > 0 && m.pss_kib > 0, "{m:?}");
    c.stop().unwrap();
    w.child.wait().unwrap();
    assert!(
        Client::connect(&w.socket).is_err(),
        "an ended worker is gone"
    );
}

#[test]
fn a_ready_worker_has_no_vm_to_drive() {
    require_kvm();
    let dir = TempDir::new("wready");
    let cmd = WorkerCommand::new(env!("CARGO_BIN_EXE_sprout-worker"));
    let shape = Shape {
        vcpus: 2,
        mem_mib: 128,
    };
    let mut w = cmd
        .spawn(&dir.path().join("r.sock"), Some(shape), None)
        .unwrap();
    let d = w.client.describe().unwrap();
    assert_eq!(d.state, WorkerState::Ready);
    assert_eq!(d.shape, Some(shape));
    for req in [Request::Pause, Request::Resume, Request::Metrics] {
        let r = w.client.call(&req);
        if req == Request::Metrics {
            assert!(r.is_ok());
        } else {
            assert_eq!(r.unwrap_err().code(), Some(ErrorCode::NoVm), "{req:?}");
        }
    }
    let e = w
        .client
        .mailbox(0, 1, [0; 4], Duration::from_secs(1))
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::NoVm));
    w.client.stop().unwrap();
    assert!(w.child.wait().unwrap().success());
}
