//! fc-peer: drives a Firecracker binary through its API socket, so that
//! `tests/lab/bench-peer.sh` can time Firecracker's boot and restore beside
//! Sprout's in one lab run, with the same guest and the same agent client.
//!
//! ```text
//! fc-peer boot     --firecracker BIN --dir DIR --kernel VMLINUX --rootfs IMG --disk IMG
//!                  [--cpus N] [--memory-mib M]
//! fc-peer snapshot --dir DIR --out SNAPDIR
//! fc-peer restore  --firecracker BIN --dir DIR --snapshot SNAPDIR
//! fc-peer exec     --dir DIR --command CMD
//! fc-peer stop     --dir DIR
//! ```
//!
//! `DIR` holds the API socket (`api.sock`), the vsock socket (`v.sock`), the
//! process id (`pid`) and Firecracker's output (`fc.log`). Each command prints
//! `NAME MICROSECONDS` lines, the way `bench-sandbox.sh` reads Sprout's log:
//!
//! * boot: `fc_boot_spawn_start` (process spawn to the `InstanceStart` answer,
//!   Firecracker's "process spawn to VM start"), `fc_boot_start_agent` (from
//!   there to the agent's first answer); the VM keeps running.
//! * snapshot: `fc_snapshot` (pause and full snapshot); the VM is stopped.
//! * restore: `fc_restore_running` (from the `/snapshot/load` request, with
//!   `resume_vm`, to its answer), `fc_restore_agent`, `fc_restore_exec` (the
//!   first `true` ended), all from the request, as Sprout's `vm restore`
//!   times from the start of its restore; the process is spawned and its API
//!   socket up before the clock starts. The VM is stopped after.
//! * exec: runs `CMD` with `/bin/sh -c` in the running VM, its output on stdout.
//!
//! The agent is polled every 20 ms, as Sprout's `agent::wait_ready` does. The
//! HTTP client is the few lines Firecracker's API needs (one request per
//! connection over a Unix socket): the HTTP crates in this workspace do not
//! speak over Unix sockets.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use guest_agent::client::{Client, ClientConfig, Endpoint, ExecEvent};
use guest_agent::protocol::{Exec, DEFAULT_VSOCK_PORT};

const POLL: Duration = Duration::from_millis(20);
const LIMIT: Duration = Duration::from_secs(180);
const BOOT_ARGS: &str = "console=ttyS0 quiet reboot=k panic=-1 pci=off rootfstype=ext4 \
                         init=/sbin/sprout-init RUST_LOG=warn";

struct Opts {
    firecracker: Option<PathBuf>,
    dir: PathBuf,
    kernel: Option<PathBuf>,
    rootfs: Option<PathBuf>,
    disk: Option<PathBuf>,
    out: Option<PathBuf>,
    snapshot: Option<PathBuf>,
    command: Option<String>,
    cpus: u32,
    memory_mib: u32,
}

fn parse(args: &[String]) -> Result<Opts, String> {
    let mut o = Opts {
        firecracker: None,
        dir: PathBuf::new(),
        kernel: None,
        rootfs: None,
        disk: None,
        out: None,
        snapshot: None,
        command: None,
        cpus: 1,
        memory_mib: 256,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().cloned().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--firecracker" => o.firecracker = Some(val()?.into()),
            "--dir" => o.dir = val()?.into(),
            "--kernel" => o.kernel = Some(val()?.into()),
            "--rootfs" => o.rootfs = Some(val()?.into()),
            "--disk" => o.disk = Some(val()?.into()),
            "--out" => o.out = Some(val()?.into()),
            "--snapshot" => o.snapshot = Some(val()?.into()),
            "--command" => o.command = Some(val()?),
            "--cpus" => o.cpus = val()?.parse().map_err(|e| format!("--cpus: {e}"))?,
            "--memory-mib" => {
                o.memory_mib = val()?.parse().map_err(|e| format!("--memory-mib: {e}"))?
            }
            _ => return Err(format!("unknown argument {a}")),
        }
    }
    if o.dir.as_os_str().is_empty() {
        return Err("--dir is needed".into());
    }
    Ok(o)
}

fn need<'a>(v: &'a Option<PathBuf>, name: &str) -> Result<&'a Path, String> {
    v.as_deref().ok_or(format!("{name} is needed"))
}

