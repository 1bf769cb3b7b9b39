//! `sprout create|ls|get|exec|pause|…`: the sandbox commands of the CLI, a
//! client of `sproutd`'s REST API (docs/api.md) and nothing else: whatever
//! they do, the API does. Human tables by default, the server's own JSON
//! with `--json`; an error names the server's code and message and exits 1.
//!
//! They speak HTTP/1.1 over TCP with [`crate::daemon::api_client`] (the
//! client `sprout api` uses, which the busybox-only lab can run too).

use std::collections::BTreeMap;
use std::io::{IsTerminal, Read, Write};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Subcommand};
use serde_json::{json, Value};

use crate::daemon::api_client::{request, ApiClientError, Request};

/// Where the sproutd is, and how to talk to it (every sandbox command).
#[derive(Args, Clone)]
pub struct Conn {
    /// The sproutd to talk to: `http://HOST:PORT` (or `HOST:PORT`).
    #[arg(
        long,
        global = true,
        env = "SPROUT_URL",
        default_value = "http://127.0.0.1:7070"
    )]
    pub url: String,
    /// The API key of a sproutd run with --tenants (sent as `Authorization:
    /// Bearer KEY`).
    #[arg(long, global = true, env = "SPROUT_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Print the server's JSON answer instead of a table (for scripts).
    #[arg(long, global = true)]
    pub json: bool,
}

/// The sandbox commands.
#[derive(Subcommand)]
pub enum SandboxCmd {
    /// Create a sandbox (from an image, or a snapshot) and print it once it runs.
    Create(CreateArgs),
    /// List sandboxes, oldest first.
    Ls(LsArgs),
    /// Show one sandbox.
    Get(Id),
    /// Delete sandboxes (their worker, disk and checkpoints).
    Rm(Ids),
    /// Run a command in a sandbox: its output as it happens, its stdin (when
    /// piped) fed to it, and its exit status as sprout's.
    Exec(ExecArgs),
    /// Pause a running sandbox (its VM stops; its worker stays).
    Pause(Id),
    /// Resume a paused sandbox.
    Resume(Id),
    /// Put a sandbox to sleep: a snapshot, its worker freed (the next exec wakes it).
    Sleep(Id),
    /// Hibernate a sandbox: as sleep, kept until woken explicitly.
    Hibernate(Id),
    /// Wake a sleeping or hibernated sandbox.
    Wake(Id),
    /// Reboot a sandbox's guest (its disk kept).
    Reboot(Id),
    /// Snapshot a sandbox; prints the snapshot.
    Snapshot(Id),
    /// Fork a sandbox into N children that run on from its state now.
    Fork(ForkArgs),
    /// Checkpoints: named snapshots of a sandbox.
    #[command(subcommand)]
    Checkpoint(CheckpointCmd),
    /// Copy a file into a sandbox (`cp LOCAL ID:PATH`) or out of one (`cp
    /// ID:PATH LOCAL`); `-` is stdin or stdout. Any size, streamed.
    Cp(CpArgs),
    /// A sandbox's files (beneath /workspace).
    #[command(subcommand)]
    Files(FilesCmd),
    /// List a sandbox's background processes.
    Ps(Id),
    /// Attach to a background process: its kept output, then its live
    /// output to its end; exits with its status.
    Attach(AttachArgs),
    /// Send a signal to a background process (its whole process group).
    Kill(KillArgs),
    /// A sandbox's TCP ports, served by sproutd over HTTP at URLs of their own.
    #[command(subcommand)]
    Ports(PortsCmd),
}

#[derive(Subcommand)]
pub enum PortsCmd {
    /// Serve a guest port; prints its URL.
    Open {
        /// The sandbox.
        id: String,
        /// The guest's TCP port (on its loopback).
        port: u16,
        /// Reachable without an API key.
        #[arg(long)]
        public: bool,
    },
    /// List a sandbox's open ports.
    Ls(Id),
    /// Stop serving a port.
    Close {
        /// The sandbox.
        id: String,
        /// The port.
        port: u16,
    },
}

#[derive(Args)]
pub struct CpArgs {
    /// What to copy: a local file, `-` (stdin), or `ID:PATH`.
    pub src: String,
    /// Where to: a local file or directory, `-` (stdout), or `ID:PATH` (a
    /// PATH that is a directory, or ends in `/`, gets the source's name).
    pub dst: String,
    /// Show progress even when stderr is not a terminal (a line per 10%).
    #[arg(long)]
    pub progress: bool,
}

#[derive(Subcommand)]
pub enum FilesCmd {
    /// List a directory (default: /workspace).
    Ls {
        /// The sandbox.
        id: String,
        /// The directory, relative to /workspace or absolute beneath it.
        #[arg(default_value = ".")]
        path: String,
    },
    /// Make a directory.
    Mkdir {
        /// The sandbox.
        id: String,
        /// The directory.
        path: String,
        /// Make its parents too, and do not mind if it exists.
        #[arg(short, long)]
        parents: bool,
    },
    /// Delete a file or an empty directory.
    Rm {
        /// The sandbox.
        id: String,
        /// The path.
        path: String,
        /// A directory and everything in it.
        #[arg(short, long)]
        recursive: bool,
    },
}

#[derive(Args)]
pub struct AttachArgs {
    /// The sandbox.
    pub id: String,
    /// The process's exec id (`sprout ps` lists them).
    pub exec_id: u64,
    /// Only the events after this event id (default: every kept one).
    #[arg(long, value_name = "EVENT_ID")]
    pub after: Option<u64>,
}

#[derive(Args)]
pub struct KillArgs {
    /// The sandbox.
    pub id: String,
    /// The process's exec id.
    pub exec_id: u64,
    /// A signal name (TERM, KILL, INT, HUP, ...) or number.
    #[arg(short, long, default_value = "TERM")]
    pub signal: String,
}

#[derive(Subcommand)]
pub enum CheckpointCmd {
    /// Take a checkpoint of a sandbox.
    Create {
        /// The sandbox.
        id: String,
        /// The checkpoint's name.
        name: String,
    },
    /// List a sandbox's checkpoints.
    Ls(Id),
    /// Make a sandbox what it was at a checkpoint (everything since is gone).
    Restore {
        /// The checkpoint's id.
        checkpoint: String,
    },
    /// A new sandbox from a checkpoint.
    Spawn {
        /// The checkpoint's id.
        checkpoint: String,
    },
    /// Delete a checkpoint.
    Rm {
        /// The checkpoint's id.
        checkpoint: String,
    },
}

#[derive(Args)]
pub struct Id {
    /// The sandbox's id.
    pub id: String,
}

#[derive(Args)]
pub struct Ids {
    /// The sandboxes' ids.
    #[arg(required = true)]
    pub ids: Vec<String>,
}

