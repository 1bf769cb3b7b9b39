//! `sproutd --lab`: the service a host without hardware virtualization runs
//! (service/src/daemon/lab.rs). A real HTTP client on this host talks to a
//! real sproutd whose API is served from inside the emulated lab (QEMU
//! TCG with nested SVM, tests/lab/) over its forwarded port, booting real
//! Linux guests there; the registry lives on the lab's persistent data disk.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use reqwest::Client;
use serde_json::{json, Value};

mod common;
use common::lab::{lab, Hosted};

/// Pids of QEMU processes that use `disk`.
fn qemus_on(disk: &Path) -> Vec<u32> {
    let needle = disk.to_string_lossy().into_owned();
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd);
        if (cmd.starts_with("qemu-system") || cmd.contains("/qemu-system")) && cmd.contains(&needle)
        {
            out.push(pid);
        }
    }
    out
}

fn wait_until(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ok() {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

async fn post(c: &Client, h: &Hosted, path: &str, body: Value) -> (u16, Value) {
    let r = c.post(h.url(path)).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")),
    )
}

async fn exec(c: &Client, h: &Hosted, id: &str, cmd: &str, argv: &[&str]) -> Value {
    let (st, v) = post(
        c,
        h,
        &format!("/v1/runtime/vms/{id}/exec"),
        json!({"command": cmd, "argv": argv}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sproutd_serves_linux_sandboxes_from_the_lab_and_keeps_its_registry_across_restarts() {
    let lab = lab();
    let t = tempfile::tempdir().unwrap();
    let data = t.path().join("data");
    let disk = data.join("lab/data.ext4");
    let c = Client::builder()
        .timeout(Duration::from_secs(600))
        .build()
        .unwrap();

    // A registry on this host's loopback, forwarded into the lab.
    common::oci::require_tools();
    let reg = common::oci::Registry::start(&t.path().join("registry"));
    let layout = common::oci::build_test_image(&t.path().join("layout"), "1", "hosted");
    reg.push(&layout, "hosted-image:1");

    let t0 = Instant::now();
    let h = Hosted::start_with(
        &lab,
        &data,
        2048,
        &[
            "--max-execs-per-vm",
            "7",
            "--max-execs",
            "77",
            "--lab-registry",
            &reg.addr,
        ],
    );
    eprintln!("[{:?}] the lab serves on {}", t0.elapsed(), h.base);
    let banner = h.banner.join("\n");
    assert!(banner.contains("latencies there are emulated"), "{banner}");
    assert!(
        banner.contains(&format!(
            "curl -sf --retry 60 -X POST {}/v1/runtime/schedule",
            h.base
        )),
        "{banner}"
    );
    assert!(disk.is_file(), "a data disk at {}", disk.display());
    let info: Value = c
        .get(h.url("/v1/info"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(info["hostMode"]["lab"], true, "{info}");
    assert_eq!(info["hostMode"]["linuxGuests"], true, "{info}");
    assert_eq!(info["execLimits"]["maxExecsPerVm"], 7, "{info}");
    assert_eq!(info["execLimits"]["maxExecs"], 77, "{info}");
    // Sandboxes there have a network device, but the lab's own network
    // reaches nothing outside: said, not hidden.
    assert_eq!(info["network"]["egress"], false, "{info}");
    assert!(
        info["network"]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("emulated lab")),
        "{info}"
    );
    assert!(
        info["hostMode"]["note"]
            .as_str()
            .unwrap()
            .contains("emulated"),
        "{info}"
    );

    // A Linux sandbox from the default image, and a command in it.
    let v = common::lab::schedule(
        &c,
        &h,
        json!({"cpus": 1, "memoryMb": 256, "metadata": {"run": "first"}}),
    )
    .await;
    let first = v["vmId"].as_str().unwrap().to_owned();
    let v = exec(&c, &h, &first, "python3", &["-c", "print(2**100)"]).await;
    assert_eq!(v["stdout"], "1267650600228229401496703205376\n", "{v}");
    assert_eq!(v["exitCode"], 0, "{v}");

    // An OCI image from the host's registry: the lab's sproutd pulls it
    // under the host's address (through the forward), converts it, and
    // runs its entrypoint as the main process.
    eprintln!("[{:?}] an image from the host's registry", t0.elapsed());
    let before = reg.requests("/blobs/");
    let image = format!("{}/hosted-image:1", reg.addr);
    let v =
        common::lab::schedule(&c, &h, json!({"image": image, "cpus": 1, "memoryMb": 256})).await;
    assert_eq!(v["image"], format!("{image}@{}", layout.digest()), "{v}");
    assert!(
        reg.requests("/blobs/") > before,
        "the layers came from the registry"
    );
    let oci_vm = v["vmId"].as_str().unwrap().to_owned();
    let v = exec(
        &c,
        &h,
        &oci_vm,
        "/bin/sh",
        &["-c", "i=0; until [ -s /tmp/entrypoint.out ] || [ $i -ge 120 ]; do sleep 1; i=$((i+1)); done; cat /tmp/entrypoint.out"],
    )
    .await;
    assert_eq!(v["stdout"], "hello from /data as 1000:1000\n", "{v}");
    let r = c
        .delete(h.url(&format!("/v1/runtime/vms/{oci_vm}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);

    // (The CLI and the SDK against the lab: tests/lab_clients.rs.)
    eprintln!("[{:?}] path escapes", t0.elapsed());
    path_escapes_are_refused(&c, &h, &first).await;
    eprintln!("[{:?}] an output flood", t0.elapsed());
    an_output_flood_is_capped_and_sproutd_stays_small(&c, &h, &first).await;
    eprintln!("[{:?}] stopping the lab", t0.elapsed());

    // Ctrl-C: the lab's sproutd stops, the lab powers off, QEMU is gone.
    assert_eq!(qemus_on(&disk).len(), 1, "one QEMU on the data disk");
    let st = h.interrupt();
    assert!(st.success(), "sproutd exited {st}");
    assert!(qemus_on(&disk).is_empty(), "QEMU outlived sproutd");
    let console = std::fs::read_to_string(data.join("lab/console.log")).unwrap();
    assert!(
        console.contains("===SPROUT-LAB-EXIT 0==="),
        "the lab's sproutd did not stop cleanly:\n{console}"
    );

    eprintln!("[{:?}] the lab stopped; starting it again", t0.elapsed());
    // Started again on the same data directory, now with a tenants file
    // (copied into the lab): its tenant `default` owns what single-tenant
    // mode made. The registry was kept on the data disk. The sandbox's VM
    // did not outlive the lab: failed, with the reason.
    let key = common::new_key();
    let tenants = t.path().join("tenants.toml");
    let line = |revoked: bool| {
        let k = key.1.replace(" }", &format!(", revoked = {revoked} }}"));
        format!("[[tenant]]\nname = \"default\"\nmax_execs = 1\nkeys = [{k}]\n")
    };
    std::fs::write(&tenants, line(false)).unwrap();
    let tf = tenants.to_str().unwrap();
    let h = Hosted::start_with(
        &lab,
        &data,
        2048,
        &[
            "--max-execs-per-vm",
            "7",
            "--max-execs",
            "77",
            "--tenants",
            tf,
        ],
    );
    let r = c.get(h.url("/v1/runtime/vms")).send().await.unwrap();
    assert_eq!(r.status(), 401, "no key");
    let c = common::keyed(&key.0);
    let list: Value = c
        .get(h.url("/v1/runtime/vms?metadata.run=first"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let vms = list["vms"].as_array().unwrap();
    assert_eq!(vms.len(), 1, "{list}");
    assert_eq!(vms[0]["vmId"], first.as_str(), "{list}");
    assert_eq!(vms[0]["state"], "failed", "{list}");
    assert!(vms[0]["failureReason"].as_str().is_some(), "{list}");
    // New sandboxes work in the restarted lab; both delete cleanly.
    let v = common::lab::schedule(&c, &h, json!({"cpus": 1, "memoryMb": 256})).await;
    let second = v["vmId"].as_str().unwrap().to_owned();
    let v = exec(&c, &h, &second, "/bin/sh", &["-c", "echo again; uname -s"]).await;
    assert_eq!(v["stdout"], "again\nLinux\n", "{v}");
    // The tenant's exec limit (1): a second exec while one runs is 429.
    let long = {
        let (c, url) = (c.clone(), h.url(&format!("/v1/runtime/vms/{second}/exec")));
        tokio::spawn(async move {
            c.post(url)
                .json(&json!({"command": "sleep", "argv": ["600"], "timeoutMs": 30000}))
                .send()
                .await
        })
    };
    let in_flight = |n: u64| {
        let (c, url) = (c.clone(), h.url("/v1/info"));
        async move {
            let t = Instant::now();
            loop {
                let v: Value = c.get(&url).send().await.unwrap().json().await.unwrap();
                if v["tenant"]["execsInFlight"] == n {
                    return;
                }
                assert!(t.elapsed() < Duration::from_secs(120), "{v}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    in_flight(1).await;
    let (st, v) = post(
        &c,
        &h,
        &format!("/v1/runtime/vms/{second}/exec"),
        json!({"command": "true"}),
    )
    .await;
    assert_eq!(st, 429, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_execs"),
        "{v}"
    );
    // Once it ends (its timeout), the next one is admitted.
    let r = long.await.unwrap().unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["timedOut"], true, "{v}");
    in_flight(0).await;
    let v = exec(&c, &h, &second, "true", &[]).await;
    assert_eq!(v["exitCode"], 0, "{v}");
    for id in [&first, &second] {
        let r = c
            .delete(h.url(&format!("/v1/runtime/vms/{id}")))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "delete {id}: {}", r.status());
    }

    // A SIGHUP to this sproutd gives the lab's the file again: a revoked
    // key is refused without a restart.
    std::fs::write(&tenants, line(true)).unwrap();
    Command::new("kill")
        .args(["-HUP", &h.child.id().to_string()])
        .status()
        .unwrap();
    let t1 = Instant::now();
    loop {
        let r = c.get(h.url("/v1/info")).send().await.unwrap();
        if r.status() == 401 {
            break;
        }
        assert!(
            t1.elapsed() < Duration::from_secs(120),
            "the key was not revoked"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // kill -9 of sproutd takes the lab with it (no QEMU is left behind).
    let pid = h.child.id();
    assert_eq!(qemus_on(&disk).len(), 1);
    Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    wait_until(
        "QEMU to end with its sproutd",
        Duration::from_secs(30),
        || qemus_on(&disk).is_empty(),
    );
}

#[test]
fn lab_and_no_lab_conflict_and_no_lab_serves_here() {
    let out = Command::new(env!("CARGO_BIN_EXE_sproutd"))
        .args(["--lab", "--no-lab"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cannot be used with"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // --check-host says what this host does (the answer depends on it; its
    // exit status and words agree).
    let out = Command::new(env!("CARGO_BIN_EXE_sproutd"))
        .arg("--check-host")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    match out.status.code() {
        Some(0) => assert!(said.contains("runs Linux guests"), "{said}"),
        Some(3) => assert!(said.contains("serves from the emulated lab"), "{said}"),
        other => panic!("--check-host exited {other:?}: {said}"),
    }
}

/// Twenty ways out of `/workspace`, over every file endpoint, each `400
/// path_escape`; nothing outside was made or changed.
async fn path_escapes_are_refused(c: &Client, h: &Hosted, id: &str) {
    // Links that point out: to a directory and to a file.
    let v = exec(
        c,
        h,
        id,
        "/bin/sh",
        &["-c", "ln -s /etc /workspace/out && ln -s ../../etc/passwd /workspace/pw && sha256sum /etc/passwd /etc/hostname"],
    )
    .await;
    assert_eq!(v["exitCode"], 0, "{v}");
    let before = v["stdout"].as_str().unwrap().to_owned();
    let f = format!("/v1/runtime/vms/{id}/files");
    let mut tried = Vec::new();
    for p in [
        "../x",
        "../../etc/passwd",
        "/etc/passwd",
        "d/../../x",
        "%2e%2e/x",
        "out/passwd",
        "pw",
    ] {
        tried.push(c.get(h.url(&format!("{f}/content?path={p}"))));
    }
    for p in ["../x", "/etc/hostname", "out/hostname", "pw"] {
        tried.push(c.put(h.url(&format!("{f}/content?path={p}"))).body("pwned"));
    }
    for p in ["../../etc/shadow", "out/shadow"] {
        tried.push(c.get(h.url(&format!("{f}/raw?path={p}"))));
    }
    for p in ["../y", "out/y"] {
        tried.push(c.put(h.url(&format!("{f}/raw?path={p}"))).body("pwned"));
    }
    for p in ["..", "out"] {
        tried.push(c.get(h.url(&format!("{f}?path={p}"))));
    }
    for p in ["../z", "out/z"] {
        tried.push(
            c.post(h.url(&format!("{f}/mkdir")))
                .json(&json!({"path": p})),
        );
    }
    tried.push(c.delete(h.url(&format!("{f}?path=../etc"))));
    assert_eq!(tried.len(), 20);
    for (i, req) in tried.into_iter().enumerate() {
        let r = req.send().await.unwrap();
        let status = r.status().as_u16();
        let v: Value = r.json().await.unwrap();
        assert_eq!(status, 400, "escape {i}: {v}");
        assert_eq!(v["error"]["code"], "path_escape", "escape {i}: {v}");
    }
    let v = exec(
        c,
        h,
        id,
        "/bin/sh",
        &["-c", "sha256sum /etc/passwd /etc/hostname; ls -d /x /y /z /etc/z /etc/y /etc/shadow 2>/dev/null | grep -v shadow; test -d /etc"],
    )
    .await;
    assert_eq!(
        v["stdout"],
        before.as_str(),
        "something outside changed: {v}"
    );
    assert_eq!(v["exitCode"], 0, "{v}");
}

/// 64 MiB of output from one buffered exec: the answer is cut at 1 MiB and
/// says so, and sproutd's peak memory stays far below the flood.
async fn an_output_flood_is_capped_and_sproutd_stays_small(c: &Client, h: &Hosted, id: &str) {
    let v = exec(
        c,
        h,
        id,
        "/bin/sh",
        &[
            "-c",
            "head -c 67108864 /dev/zero | tr '\\0' x; echo done >&2",
        ],
    )
    .await;
    assert_eq!(v["exitCode"], 0, "{}", v["stderr"]);
    assert_eq!(v["stdoutTruncated"], true);
    assert_eq!(v["stderr"], "done\n");
    let out = v["stdout"].as_str().unwrap();
    assert_eq!(out.len(), 1 << 20);
    assert!(out.bytes().all(|b| b == b'x'));
    let metrics = c
        .get(h.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let peak: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("sproutd_peak_resident_memory_bytes "))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no peak RSS in\n{metrics}"));
    assert!(
        peak < 48 << 20,
        "sproutd's peak RSS is {} MiB after a 64 MiB flood",
        peak >> 20
    );
}