/// One HTTP/1.1 request on a new connection; the status code and body.
fn http(sock: &Path, method: &str, path: &str, body: &str) -> Result<(u16, String), String> {
    let mut s = UnixStream::connect(sock).map_err(|e| format!("{}: {e}", sock.display()))?;
    s.set_read_timeout(Some(LIMIT)).map_err(|e| e.to_string())?;
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).map_err(|e| e.to_string())?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let (head_end, len) = loop {
        let n = s.read(&mut chunk).map_err(|e| e.to_string())?;
        if n == 0 {
            return Err(format!("{method} {path}: the connection closed mid-answer"));
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > 1 << 20 {
            return Err(format!("{method} {path}: answer over 1 MiB"));
        }
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..i]).to_ascii_lowercase();
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            break (i + 4, len.min(1 << 20));
        }
    };
    while buf.len() < head_end + len {
        let n = s.read(&mut chunk).map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let head = String::from_utf8_lossy(&buf[..head_end]);
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or(format!("{method} {path}: no status line in {head:?}"))?;
    let body = String::from_utf8_lossy(&buf[head_end..]).into_owned();
    Ok((code, body))
}

fn api(dir: &Path, method: &str, path: &str, body: &str) -> Result<(), String> {
    match http(&dir.join("api.sock"), method, path, body)? {
        (200..=299, _) => Ok(()),
        (code, body) => Err(format!("{method} {path}: HTTP {code}: {body}")),
    }
}

/// Spawns Firecracker in `dir` and waits for its API socket.
fn spawn(fc: &Path, dir: &Path) -> Result<Instant, String> {
    for f in ["api.sock", "v.sock"] {
        let _ = std::fs::remove_file(dir.join(f));
    }
    let log = std::fs::File::create(dir.join("fc.log")).map_err(|e| e.to_string())?;
    let t = Instant::now();
    let child = Command::new(fc)
        .arg("--api-sock")
        .arg(dir.join("api.sock"))
        .stdin(Stdio::null())
        .stdout(log.try_clone().map_err(|e| e.to_string())?)
        .stderr(log)
        .spawn()
        .map_err(|e| format!("{}: {e}", fc.display()))?;
    std::fs::write(dir.join("pid"), child.id().to_string()).map_err(|e| e.to_string())?;
    while UnixStream::connect(dir.join("api.sock")).is_err() {
        if t.elapsed() > LIMIT {
            return Err("Firecracker's API socket never came up".into());
        }
        std::thread::sleep(Duration::from_micros(500));
    }
    Ok(t)
}