#[derive(Args)]
pub struct CreateArgs {
    /// An image `sprout info` lists, or an OCI reference (REGISTRY/NAME:TAG,
    /// oci:/PATH:TAG) sproutd pulls (default: sproutd's default image).
    #[arg(long)]
    pub image: Option<String>,
    /// `container` (default: the agent is PID 1 and starts the image's
    /// entrypoint) or `vm` (the image's own systemd is PID 1).
    #[arg(long, value_parser = ["container", "vm"])]
    pub runtime: Option<String>,
    /// A snapshot or checkpoint id to restore from (its image, runtime and
    /// shape).
    #[arg(long, conflicts_with_all = ["image", "runtime", "cpus", "memory"])]
    pub snapshot: Option<String>,
    /// vCPUs.
    #[arg(long)]
    pub cpus: Option<i64>,
    /// Memory in MiB.
    #[arg(long)]
    pub memory: Option<i64>,
    /// Metadata, `KEY=VALUE` (repeatable).
    #[arg(long = "meta", value_name = "KEY=VALUE", value_parser = pair)]
    pub meta: Vec<(String, String)>,
    /// Environment of every exec, `NAME=VALUE` (repeatable).
    #[arg(long = "env", value_name = "NAME=VALUE", value_parser = pair)]
    pub env: Vec<(String, String)>,
    /// Put it to sleep after this many seconds without a call.
    #[arg(long, value_name = "SECS")]
    pub idle_timeout: Option<i64>,
    /// No egress at all (`disableInternet`): exec, files and ports still work.
    #[arg(long)]
    pub no_internet: bool,
}

#[derive(Args)]
pub struct LsArgs {
    /// Only those whose metadata has `KEY=VALUE` (repeatable: all must match).
    #[arg(long = "meta", value_name = "KEY=VALUE", value_parser = pair)]
    pub meta: Vec<(String, String)>,
}

#[derive(Args)]
pub struct ForkArgs {
    /// The sandbox.
    pub id: String,
    /// How many children.
    #[arg(short = 'n', long = "count", default_value_t = 1)]
    pub count: i64,
}

#[derive(Args)]
pub struct ExecArgs {
    /// The sandbox.
    pub id: String,
    /// The working directory (default /workspace).
    #[arg(long)]
    pub cwd: Option<String>,
    /// Extra environment, `NAME=VALUE` (repeatable).
    #[arg(long = "env", value_name = "NAME=VALUE", value_parser = pair)]
    pub env: Vec<(String, String)>,
    /// Kill it (and its children) after this many seconds.
    #[arg(long, value_name = "SECS")]
    pub timeout: Option<u64>,
    /// Start it in the background and print its exec id (`sprout attach`
    /// follows it, `sprout kill` signals it).
    #[arg(short = 'd', long)]
    pub background: bool,
    /// With --background: keep its stdin open for later writes through the
    /// API (`POST .../processes/{execId}/stdin`).
    #[arg(long, requires = "background")]
    pub stdin_open: bool,
    /// The program and its arguments (after `--`).
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    pub command: Vec<String>,
}

fn pair(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("{s:?} is not KEY=VALUE")),
    }
}

/// A failed command: what to print, and how to exit.
struct Failure(String);

impl<E: std::fmt::Display> From<E> for Failure {
    fn from(e: E) -> Self {
        Failure(e.to_string())
    }
}

/// One client of one sproutd.
#[derive(Clone)]
struct Api {
    addr: String,
    key: Option<String>,
}

/// Requests wait this long for each read (a create waits for a boot).
const TIMEOUT: Duration = Duration::from_secs(900);

impl Api {
    fn new(c: &Conn) -> Result<Api, Failure> {
        let rest = match c.url.split_once("://") {
            Some(("http", r)) => r,
            Some((scheme, _)) => {
                return Err(Failure(format!(
                    "--url {}: only http:// is supported (not {scheme}://); put a TLS proxy \
                     in front of sproutd's loopback address for anything else",
                    c.url
                )))
            }
            None => c.url.as_str(),
        };
        let addr = rest.trim_end_matches('/');
        if addr.is_empty() || addr.contains('/') {
            return Err(Failure(format!(
                "--url {}: expected http://HOST:PORT",
                c.url
            )));
        }
        Ok(Api {
            addr: addr.to_owned(),
            key: c.api_key.clone().filter(|k| !k.is_empty()),
        })
    }

    fn headers(&self, extra: &[&str]) -> Vec<String> {
        let mut h: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        if let Some(k) = &self.key {
            h.push(format!("Authorization: Bearer {k}"));
        }
        h
    }

    fn connect_error(&self, e: ApiClientError) -> Failure {
        match e {
            ApiClientError::Connect(_, io) => Failure(format!(
                "cannot reach sproutd at {}: {io} (is it running? `./serve` starts one; \
                 --url or SPROUT_URL says where it is)",
                self.addr
            )),
            e => Failure(format!("talking to sproutd at {}: {e}", self.addr)),
        }
    }

    /// One request; its JSON answer if it is a 2xx, else the server's error.
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, Failure> {
        let body = body.map(|b| b.to_string());
        let headers = self.headers(&[]);
        let mut out = Vec::new();
        let status = request(
            &Request {
                addr: &self.addr,
                method,
                path,
                body: body.as_deref().map(str::as_bytes),
                headers: &headers,
                include: false,
                timeout: TIMEOUT,
            },
            &mut out,
        )
        .map_err(|e| self.connect_error(e))?;
        answer(status, &out)
    }
}

/// A 2xx answer's JSON, or the error it carries.
fn answer(status: u16, body: &[u8]) -> Result<Value, Failure> {
    let v: Option<Value> = serde_json::from_slice(body).ok();
    if (200..300).contains(&status) {
        return Ok(v.unwrap_or(Value::Null));
    }
    let e = v.as_ref().map(|v| &v["error"]);
    match (
        e.and_then(|e| e["code"].as_str()),
        e.and_then(|e| e["message"].as_str()),
    ) {
        (Some(code), Some(msg)) => Err(Failure(format!("{msg} ({code}, HTTP {status})"))),
        _ => Err(Failure(format!(
            "HTTP {status}: {}",
            String::from_utf8_lossy(&body[..body.len().min(512)])
        ))),
    }
}

/// Runs a sandbox command; prints errors as `sprout: error: …`.
pub fn main(conn: &Conn, cmd: SandboxCmd) -> ExitCode {
    match run(conn, cmd) {
        Ok(code) => code,
        Err(Failure(m)) => {
            eprintln!("sprout: error: {m}");
            ExitCode::FAILURE
        }
    }
}

fn seg(id: &str) -> Result<&str, Failure> {
    // An id is a path segment: refuse what would make it another path.
    if id.is_empty() || id.contains(['/', '?', '#', '%', ' ']) || id.chars().any(char::is_control) {
        return Err(Failure(format!("{id:?} is not an id")));
    }
    Ok(id)
}

