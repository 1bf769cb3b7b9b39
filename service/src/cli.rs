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
    /// An image `sprout info` lists (default: sproutd's default image).
    #[arg(long)]
    pub image: Option<String>,
    /// A snapshot or checkpoint id to restore from (its image and shape).
    #[arg(long, conflicts_with_all = ["image", "cpus", "memory"])]
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
            if !a.meta.is_empty() {
                put("metadata", json!(to_map(a.meta)));
            }
            if !a.env.is_empty() {
                put("env", json!(to_map(a.env)));
            }
            if !conn.json && std::io::stderr().is_terminal() {
                eprintln!("sprout: creating a sandbox (a first boot of an image takes a while)");
            }
            // A first create of an image and shape builds its template:
            // sproutd says so (503 template_building), and this waits.
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

/// `sprout exec`: a streamed exec (Server-Sent Events), its stdout and
/// stderr written as they come; exits with the command's status (128 +
/// signal when a signal ended it).
fn exec(api: &Api, conn: &Conn, a: ExecArgs) -> Result<ExitCode, Failure> {
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
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        let mut input = Vec::new();
        stdin
            .lock()
            .read_to_end(&mut input)
            .map_err(|e| Failure(format!("reading stdin: {e}")))?;
        if !input.is_empty() {
            match String::from_utf8(input) {
                Ok(s) => body["stdin"] = json!(s),
                Err(e) => {
                    use base64::Engine as _;
                    body["stdin"] =
                        json!(base64::engine::general_purpose::STANDARD.encode(e.into_bytes()));
                    body["stdinBase64"] = json!(true);
                }
            }
        }
    }
    let path = format!("/v1/runtime/vms/{}/exec", seg(&a.id)?);
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
            raw: Vec::new(),
        }
    }

    fn dispatch(&mut self) {
        let data: Value = serde_json::from_str(&self.data).unwrap_or(Value::Null);
        let event = std::mem::take(&mut self.event);
        self.data.clear();
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
        ("cpus", "cpus"),
        ("memory MiB", "memoryMb"),
        ("created", "createdAt"),
        ("parent", "parentVmId"),
        ("from snapshot", "snapshotId"),
        ("idle timeout s", "idleTimeoutSecs"),
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
}