fn stop(dir: &Path) -> Result<(), String> {
    let pid = std::fs::read_to_string(dir.join("pid")).map_err(|e| e.to_string())?;
    let pid = pid.trim();
    let _ = Command::new("kill").args(["-9", pid]).status();
    let t = Instant::now();
    while Path::new(&format!("/proc/{pid}/stat")).exists() {
        // A zombie of ours is gone for this purpose: its parent (fc-peer) has exited.
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        if stat.contains(") Z ") || t.elapsed() > LIMIT {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

/// Pings the agent until it answers, then runs `command` (if any) through the
/// shell, its output copied to this process's; the times of both from `t0`.
fn agent(
    dir: &Path,
    t0: Instant,
    command: Option<&str>,
) -> Result<(Duration, Option<Duration>), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async {
        let client = Client::new(
            Endpoint::Vsock {
                uds_path: dir.join("v.sock"),
                port: DEFAULT_VSOCK_PORT,
            },
            ClientConfig {
                connect_timeout: Duration::from_secs(2),
                ..ClientConfig::default()
            },
        );
        loop {
            match client.ping().await {
                Ok(_) => break,
                Err(e) if t0.elapsed() > LIMIT => return Err(format!("agent: {e}")),
                Err(_) => tokio::time::sleep(POLL).await,
            }
        }
        let ready = t0.elapsed();
        let Some(command) = command else {
            return Ok((ready, None));
        };
        let req = Exec {
            command: command.into(),
            shell: true,
            ..Exec::default()
        };
        let mut s = client.exec(req).await.map_err(|e| e.to_string())?;
        loop {
            match s.next_event().await.map_err(|e| e.to_string())? {
                Some(ExecEvent::Exit(e)) if e.code == Some(0) => break,
                Some(ExecEvent::Exit(e)) => return Err(format!("{command} ended with {e:?}")),
                Some(ExecEvent::Stdout(d)) => {
                    let _ = std::io::stdout().write_all(&d);
                }
                Some(_) => {}
                None => return Err("the exec's connection closed".into()),
            }
        }
        Ok((ready, Some(t0.elapsed())))
    })
}

fn us(d: Duration) -> u128 {
    d.as_micros()
}

fn boot(o: &Opts) -> Result<(), String> {
    let fc = need(&o.firecracker, "--firecracker")?;
    let kernel = need(&o.kernel, "--kernel")?;
    let rootfs = need(&o.rootfs, "--rootfs")?;
    let disk = need(&o.disk, "--disk")?;
    let t0 = spawn(fc, &o.dir)?;
    let d = &o.dir;
    let json = |v: serde_json::Value| v.to_string();
    api(
        d,
        "PUT",
        "/machine-config",
        &json(serde_json::json!({"vcpu_count": o.cpus, "mem_size_mib": o.memory_mib})),
    )?;
    api(
        d,
        "PUT",
        "/boot-source",
        &json(serde_json::json!({"kernel_image_path": kernel, "boot_args": BOOT_ARGS})),
    )?;
    api(
        d,
        "PUT",
        "/drives/rootfs",
        &json(
            serde_json::json!({"drive_id": "rootfs", "path_on_host": rootfs,
                                  "is_root_device": true, "is_read_only": true}),
        ),
    )?;
    api(
        d,
        "PUT",
        "/drives/disk",
        &json(serde_json::json!({"drive_id": "disk", "path_on_host": disk,
                                  "is_root_device": false, "is_read_only": false})),
    )?;
    api(
        d,
        "PUT",
        "/vsock",
        &json(serde_json::json!({"guest_cid": 3, "uds_path": d.join("v.sock")})),
    )?;
    api(d, "PUT", "/actions", r#"{"action_type":"InstanceStart"}"#)?;
    let started = t0.elapsed();
    let t1 = Instant::now();
    let (ready, _) = agent(d, t1, None)?;
    println!("fc_boot_spawn_start {}", us(started));
    println!("fc_boot_start_agent {}", us(ready));
    Ok(())
}

fn snapshot(o: &Opts) -> Result<(), String> {
    let out = need(&o.out, "--out")?;
    std::fs::create_dir_all(out).map_err(|e| e.to_string())?;
    let t = Instant::now();
    api(&o.dir, "PATCH", "/vm", r#"{"state":"Paused"}"#)?;
    api(
        &o.dir,
        "PUT",
        "/snapshot/create",
        &serde_json::json!({"snapshot_type": "Full", "snapshot_path": out.join("vmstate"),
                            "mem_file_path": out.join("mem")})
        .to_string(),
    )?;
    println!("fc_snapshot {}", us(t.elapsed()));
    stop(&o.dir)
}

fn restore(o: &Opts) -> Result<(), String> {
    let fc = need(&o.firecracker, "--firecracker")?;
    let snap = need(&o.snapshot, "--snapshot")?;
    spawn(fc, &o.dir)?;
    let t0 = Instant::now();
    let r = api(
        &o.dir,
        "PUT",
        "/snapshot/load",
        &serde_json::json!({"snapshot_path": snap.join("vmstate"),
                            "mem_backend": {"backend_type": "File", "backend_path": snap.join("mem")},
                            "resume_vm": true})
        .to_string(),
    )
    .and_then(|()| {
        let running = t0.elapsed();
        let (ready, exec) = agent(&o.dir, t0, Some("true"))?;
        println!("fc_restore_running {}", us(running));
        println!("fc_restore_agent {}", us(ready));
        println!("fc_restore_exec {}", us(exec.unwrap_or_default()));
        Ok(())
    });
    stop(&o.dir)?;
    r
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((cmd, rest)) = args.split_first() else {
        eprintln!("usage: fc-peer (boot|snapshot|restore|exec|stop) --dir DIR ...");
        return ExitCode::from(2);
    };
    let r = parse(rest).and_then(|o| match cmd.as_str() {
        "boot" => boot(&o),
        "snapshot" => snapshot(&o),
        "restore" => restore(&o),
        "stop" => stop(&o.dir),
        "exec" => o
            .command
            .as_deref()
            .ok_or("--command is needed".to_string())
            .and_then(|c| agent(&o.dir, Instant::now(), Some(c)).map(drop)),
        _ => Err(format!("unknown command {cmd}")),
    });
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fc-peer {cmd}: {e}");
            ExitCode::FAILURE
        }
    }
}