fn run(conn: &Conn, cmd: SandboxCmd) -> Result<ExitCode, Failure> {
    let api = Api::new(conn)?;
    let vms = "/v1/runtime/vms";
    let show = |v: &Value, human: fn(&Value) -> String| {
        if conn.json {
            println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
        } else {
            print!("{}", human(v));
        }
        Ok(ExitCode::SUCCESS)
    };
    match cmd {
        SandboxCmd::Create(a) => {
            let mut body = serde_json::Map::new();
            let mut put = |k: &str, v: Value| {
                body.insert(k.to_owned(), v);
            };
            if let Some(i) = a.image {
                put("image", json!(i));
            }
            if let Some(r) = a.runtime {
                put("runtime", json!(r));
            }
            if let Some(s) = a.snapshot {
                put("snapshot", json!(s));
            }
            if let Some(c) = a.cpus {
                put("cpus", json!(c));
            }
            if let Some(m) = a.memory {
                put("memoryMb", json!(m));
            }
            if let Some(t) = a.idle_timeout {
                put("idleTimeoutSecs", json!(t));
            }
            if a.no_internet {
                put("disableInternet", json!(true));
            }
            if !a.meta.is_empty() {
                put("metadata", json!(to_map(a.meta)));
            }
            if !a.env.is_empty() {
                put("env", json!(to_map(a.env)));
            }
            if !conn.json && std::io::stderr().is_terminal() {
                eprintln!("sprout: creating a sandbox (a first boot of an image takes a while)");
            }
            // A first create of an image and shape builds its template, a
            // first create of an OCI image pulls it: sproutd says so (503
            // template_building, image_pulling), and this waits.
            let body = Value::Object(body);
            let t = std::time::Instant::now();
            let mut told = false;
            let v = loop {
                match api.call("POST", "/v1/runtime/schedule", Some(body.clone())) {
                    Err(Failure(m))
                        if m.contains("(template_building,") && t.elapsed() < TIMEOUT =>
                    {
                        if !told && !conn.json && std::io::stderr().is_terminal() {
                            eprintln!("sprout: its template is being built; waiting");
                            told = true;
                        }
                        std::thread::sleep(Duration::from_secs(1));
                    }
                    // An OCI image's pull: say how far it got each time.
                    Err(Failure(m)) if m.contains("(image_pulling,") && t.elapsed() < TIMEOUT => {
                        if !conn.json && std::io::stderr().is_terminal() {
                            eprintln!("sprout: {m}");
                        }
                        std::thread::sleep(Duration::from_secs(2));
                    }
                    r => break r?,
                }
            };
            show(&v, vm_detail)
        }
        SandboxCmd::Ls(a) => {
            let mut path = vms.to_owned();
            for (i, (k, v)) in a.meta.iter().enumerate() {
                path.push(if i == 0 { '?' } else { '&' });
                path.push_str(&format!("metadata.{}={}", encode(k), encode(v)));
            }
            let v = api.call("GET", &path, None)?;
            show(&v, vm_table)
        }
        SandboxCmd::Get(a) => {
            let v = api.call("GET", &format!("{vms}/{}", seg(&a.id)?), None)?;
            show(&v, vm_detail)
        }
        SandboxCmd::Rm(a) => {
            let mut failed = false;
            for id in &a.ids {
                let r = seg(id).and_then(|id| api.call("DELETE", &format!("{vms}/{id}"), None));
                match r {
                    Ok(v) if conn.json => println!("{v}"),
                    Ok(_) => println!("{id} deleted"),
                    Err(Failure(m)) => {
                        eprintln!("sprout: error: {id}: {m}");
                        failed = true;
                    }
                }
            }
            Ok(if failed {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            })
        }
        SandboxCmd::Pause(a) => op(&api, conn, &a.id, "pause"),
        SandboxCmd::Resume(a) => op(&api, conn, &a.id, "resume"),
        SandboxCmd::Sleep(a) => op(&api, conn, &a.id, "sleep"),
        SandboxCmd::Hibernate(a) => op(&api, conn, &a.id, "hibernate"),
        SandboxCmd::Wake(a) => op(&api, conn, &a.id, "wake"),
        SandboxCmd::Reboot(a) => op(&api, conn, &a.id, "reboot"),
        SandboxCmd::Snapshot(a) => {
            let v = api.call(
                "POST",
                &format!("{vms}/{}/snapshot", seg(&a.id)?),
                Some(json!({})),
            )?;
            show(&v, snapshot_detail)
        }
        SandboxCmd::Fork(a) => {
            let v = api.call(
                "POST",
                &format!("{vms}/{}/fork", seg(&a.id)?),
                Some(json!({"count": a.count})),
            )?;
            show(&v, |v| {
                let mut s = String::new();
                for f in v["forks"].as_array().into_iter().flatten() {
                    s.push_str(&format!(
                        "{}\t{}\n",
                        str_of(&f["vmId"]),
                        str_of(&f["state"])
                    ));
                }
                s
            })
        }
        SandboxCmd::Exec(a) => exec(&api, conn, a),
        SandboxCmd::Cp(a) => cp(&api, conn, a),
        SandboxCmd::Files(f) => files(&api, conn, f),
        SandboxCmd::Ps(a) => {
            let v = api.call("GET", &format!("{vms}/{}/processes", seg(&a.id)?), None)?;
            show(&v, ps_table)
        }
        SandboxCmd::Attach(a) => attach(&api, conn, &a.id, a.exec_id, a.after),
        SandboxCmd::Kill(a) => {
            let signal = match a.signal.parse::<i64>() {
                Ok(n) => json!(n),
                Err(_) => json!(a.signal),
            };
            let v = api.call(
                "POST",
                &format!("{vms}/{}/processes/{}/signal", seg(&a.id)?, a.exec_id),
                Some(json!({ "signal": signal })),
            )?;
            show(&v, |v| {
                format!(
                    "sent signal {} to exec {}\n",
                    str_of(&v["signal"]),
                    str_of(&v["execId"])
                )
            })
        }
        SandboxCmd::Ports(c) => match c {
            PortsCmd::Open { id, port, public } => {
                let v = api.call(
                    "POST",
                    &format!("{vms}/{}/ports", seg(&id)?),
                    Some(json!({ "port": port, "public": public })),
                )?;
                show(&v, |v| format!("{}\n", str_of(&v["url"])))
            }
            PortsCmd::Ls(a) => {
                let v = api.call("GET", &format!("{vms}/{}/ports", seg(&a.id)?), None)?;
                show(&v, |v| {
                    let rows = v["ports"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|p| {
                            let public = if p["public"] == true { "yes" } else { "no" };
                            vec![str_of(&p["port"]), public.to_owned(), str_of(&p["url"])]
                        })
                        .collect();
                    table(&["PORT", "PUBLIC", "URL"], rows)
                })
            }
            PortsCmd::Close { id, port } => {
                api.call("DELETE", &format!("{vms}/{}/ports/{port}", seg(&id)?), None)?;
                let v = json!({ "vmId": id, "port": port, "closed": true });
                show(&v, |_| "closed\n".to_owned())
            }
        },
        SandboxCmd::Checkpoint(c) => {
            let cps = "/v1/runtime/checkpoints";
            match c {
                CheckpointCmd::Create { id, name } => {
                    let v = api.call(
                        "POST",
                        &format!("{vms}/{}/checkpoints", seg(&id)?),
                        Some(json!({ "name": name })),
                    )?;
                    show(&v, snapshot_detail)
                }
                CheckpointCmd::Ls(a) => {
                    let v = api.call("GET", &format!("{vms}/{}/checkpoints", seg(&a.id)?), None)?;
                    show(&v, |v| {
                        let rows = v["snapshots"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .map(|c| {
                                vec![
                                    str_of(&c["snapshotId"]),
                                    str_of(&c["name"]),
                                    str_of(&c["createdAt"]),
                                ]
                            })
                            .collect();
                        table(&["ID", "NAME", "CREATED"], rows)
                    })
                }
                CheckpointCmd::Restore { checkpoint } => {
                    post_show(&api, conn, &format!("{cps}/{}/restore", seg(&checkpoint)?))
                }
                CheckpointCmd::Spawn { checkpoint } => {
                    post_show(&api, conn, &format!("{cps}/{}/spawn", seg(&checkpoint)?))
                }
                CheckpointCmd::Rm { checkpoint } => {
                    let v = api.call("DELETE", &format!("{cps}/{}", seg(&checkpoint)?), None)?;
                    show(&v, |_| "deleted\n".to_owned())
                }
            }
        }
    }
}

/// A rest-state operation: prints the sandbox after it.
fn op(api: &Api, conn: &Conn, id: &str, what: &str) -> Result<ExitCode, Failure> {
    post_show(api, conn, &format!("/v1/runtime/vms/{}/{what}", seg(id)?))
}

/// POSTs `{}` to `path` and prints the sandbox it answers with (a wake's
/// answer holds it in `vm`).
fn post_show(api: &Api, conn: &Conn, path: &str) -> Result<ExitCode, Failure> {
    let v = api.call("POST", path, Some(json!({})))?;
    if conn.json {
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    } else if v["vm"].is_object() {
        // A wake's answer: the sandbox, and whether its memory came back.
        print!("{}", vm_detail(&v["vm"]));
        if v["coldBoot"] == true {
            eprintln!(
                "sprout: its memory could not be restored, so it was booted from its saved \
                 disk (files kept, processes gone): {}",
                str_of(&v["coldBootReason"])
            );
        }
    } else {
        print!("{}", vm_detail(&v));
    }
    Ok(ExitCode::SUCCESS)
}

/// Piped stdin up to this size goes in the exec's request (the command
/// then runs as a streamed exec, killed if sprout goes away); a longer one
/// is streamed to a background process as it is read.
const INLINE_STDIN: usize = 256 * 1024;

/// Each write of a streamed stdin (base64 in a JSON body under 1 MiB).
const STDIN_CHUNK: usize = 256 * 1024;

/// `sprout exec`: a streamed exec (Server-Sent Events), its stdout and
/// stderr written as they come; exits with the command's status (128 +
/// signal when a signal ended it).
fn exec(api: &Api, conn: &Conn, a: ExecArgs) -> Result<ExitCode, Failure> {
    let id = seg(&a.id)?.to_owned();
    let mut it = a.command.into_iter();
    let command = it.next().ok_or_else(|| Failure("no command".into()))?;
    let mut body = json!({ "command": command, "argv": it.collect::<Vec<_>>() });
    if let Some(c) = a.cwd {
        body["cwd"] = json!(c);
    }
    if !a.env.is_empty() {
        body["env"] = json!(to_map(a.env));
    }
    if let Some(t) = a.timeout {
        body["timeoutMs"] = json!(t.saturating_mul(1000));
    }
    let path = format!("/v1/runtime/vms/{id}/exec");
    let stdin = std::io::stdin();
    let piped = !stdin.is_terminal() && !a.stdin_open;
    // The first INLINE_STDIN + 1 bytes of a piped stdin tell a short one
    // (sent whole with the request) from a long or endless one (streamed).
    let mut head = Vec::new();
    if piped {
        stdin
            .lock()
            .take(INLINE_STDIN as u64 + 1)
            .read_to_end(&mut head)
            .map_err(|e| Failure(format!("reading stdin: {e}")))?;
    }
    let streamed_stdin = head.len() > INLINE_STDIN;
    if !head.is_empty() && !streamed_stdin {
        put_stdin(&mut body, head.clone());
    }
    if a.background {
        if streamed_stdin {
            return Err(Failure(format!(
                "a background command's stdin is at most {} KiB here (use --stdin-open and \
                 write the rest through the API)",
                INLINE_STDIN / 1024
            )));
        }
        body["background"] = json!(true);
        body["stdinOpen"] = json!(a.stdin_open);
        let v = api.call("POST", &path, Some(body))?;
        if conn.json {
            println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        } else {
            println!("{}", str_of(&v["execId"]));
            if std::io::stderr().is_terminal() {
                eprintln!(
                    "sprout: started exec {} (pid {}); follow it with `sprout attach {id} {}`",
                    str_of(&v["execId"]),
                    str_of(&v["pid"]),
                    str_of(&v["execId"])
                );
            }
        }
        return Ok(ExitCode::SUCCESS);
    }
    if streamed_stdin {
        return exec_streaming_stdin(api, conn, &id, body, head);
    }
    let headers = api.headers(&["Accept: text/event-stream"]);
    let text = body.to_string();
    let mut sink = Sse::new(conn.json);
    let status = request(
        &Request {
            addr: &api.addr,
            method: "POST",
            path: &path,
            body: Some(text.as_bytes()),
            headers: &headers,
            include: false,
            timeout: TIMEOUT,
        },
        &mut sink,
    )
    .map_err(|e| api.connect_error(e))?;
    if !(200..300).contains(&status) {
        answer(status, &sink.raw)?;
    }
    sink.finish()
}

/// Puts `input` in an exec request's `stdin` (base64 when not UTF-8).
fn put_stdin(body: &mut Value, input: Vec<u8>) {
    match String::from_utf8(input) {
        Ok(s) => body["stdin"] = json!(s),
        Err(e) => {
            use base64::Engine as _;
            body["stdin"] = json!(base64::engine::general_purpose::STANDARD.encode(e.into_bytes()));
            body["stdinBase64"] = json!(true);
        }
    }
}

/// An exec whose piped stdin is long (or endless): the command starts as a
/// background process with its stdin open, a thread writes stdin to it as
/// it is read (end of file closes it), and sprout attaches to its output.
/// Ctrl-C sends it SIGINT (a second one SIGKILL), since going away would
/// not end a background process.
fn exec_streaming_stdin(
    api: &Api,
    conn: &Conn,
    id: &str,
    mut body: Value,
    head: Vec<u8>,
) -> Result<ExitCode, Failure> {
    body["background"] = json!(true);
    body["stdinOpen"] = json!(true);
    let v = api.call("POST", &format!("/v1/runtime/vms/{id}/exec"), Some(body))?;
    let exec_id = v["execId"]
        .as_u64()
        .ok_or_else(|| Failure(format!("sproutd's answer has no execId: {v}")))?;
    let procs = format!("/v1/runtime/vms/{id}/processes/{exec_id}");
    let feeder = {
        let api = api.clone();
        let path = format!("{procs}/stdin");
        std::thread::spawn(move || feed_stdin(&api, &path, head))
    };
    {
        let api = api.clone();
        let path = format!("{procs}/signal");
        std::thread::spawn(move || forward_interrupts(&api, &path));
    }
    let code = attach(api, conn, id, exec_id, None);
    // The command has ended: whatever is left of stdin is not wanted.
    drop(feeder);
    code
}

/// Writes `head` then the rest of stdin to a background process, then
/// closes its stdin. A process that no longer reads (it ended, or closed
/// its stdin) stops the writing quietly, as a broken pipe would.
fn feed_stdin(api: &Api, path: &str, head: Vec<u8>) {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut stdin = std::io::stdin().lock();
    let mut pending = head;
    loop {
        let mut buf = Vec::with_capacity(STDIN_CHUNK);
        let eof = match (&mut stdin).take(STDIN_CHUNK as u64).read_to_end(&mut buf) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => {
                eprintln!("sprout: reading stdin: {e}; closing the command's stdin");
                true
            }
        };
        let send = std::mem::replace(&mut pending, buf);
        for piece in send.chunks(STDIN_CHUNK) {
            let r = api.call(
                "POST",
                path,
                Some(json!({ "data": b64.encode(piece), "base64": true })),
            );
            if let Err(Failure(m)) = r {
                if !m.contains("(stdin_closed,") && !m.contains("(process_not_found,") {
                    eprintln!("sprout: writing the command's stdin: {m}");
                }
                return;
            }
        }
        if eof {
            let rest = std::mem::take(&mut pending);
            let r = api.call(
                "POST",
                path,
                Some(json!({ "data": b64.encode(rest), "base64": true, "close": true })),
            );
            if let Err(Failure(m)) = r {
                if !m.contains("(stdin_closed,") && !m.contains("(process_not_found,") {
                    eprintln!("sprout: closing the command's stdin: {m}");
                }
            }
            return;
        }
    }
}

/// On Ctrl-C (or SIGTERM), signals the background process at `path`:
/// INT the first time, KILL after that.
fn forward_interrupts(api: &Api, path: &str) {
    let Ok(rt) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return;
    };
    rt.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut int), Ok(mut term)) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) else {
            return;
        };
        let mut sig = "INT";
        loop {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
            let api = api.clone();
            let path = path.to_owned();
            let s = sig;
            // (A blocking call, off the signal loop.)
            let _ = tokio::task::spawn_blocking(move || {
                api.call("POST", &path, Some(json!({ "signal": s })))
            })
            .await;
            sig = "KILL";
        }
    });
}

/// `sprout attach`: a background process's events (after `after`), its
/// output written as it comes; exits with its status. A stream that breaks
/// before the exit is re-attached from the last event seen (the process
/// runs on regardless), a few times.
fn attach(
    api: &Api,
    conn: &Conn,
    id: &str,
    exec_id: u64,
    after: Option<u64>,
) -> Result<ExitCode, Failure> {
    let path = format!("/v1/runtime/vms/{}/processes/{exec_id}/events", seg(id)?);
    let mut sink = Sse::new(conn.json);
    sink.last_id = after;
    let mut retries = 0;
    loop {
        let mut extra = vec!["Accept: text/event-stream".to_owned()];
        if let Some(l) = sink.last_id {
            extra.push(format!("Last-Event-ID: {l}"));
        }
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let headers = api.headers(&extra);
        sink.raw.clear();
        sink.line.clear();
        sink.event.clear();
        sink.data.clear();
        sink.id = None;
        let r = request(
            &Request {
                addr: &api.addr,
                method: "GET",
                path: &path,
                body: None,
                headers: &headers,
                include: false,
                timeout: TIMEOUT,
            },
            &mut sink,
        );
        match r {
            Ok(status) if !(200..300).contains(&status) => {
                answer(status, &sink.raw)?;
            }
            Err(e @ ApiClientError::Connect(..)) if retries == 0 => {
                return Err(api.connect_error(e));
            }
            _ => {}
        }
        if sink.exit.is_some() || sink.error.is_some() || retries >= 5 {
            return sink.finish();
        }
        retries += 1;
        std::thread::sleep(Duration::from_millis(500 * retries));
    }
}

/// Reads a `text/event-stream` body as it arrives: `stdout` and `stderr`
/// events are written out at once, `exit` and `error` are kept.
struct Sse {
    json: bool,
    /// The bytes not yet a whole line.
    line: Vec<u8>,
    event: String,
    data: String,
    exit: Option<Value>,
    error: Option<Value>,
    /// The id of the last event dispatched (to re-attach after it).
    last_id: Option<u64>,
    /// The id of the event being read.
    id: Option<u64>,
    /// The whole body, for an answer that is not a stream (an error).
    raw: Vec<u8>,
}

impl Sse {
    fn new(json: bool) -> Self {
        Sse {
            json,
            line: Vec::new(),
            event: String::new(),
            data: String::new(),
            exit: None,
            error: None,
            last_id: None,
            id: None,
            raw: Vec::new(),
        }
    }

    fn dispatch(&mut self) {
        let data: Value = serde_json::from_str(&self.data).unwrap_or(Value::Null);
        let event = std::mem::take(&mut self.event);
        self.data.clear();
        if let Some(id) = self.id.take() {
            // A replayed event already seen (a re-attach) is not shown twice.
            if self.last_id.is_some_and(|l| id <= l) {
                return;
            }
            self.last_id = Some(id);
        }
        if self.json {
            println!("{}", json!({ "event": event, "data": data }));
            let _ = std::io::stdout().flush();
        }
        match event.as_str() {
            "stdout" | "stderr" if !self.json => {
                let bytes = match (data["data"].as_str(), data["base64"].as_bool()) {
                    (Some(s), Some(true)) => {
                        use base64::Engine as _;
                        base64::engine::general_purpose::STANDARD
                            .decode(s)
                            .unwrap_or_default()
                    }
                    (Some(s), _) => s.as_bytes().to_vec(),
                    _ => Vec::new(),
                };
                if event == "stdout" {
                    let mut o = std::io::stdout();
                    let _ = o.write_all(&bytes).and_then(|()| o.flush());
                } else {
                    let mut e = std::io::stderr();
                    let _ = e.write_all(&bytes).and_then(|()| e.flush());
                }
            }
            "gap" if !self.json => eprintln!(
                "sprout: events {}-{} of its output were dropped before they were read \
                 ({} bytes)",
                str_of(&data["firstEventId"]),
                str_of(&data["lastEventId"]),
                str_of(&data["bytes"])
            ),
            "exit" => self.exit = Some(data),
            "error" => self.error = Some(data),
            _ => {}
        }
    }

    fn finish(mut self) -> Result<ExitCode, Failure> {
        if !self.line.is_empty() {
            let l = std::mem::take(&mut self.line);
            self.feed_line(&l);
        }
        if !self.data.is_empty() || !self.event.is_empty() {
            self.dispatch();
        }
        if let Some(e) = &self.error {
            let e = &e["error"];
            return Err(Failure(format!(
                "{} ({})",
                str_of(&e["message"]),
                str_of(&e["code"])
            )));
        }
        let Some(x) = &self.exit else {
            return Err(Failure(
                "the exec's stream ended without its exit (the connection broke)".into(),
            ));
        };
        if x["timedOut"] == true {
            eprintln!("sprout: the command passed its --timeout and was killed");
        }
        let code = match (x["exitCode"].as_i64(), x["signal"].as_i64()) {
            (Some(c), _) => c,
            (None, Some(s)) => 128 + s,
            _ => 1,
        };
        Ok(ExitCode::from(
            u8::try_from(code.clamp(0, 255)).unwrap_or(1),
        ))
    }

    fn feed_line(&mut self, l: &[u8]) {
        let l = String::from_utf8_lossy(l);
        let l = l.trim_end_matches('\r');
        if l.is_empty() {
            if !self.data.is_empty() || !self.event.is_empty() {
                self.dispatch();
            }
        } else if let Some(v) = l.strip_prefix("event:") {
            self.event = v.trim().to_owned();
        } else if let Some(v) = l.strip_prefix("id:") {
            self.id = v.trim().parse().ok();
        } else if let Some(v) = l.strip_prefix("data:") {
            if !self.data.is_empty() {
                self.data.push('\n');
            }
            self.data.push_str(v.strip_prefix(' ').unwrap_or(v));
        }
    }
}

impl Write for Sse {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // At most 1 MiB of a non-stream answer is kept (an error's body).
        if self.raw.len() < 1 << 20 {
            self.raw.extend_from_slice(buf);
        }
        for &b in buf {
            if b == b'\n' {
                let l = std::mem::take(&mut self.line);
                self.feed_line(&l);
            } else if self.line.len() < 4 << 20 {
                self.line.push(b);
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// One side of a `sprout cp`.
#[derive(Debug, PartialEq)]
enum Loc {
    /// `-`: stdin or stdout.
    Std,
    Local(std::path::PathBuf),
    Remote {
        id: String,
        path: String,
    },
}

/// `ID:PATH` is a sandbox's file (an `ID` has no `/`: a local name with a
/// colon is `./a:b`); `-` is stdin or stdout; anything else a local path.
fn loc(s: &str) -> Loc {
    if s == "-" {
        return Loc::Std;
    }
    match s.split_once(':') {
        Some((id, path)) if !id.is_empty() && !id.contains('/') => Loc::Remote {
            id: id.to_owned(),
            path: path.to_owned(),
        },
        _ => Loc::Local(s.into()),
    }
}

/// The last component of a path (`None` for `.`, `/`, `a/..`).
fn base_name(p: &str) -> Option<&str> {
    let b = p.trim_end_matches('/').rsplit('/').next()?;
    (!b.is_empty() && b != "." && b != "..").then_some(b)
}

/// Files at least this long get a progress bar on a terminal.
const PROGRESS_MIN: u64 = 1 << 20;

/// Progress of one transfer on stderr: a bar redrawn on a terminal, or
/// (`--progress` elsewhere) a line at each tenth.
struct Progress {
    label: String,
    total: Option<u64>,
    done: u64,
    tty: bool,
    on: bool,
    started: std::time::Instant,
    drawn: std::time::Instant,
    /// The next tenth (or 8 MiB step, size unknown) to print a line at.
    next_line: u64,
}

impl Progress {
    fn new(label: String, total: Option<u64>, forced: bool, json: bool) -> Progress {
        let tty = std::io::stderr().is_terminal();
        let big = total.is_none_or(|t| t >= PROGRESS_MIN);
        let now = std::time::Instant::now();
        Progress {
            label,
            total,
            done: 0,
            tty,
            on: forced || (tty && big && !json),
            started: now,
            drawn: now,
            next_line: 1,
        }
    }

    fn add(&mut self, n: usize) {
        self.done += n as u64;
        if !self.on {
            return;
        }
        if self.tty {
            if self.drawn.elapsed() >= Duration::from_millis(100) {
                self.drawn = std::time::Instant::now();
                self.draw("\r");
            }
            return;
        }
        let step = match self.total {
            Some(t) if t > 0 => self.done * 10 / t,
            _ => self.done / (8 << 20),
        };
        if step >= self.next_line {
            self.next_line = step + 1;
            self.draw("");
            eprintln!();
        }
    }

    fn draw(&self, prefix: &str) {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let secs = self.started.elapsed().as_secs_f64().max(1e-3);
        let rate = mib(self.done) / secs;
        let line = match self.total {
            Some(t) if t > 0 => {
                let filled = (self.done.min(t) * 30 / t) as usize;
                format!(
                    "{} [{}{}] {:5.1}% {:.1}/{:.1} MiB {:.1} MiB/s",
                    self.label,
                    "#".repeat(filled),
                    " ".repeat(30 - filled),
                    self.done.min(t) as f64 * 100.0 / t as f64,
                    mib(self.done),
                    mib(t),
                    rate
                )
            }
            _ => format!("{} {:.1} MiB {:.1} MiB/s", self.label, mib(self.done), rate),
        };
        let mut e = std::io::stderr();
        let _ = write!(e, "{prefix}{line}");
        let _ = e.flush();
    }

    fn finish(&mut self) {
        if self.on && self.tty {
            self.draw("\r");
            eprintln!();
        } else if self.on && self.next_line <= 10 {
            self.draw("");
            eprintln!();
        }
    }
}

/// A reader that counts into a shared [`Progress`].
struct Counted<R> {
    inner: R,
    progress: std::sync::Arc<std::sync::Mutex<Progress>>,
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        if let Ok(mut p) = self.progress.lock() {
            p.add(n);
        }
        Ok(n)
    }
}

impl<W: Write> Write for Counted<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        if let Ok(mut p) = self.progress.lock() {
            p.add(n);
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// `sprout cp`: one file into or out of a sandbox, streamed (files/raw).
fn cp(api: &Api, conn: &Conn, a: CpArgs) -> Result<ExitCode, Failure> {
    let v = match (loc(&a.src), loc(&a.dst)) {
        (Loc::Remote { .. }, Loc::Remote { .. }) => {
            return Err(Failure(
                "both sides are sandboxes: copy to a local file first".into(),
            ))
        }
        (Loc::Remote { id, path }, to) => download(api, conn, &a, &id, &path, to)?,
        (from, Loc::Remote { id, path }) => upload(api, conn, &a, from, &id, &path)?,
        _ => {
            return Err(Failure(format!(
                "neither {:?} nor {:?} is in a sandbox (ID:PATH)",
                a.src, a.dst
            )))
        }
    };
    if conn.json {
        println!("{v}");
    } else if std::io::stderr().is_terminal() {
        eprintln!(
            "sprout: copied {} bytes to {}",
            str_of(&v["bytes"]),
            str_of(&v["to"])
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn files_path(id: &str, what: &str, path: &str) -> Result<String, Failure> {
    Ok(format!(
        "/v1/runtime/vms/{}/files{what}?path={}",
        seg(id)?,
        encode(path)
    ))
}

/// Whether `path` in sandbox `id` is a directory (false when it is missing
/// or a file).
fn remote_dir(api: &Api, id: &str, path: &str) -> Result<bool, Failure> {
    match api.call("GET", &files_path(id, "", path)?, None) {
        Ok(_) => Ok(true),
        Err(Failure(m)) if m.contains("(file_not_found,") || m.contains("(file_conflict,") => {
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

fn upload(
    api: &Api,
    conn: &Conn,
    a: &CpArgs,
    from: Loc,
    id: &str,
    path: &str,
) -> Result<Value, Failure> {
    let (file, name) = match &from {
        Loc::Local(p) => {
            let f = std::fs::File::open(p).map_err(|e| Failure(format!("{}: {e}", p.display())))?;
            let m = f
                .metadata()
                .map_err(|e| Failure(format!("{}: {e}", p.display())))?;
            if !m.is_file() {
                return Err(Failure(format!(
                    "{}: not a regular file (cp copies one file)",
                    p.display()
                )));
            }
            (f, p.file_name().map(|n| n.to_string_lossy().into_owned()))
        }
        // stdin has no length: spooled to an unlinked temporary file first.
        _ => (spool_stdin()?, None),
    };
    let len = file
        .metadata()
        .map_err(|e| Failure(format!("{}: {e}", a.src)))?
        .len();
    let dir_like = path.is_empty() || path.ends_with('/');
    let target = if dir_like || remote_dir(api, id, path)? {
        let name = name.ok_or_else(|| {
            Failure(format!(
                "{id}:{path} is a directory: name the file to write (ID:DIR/NAME)"
            ))
        })?;
        let dir = if path.is_empty() { "." } else { path };
        format!("{}/{name}", dir.trim_end_matches('/'))
    } else {
        path.to_owned()
    };
    let progress = std::sync::Arc::new(std::sync::Mutex::new(Progress::new(
        format!("{} -> {id}:{target}", a.src),
        Some(len),
        a.progress,
        conn.json,
    )));
    let upload = crate::daemon::api_client::Upload {
        reader: Box::new(Counted {
            inner: std::io::BufReader::with_capacity(256 * 1024, file),
            progress: progress.clone(),
        }),
        len,
        content_type: "application/octet-stream".into(),
    };
    let headers = api.headers(&[]);
    let ans = crate::daemon::api_client::open(
        &Request {
            addr: &api.addr,
            method: "PUT",
            path: &files_path(id, "/raw", &target)?,
            body: None,
            headers: &headers,
            include: false,
            timeout: TIMEOUT,
        },
        Some(upload),
    )
    .map_err(|e| api.connect_error(e))?;
    let status = ans.status;
    let mut out = Vec::new();
    let copied = ans.copy_to(&mut out);
    if let Ok(mut p) = progress.lock() {
        p.finish();
    }
    copied.map_err(|e| api.connect_error(e))?;
    let v = answer(status, &out)?;
    if v["bytes"].as_u64() != Some(len) {
        return Err(Failure(format!(
            "sproutd wrote {} bytes of {id}:{target}, not the {len} sent",
            str_of(&v["bytes"])
        )));
    }
    Ok(json!({ "from": a.src, "to": format!("{id}:{target}"), "bytes": len }))
}

/// Copies stdin into a temporary file already unlinked; it, rewound.
fn spool_stdin() -> Result<std::fs::File, Failure> {
    use std::io::Seek as _;
    let dir = std::env::temp_dir();
    let p = dir.join(format!(
        ".sprout-stdin-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    ));
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&p)
        .map_err(|e| Failure(format!("a temporary file in {}: {e}", dir.display())))?;
    let _ = std::fs::remove_file(&p);
    std::io::copy(&mut std::io::stdin().lock(), &mut f)
        .map_err(|e| Failure(format!("reading stdin: {e}")))?;
    f.rewind()
        .map_err(|e| Failure(format!("a temporary file: {e}")))?;
    Ok(f)
}

/// The size of the file at `path` in sandbox `id`, from its directory's
/// listing (for the progress bar; `None` when the listing does not say).
fn remote_size(api: &Api, id: &str, path: &str) -> Option<u64> {
    let name = base_name(path)?;
    let parent = match path.trim_end_matches('/').rsplit_once('/') {
        Some(("", _)) => "/",
        Some((p, _)) => p,
        None => ".",
    };
    let v = api
        .call("GET", &files_path(id, "", parent).ok()?, None)
        .ok()?;
    v["entries"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name && e["type"] == "file")
        .and_then(|e| e["size"].as_u64())
}

fn download(
    api: &Api,
    conn: &Conn,
    a: &CpArgs,
    id: &str,
    path: &str,
    to: Loc,
) -> Result<Value, Failure> {
    let name = base_name(path);
    let headers = api.headers(&[]);
    let req_path = files_path(id, "/raw", path)?;
    let req = Request {
        addr: &api.addr,
        method: "GET",
        path: &req_path,
        body: None,
        headers: &headers,
        include: false,
        timeout: TIMEOUT,
    };
    let dest = match &to {
        Loc::Local(p) if p.is_dir() || a.dst.ends_with('/') => {
            let name = name.ok_or_else(|| Failure(format!("{id}:{path} names no file")))?;
            Some(p.join(name))
        }
        Loc::Local(p) => Some(p.clone()),
        _ => None,
    };
    let total = if a.progress || std::io::stderr().is_terminal() {
        remote_size(api, id, path)
    } else {
        None
    };
    let shown = match &dest {
        Some(d) => d.display().to_string(),
        None => "-".into(),
    };
    let progress = std::sync::Arc::new(std::sync::Mutex::new(Progress::new(
        format!("{id}:{path} -> {shown}"),
        total,
        a.progress,
        conn.json,
    )));
    let ans = crate::daemon::api_client::open(&req, None).map_err(|e| api.connect_error(e))?;
    if !(200..300).contains(&ans.status) {
        let status = ans.status;
        let mut out = Vec::new();
        ans.copy_to(&mut out).map_err(|e| api.connect_error(e))?;
        answer(status, &out)?;
        return Err(Failure(format!("HTTP {status}")));
    }
    let bytes = match &dest {
        None => {
            let mut w = Counted {
                inner: std::io::stdout().lock(),
                progress: progress.clone(),
            };
            ans.copy_to(&mut w)
                .map_err(|e| Failure(format!("downloading {id}:{path}: {e}")))?;
            progress.lock().map(|p| p.done).unwrap_or(0)
        }
        Some(d) => {
            // Written beside the destination, renamed over it when whole:
            // a transfer that fails leaves no partial file behind.
            let dir = d
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(std::path::Path::new("."));
            let tmp = dir.join(format!(
                ".{}.sprout-{}",
                d.file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                std::process::id()
            ));
            let f = std::fs::File::create(&tmp)
                .map_err(|e| Failure(format!("{}: {e}", tmp.display())))?;
            let mut w = Counted {
                inner: std::io::BufWriter::with_capacity(256 * 1024, f),
                progress: progress.clone(),
            };
            let done = ans
                .copy_to(&mut w)
                .map_err(|e| format!("downloading {id}:{path}: {e}"))
                .and_then(|()| {
                    w.inner
                        .into_inner()
                        .map_err(|e| format!("{}: {}", tmp.display(), e.error()))
                })
                .and_then(|f| f.sync_all().map_err(|e| format!("{}: {e}", tmp.display())))
                .and_then(|()| {
                    std::fs::rename(&tmp, d).map_err(|e| format!("{}: {e}", d.display()))
                });
            if let Err(m) = done {
                let _ = std::fs::remove_file(&tmp);
                return Err(Failure(m));
            }
            progress.lock().map(|p| p.done).unwrap_or(0)
        }
    };
    if let Ok(mut p) = progress.lock() {
        p.finish();
    }
    Ok(json!({ "from": format!("{id}:{path}"), "to": shown, "bytes": bytes }))
}

fn files(api: &Api, conn: &Conn, f: FilesCmd) -> Result<ExitCode, Failure> {
    let v = match &f {
        FilesCmd::Ls { id, path } => api.call("GET", &files_path(id, "", path)?, None)?,
        FilesCmd::Mkdir { id, path, parents } => api.call(
            "POST",
            &format!("/v1/runtime/vms/{}/files/mkdir", seg(id)?),
            Some(json!({ "path": path, "parents": parents })),
        )?,
        FilesCmd::Rm {
            id,
            path,
            recursive,
        } => {
            let mut p = files_path(id, "", path)?;
            if *recursive {
                p.push_str("&recursive=true");
            }
            api.call("DELETE", &p, None)?
        }
    };
    if conn.json {
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    } else if let FilesCmd::Ls { .. } = f {
        let rows = v["entries"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| {
                let kind = str_of(&e["type"]);
                let name = str_of(&e["name"]);
                vec![
                    kind.clone(),
                    str_of(&e["size"]),
                    if kind == "dir" {
                        format!("{name}/")
                    } else {
                        name
                    },
                ]
            })
            .collect();
        print!("{}", table(&["TYPE", "SIZE", "NAME"], rows));
        if v["truncated"] == true {
            eprintln!("sprout: the listing was cut at 10000 entries");
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn ps_table(v: &Value) -> String {
    let rows = v["processes"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            let state = if p["running"] == true {
                "running".to_owned()
            } else {
                match (p["exit"]["exitCode"].as_i64(), p["exit"]["signal"].as_i64()) {
                    (Some(c), _) => format!("exit {c}"),
                    (None, Some(s)) => format!("signal {s}"),
                    _ => "ended".to_owned(),
                }
            };
            vec![
                str_of(&p["execId"]),
                str_of(&p["pid"]),
                state,
                str_of(&p["startedAt"]),
                str_of(&p["command"]),
            ]
        })
        .collect();
    table(&["EXEC", "PID", "STATE", "STARTED", "COMMAND"], rows)
}

fn to_map(pairs: Vec<(String, String)>) -> BTreeMap<String, String> {
    pairs.into_iter().collect()
}

/// Percent-encodes a query component.
fn encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn str_of(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        v => v.to_string(),
    }
}

fn table(head: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut w: Vec<usize> = head.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let mut s = String::new();
    let mut line = |cells: Vec<String>| {
        let n = cells.len();
        for (i, c) in cells.into_iter().enumerate() {
            if i + 1 == n {
                s.push_str(&c);
            } else {
                s.push_str(&format!("{c:<width$}  ", width = w[i]));
            }
        }
        s.push('\n');
    };
    line(head.iter().map(|h| h.to_string()).collect());
    for r in rows {
        line(r);
    }
    s
}

fn metadata(v: &Value) -> String {
    v.as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| format!("{k}={}", str_of(v)))
                .collect::<Vec<_>>()
                .join(",")
        })
        .unwrap_or_default()
}

fn vm_table(v: &Value) -> String {
    let rows = v["vms"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|s| {
            vec![
                str_of(&s["vmId"]),
                str_of(&s["state"]),
                str_of(&s["image"]),
                format!("{}/{}M", str_of(&s["cpus"]), str_of(&s["memoryMb"])),
                str_of(&s["createdAt"]),
                str_of(&s["parentVmId"]),
                metadata(&s["metadata"]),
            ]
        })
        .collect();
    table(
        &[
            "ID", "STATE", "IMAGE", "SHAPE", "CREATED", "PARENT", "METADATA",
        ],
        rows,
    )
}

fn vm_detail(v: &Value) -> String {
    let mut s = String::new();
    for (k, f) in [
        ("id", "vmId"),
        ("state", "state"),
        ("image", "image"),
        ("runtime", "runtime"),
        ("cpus", "cpus"),
        ("memory MiB", "memoryMb"),
        ("created", "createdAt"),
        ("parent", "parentVmId"),
        ("from snapshot", "snapshotId"),
        ("idle timeout s", "idleTimeoutSecs"),
        ("no internet", "disableInternet"),
        ("worker pid", "workerPid"),
        ("failure", "failureReason"),
    ] {
        if !v[f].is_null() {
            s.push_str(&format!("{k:<15} {}\n", str_of(&v[f])));
        }
    }
    let m = metadata(&v["metadata"]);
    if !m.is_empty() {
        s.push_str(&format!("{:<15} {m}\n", "metadata"));
    }
    s
}

fn snapshot_detail(v: &Value) -> String {
    let mut s = String::new();
    for (k, f) in [
        ("snapshot", "snapshotId"),
        ("kind", "kind"),
        ("name", "name"),
        ("sandbox", "vmId"),
        ("state", "state"),
        ("parent", "parentId"),
        ("size bytes", "sizeBytes"),
        ("created", "createdAt"),
        ("durable", "durable"),
    ] {
        if !v[f].is_null() {
            s.push_str(&format!("{k:<11} {}\n", str_of(&v[f])));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_ids_and_pairs_are_checked() {
        let conn = |u: &str| Conn {
            url: u.into(),
            api_key: None,
            json: false,
        };
        assert_eq!(
            Api::new(&conn("http://127.0.0.1:7070/")).ok().unwrap().addr,
            "127.0.0.1:7070"
        );
        assert_eq!(Api::new(&conn("h:1")).ok().unwrap().addr, "h:1");
        assert!(Api::new(&conn("https://h:1"))
            .err()
            .unwrap()
            .0
            .contains("only http://"));
        assert!(Api::new(&conn("http://h:1/v1")).is_err());
        assert!(seg("../x").is_err() && seg("a?b").is_err() && seg("").is_err());
        assert!(seg("0b3ae0d4-9f50-4d38-a7a3-1c2b3d4e5f60").is_ok());
        assert_eq!(pair("a=b=c").unwrap(), ("a".into(), "b=c".into()));
        assert!(pair("=b").is_err() && pair("ab").is_err());
        assert_eq!(encode("a b/é"), "a%20b%2F%C3%A9");
    }

    #[test]
    fn errors_name_the_code_and_the_message() {
        let e = answer(
            404,
            br#"{"error":{"code":"vm_not_found","message":"No sandbox x"}}"#,
        )
        .err()
        .unwrap();
        assert_eq!(e.0, "No sandbox x (vm_not_found, HTTP 404)");
        assert!(answer(502, b"<html>").err().unwrap().0.contains("HTTP 502"));
        assert_eq!(answer(200, b"{\"a\":1}").ok().unwrap()["a"], 1);
    }

    #[test]
    fn a_stream_is_read_across_any_split() {
        let body = "event: stdout\nid: 1\ndata: {\"data\":\"hi\",\"base64\":false}\n\n\
                    event: exit\nid: 2\ndata: {\"exitCode\":3,\"signal\":null,\"timedOut\":false}\n\n";
        for split in [1, 2, 7, body.len()] {
            let mut s = Sse::new(true);
            for c in body.as_bytes().chunks(split) {
                s.write_all(c).unwrap();
            }
            assert_eq!(s.exit.as_ref().unwrap()["exitCode"], 3, "split {split}");
            let code = s.finish().ok().unwrap();
            assert_eq!(code, ExitCode::from(3));
        }
        let mut s = Sse::new(true);
        s.write_all(b"event: error\ndata: {\"error\":{\"code\":\"x\",\"message\":\"m\"}}\n\n")
            .unwrap();
        assert_eq!(s.finish().err().unwrap().0, "m (x)");
        assert!(Sse::new(true).finish().is_err(), "no exit: an error");
    }

    #[test]
    fn a_reattach_skips_the_events_already_seen() {
        let mut s = Sse::new(false);
        s.last_id = Some(2);
        s.write_all(
            b"event: exit\nid: 2\ndata: {\"exitCode\":9}\n\n\
              event: exit\nid: 3\ndata: {\"exitCode\":4}\n\n",
        )
        .unwrap();
        assert_eq!(s.last_id, Some(3));
        assert_eq!(s.exit.as_ref().unwrap()["exitCode"], 4, "event 2 was seen");
    }

    #[test]
    fn cp_sides_are_told_apart() {
        assert_eq!(loc("-"), Loc::Std);
        assert_eq!(
            loc("abc:/workspace/x"),
            Loc::Remote {
                id: "abc".into(),
                path: "/workspace/x".into()
            }
        );
        assert_eq!(
            loc("abc:"),
            Loc::Remote {
                id: "abc".into(),
                path: "".into()
            }
        );
        assert_eq!(loc("./a:b"), Loc::Local("./a:b".into()));
        assert_eq!(loc(":x"), Loc::Local(":x".into()));
        assert_eq!(loc("dir/f"), Loc::Local("dir/f".into()));
        assert_eq!(base_name("a/b.txt"), Some("b.txt"));
        assert_eq!(base_name("a/b/"), Some("b"));
        assert_eq!(base_name("."), None);
        assert_eq!(base_name("/"), None);
        assert_eq!(base_name("a/.."), None);
    }
}
