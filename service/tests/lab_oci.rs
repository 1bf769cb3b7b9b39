//! An OCI image boots as a Linux guest: built with umoci on this host (busybox
//! and files over three layers, whiteouts and an opaque directory among
//! them), made into a base image by `sprout image pull`, then run with
//! `sprout vm run --image` inside the emulated lab (tests/lab/), where
//! Sprout's init and agent, added by the conversion, bring it up, start the
//! image's entrypoint as its main process (the `container` runtime) and
//! run commands beside it.

mod common;
use common::oci::*;

use std::path::{Path, PathBuf};
use std::process::Command;

use sprout_tests::lab;

#[test]
fn an_oci_image_boots_with_sprouts_init_and_agent_and_runs_commands() {
    require_tools();
    let dir = tempfile::tempdir().unwrap();
    let layout = build_test_image(&dir.path().join("layout"), "1", "booted");
    let path = pulled_image(&dir.path().join("cache"), &layout.reference());

    let run = lab::Script::new(
        "sprout vm run --image /lab/rootfs.ext4 --exec '\
           echo os: $(cat /etc/os-release); echo motd: $(cat /etc/motd); \
           test -e /etc/x && echo x: present || echo x: absent; \
           test -e /etc/gone && echo gone: present || echo gone: absent; \
           echo opq: $(ls /data/opq); echo marker: $(cat /lib/marker); \
           echo private: $(stat -c %u:%g:%a /home/user/private); \
           echo data > /workspace/w && echo workspace: $(cat /workspace/w); \
           echo pid1: $(cat /proc/1/comm); \
           i=0; until [ -s /tmp/entrypoint.out ] || [ $i -ge 120 ]; do sleep 1; i=$((i+1)); done; \
           echo main: $(cat /tmp/entrypoint.out); \
           i=0; until wget -qO /tmp/page http://127.0.0.1:8000/original || [ $i -ge 120 ]; do sleep 1; i=$((i+1)); done; \
           echo http: $(cat /tmp/page); \
           for p in /proc/[0-9]*; do [ \"$(cat $p/comm 2>/dev/null)\" = httpd ] && echo httpd-user: $(stat -c %u $p); done; true'\n\
         echo \"status: $?\"",
    )
    .file(&path)
    .run();
    run.assert_success();
    let one = |k: &str| -> String {
        let v = run.values(k);
        assert_eq!(v.len(), 1, "{k} in:\n{}", run.stdout);
        v[0].to_owned()
    };
    assert_eq!(one("status:"), "0", "{}", run.stdout);
    assert_eq!(one("os:"), "ID=sprout-oci-test");
    assert_eq!(one("motd:"), "second");
    assert_eq!(one("x:"), "absent");
    assert_eq!(one("gone:"), "absent");
    assert_eq!(one("opq:"), "upper");
    assert_eq!(one("marker:"), "via the symlink");
    assert_eq!(one("private:"), "1000:1000:600");
    assert_eq!(one("workspace:"), "data");
    assert_eq!(one("pid1:"), "sprout-agent");
    // The container runtime: the agent started the image's entrypoint and
    // cmd with its env, working dir and user, and it serves HTTP.
    assert_eq!(one("main:"), "hello from /data as 1000:1000");
    assert_eq!(one("http:"), "linked");
    assert_eq!(one("httpd-user:"), "1000");
}

/// What `sproutd` in the lab does with an OCI image: the first create pulls
/// it (a local layout here) and builds the template of its digest, the
/// sandbox's image is the reference pinned to that digest, the image's
/// entrypoint runs as the sandbox's main process (its first background
/// process) with exec beside it, a second create restores the same
/// template, and a bad reference or an unknown tag is a clear 400.
#[test]
fn sproutd_runs_an_oci_image_with_its_entrypoint_as_the_main_process() {
    require_tools();
    let dir = tempfile::tempdir().unwrap();
    let layout = build_test_image(&dir.path().join("layout"), "1", "sproutd");
    let tar = dir.path().join("layout.tar");
    run(Command::new("tar")
        .arg("-cf")
        .arg(&tar)
        .arg("-C")
        .arg(dir.path())
        .arg("layout"));
    let out = lab::Script::new(format!("{DAEMON_START}{SPROUTD_SCRIPT}"))
        .file(&tar)
        .timeout(std::time::Duration::from_secs(1500))
        .run();
    out.assert_success();
    let o = &out.stdout;
    let json = |k: &str| -> serde_json::Value {
        let v = out.values(k);
        assert_eq!(v.len(), 1, "{k} in:\n{o}");
        serde_json::from_str(v[0]).unwrap_or_else(|e| panic!("{k}: {e}\n{o}"))
    };
    let pinned = format!("oci:/tmp/img/layout:1@{}", layout.digest());
    let first = json("created:");
    assert_eq!(first["image"], pinned.as_str(), "{o}");
    assert_eq!(first["state"], "running", "{o}");
    assert!(
        first["snapshotId"].is_string(),
        "restored from its template: {o}"
    );
    assert_eq!(
        json("main:")["stdout"],
        "hello from /data as 1000:1000\n",
        "{o}"
    );
    assert_eq!(json("http:")["stdout"], "linked", "{o}");
    let procs = json("procs:");
    let main = &procs["processes"][0];
    assert_eq!(main["execId"], 1, "{o}");
    assert_eq!(main["command"], format!("/bin/sh -c {MAIN_CMD}"), "{o}");
    assert_eq!(main["running"], true, "{o}");
    let info = json("info:");
    assert!(
        info["images"]
            .as_array()
            .unwrap()
            .iter()
            .any(|i| i["name"] == pinned.as_str()),
        "{o}"
    );
    let templates = json("templates:");
    let t = &templates["templates"].as_array().unwrap();
    assert_eq!(t.len(), 1, "{o}");
    assert_eq!(t[0]["image"], pinned.as_str(), "{o}");
    let second = json("second:");
    assert_eq!(second["image"], pinned.as_str(), "{o}");
    assert_eq!(second["snapshotId"], first["snapshotId"], "{o}");
    assert_eq!(
        json("bad-ref:")["error"]["code"],
        "bad_image_reference",
        "{o}"
    );
    let missing = json("no-tag:");
    assert_eq!(missing["error"]["code"], "image_not_found", "{o}");
    assert_eq!(missing["error"]["field"], "image", "{o}");
    assert_eq!(out.values("deleted:"), ["true", "true"], "{o}");
    assert_eq!(out.values("daemon-exit:"), ["0"], "{o}");
}

const SPROUTD_SCRIPT: &str = r#"
mkdir -p /tmp/img && tar -xf /lab/layout.tar -C /tmp/img
ref=oci:/tmp/img/layout:1
# The first create pulls the image and builds its template (the CLI waits
# through image_pulling and template_building), then restores it.
out=$(sprout create --image $ref --cpus 1 --memory 256 --json 2>/tmp/create.err | tr -d '\n')
echo "created: $out"
id=$(vm_id "$out")
[ -n "$id" ] || { echo "create failed: $(cat /tmp/create.err)"; cat /tmp/sd.log; exit 11; }
x=/v1/runtime/vms/$id/exec
echo "main: $(api POST $x '{"command":"/bin/sh","argv":["-c","i=0; until [ -s /tmp/entrypoint.out ] || [ $i -ge 120 ]; do sleep 1; i=$((i+1)); done; cat /tmp/entrypoint.out"]}')"
echo "http: $(api POST $x '{"command":"/bin/sh","argv":["-c","i=0; until wget -qO- http://127.0.0.1:8000/original || [ $i -ge 120 ]; do sleep 1; i=$((i+1)); done | tr -d \"\\n\""]}')"
echo "procs: $(api GET /v1/runtime/vms/$id/processes)"
echo "info: $(api GET /v1/info)"
echo "templates: $(api GET /v1/runtime/templates)"
out2=$(sprout create --image $ref --cpus 1 --memory 256 --json 2>/dev/null | tr -d '\n')
echo "second: $out2"
echo "bad-ref: $(api POST /v1/runtime/schedule '{"image":"oci:"}')"
echo "no-tag: $(api POST /v1/runtime/schedule '{"image":"oci:/tmp/img/layout:nope"}')"
for v in $id $(vm_id "$out2"); do
  api DELETE /v1/runtime/vms/$v | sed -n 's/.*"deleted":\([a-z]*\).*/deleted: \1/p'
done
kill $daemon; wait $daemon
echo "daemon-exit: $?"
"#;

/// A Debian image (python3, systemd) from a registry on loopback: pulled
/// and converted by `sprout image pull 127.0.0.1:PORT/pytest-image:1`, then
/// booted in the lab with each runtime. `container`: the image's cmd runs
/// as the main process and python3 answers. `vm`: systemd is PID 1, boots
/// to `running` or `degraded`, runs the agent as its service (exec works),
/// and the image's cmd is not started. Then `sproutd` in the lab makes a
/// sandbox of it with `"runtime": "vm"` (its template built and restored)
/// and runs a command beside systemd.
#[test]
fn a_debian_image_from_a_registry_runs_python_as_a_container_and_boots_systemd_as_a_vm() {
    require_tools();
    let image = debian_image();
    let dir = tempfile::tempdir().unwrap();
    let reg = Registry::start(dir.path());
    reg.push_image(&image, "pytest-image:1");
    let reference = format!("{}/pytest-image:1", reg.addr);
    let cache = dir.path().join("cache");
    let path = pulled_image(&cache, &reference);
    let seed = seed_for_lab(dir.path(), &cache, &image);
    let run = lab::Script::new(format!("{DEBIAN_SCRIPT}{DAEMON_START}{DEBIAN_SPROUTD}"))
        .file(&path)
        .file(&seed)
        .timeout(std::time::Duration::from_secs(1800))
        .run();
    run.assert_success();
    let o = &run.stdout;
    let one = |k: &str| -> String {
        let v = run.values(k);
        assert_eq!(v.len(), 1, "{k} in:\n{o}");
        v[0].to_owned()
    };
    assert!(one("python:").starts_with("3."), "{o}");
    assert_eq!(one("c-main:"), "main ran", "{o}");
    assert_eq!(one("c-pid1:"), "sprout-agent", "{o}");
    assert_eq!(one("c-status:"), "0", "{o}");
    let state = one("vm-state:");
    assert!(state == "running" || state == "degraded", "{o}");
    assert_eq!(one("vm-pid1:"), "systemd", "{o}");
    assert_eq!(one("vm-agent:"), "active", "{o}");
    assert_eq!(one("vm-main:"), "absent", "{o}");
    assert_eq!(one("vm-status:"), "0", "{o}");
    // sproutd with the vm runtime.
    let json = |k: &str| -> serde_json::Value {
        serde_json::from_str(&one(k)).unwrap_or_else(|e| panic!("{k}: {e}\n{o}"))
    };
    let created = json("sd-created:");
    // The seeded image, listed by the reference it was first pulled by (the
    // registry's, on the host) pinned to the digest the create resolved.
    let digest = created["image"]
        .as_str()
        .unwrap()
        .rsplit_once('@')
        .unwrap_or_else(|| panic!("the image is pinned: {o}"))
        .1
        .to_owned();
    let info = json("sd-info:");
    let img = info["images"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["name"].as_str().unwrap().ends_with(&format!("@{digest}")))
        .unwrap_or_else(|| panic!("the seeded image is listed: {o}"));
    assert_eq!(
        img["runtimes"],
        serde_json::json!(["container", "vm"]),
        "{o}"
    );
    assert!(
        created["image"]
            .as_str()
            .unwrap()
            .starts_with("oci:/tmp/seed/layout:1@sha256:"),
        "{o}"
    );
    assert_eq!(created["runtime"], "vm", "{o}");
    assert_eq!(created["state"], "running", "{o}");
    assert!(created["snapshotId"].is_string(), "from its template: {o}");
    let exec = json("sd-exec:");
    assert_eq!(exec["exitCode"], 0, "{o}");
    let words: Vec<&str> = exec["stdout"]
        .as_str()
        .unwrap()
        .split_whitespace()
        .collect();
    assert!(
        matches!(words.as_slice(), [state, "systemd", "active"] if *state == "running" || *state == "degraded"),
        "{o}"
    );
    let templates = json("sd-templates:");
    let t = &templates["templates"][0];
    assert_eq!(t["runtime"], "vm", "{o}");
    assert_eq!(t["state"], "ready", "{o}");
    assert_eq!(json("sd-get:")["runtime"], "vm", "{o}");
    assert_eq!(one("sd-deleted:"), "true", "{o}");
    assert_eq!(one("daemon-exit:"), "0", "{o}");
}

/// What the lab's `sproutd` needs to find the Debian image in its OCI cache
/// without converting it again under emulation: the host's cache entry for
/// `oci:LAYOUT:1`'s digest (its `image.json`, which names the reference the
/// digest was first pulled by, the registry's; the test hands the base image itself
/// in beside it) and the layout without its layer blobs (a tag resolves to
/// a digest from the index and manifest alone). The lab's Sprout files
/// (agent, busybox, init) are this host's, so its cache key is the same.
fn seed_for_lab(dir: &Path, cache: &Path, image: &str) -> PathBuf {
    let layout_ref = format!("oci:{image}");
    let entry = pulled_image(cache, &layout_ref)
        .parent()
        .unwrap()
        .to_owned();
    let stage = dir.join("seed");
    let to = stage.join("entry").join(entry.file_name().unwrap());
    std::fs::create_dir_all(&to).unwrap();
    std::fs::copy(entry.join("image.json"), to.join("image.json")).unwrap();
    let layout = Path::new(image.rsplit_once(':').unwrap().0);
    let blobs = stage.join("layout/blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    for f in ["index.json", "oci-layout"] {
        std::fs::copy(layout.join(f), stage.join("layout").join(f)).unwrap();
    }
    for b in std::fs::read_dir(layout.join("blobs/sha256")).unwrap() {
        let b = b.unwrap();
        if b.metadata().unwrap().len() < 1 << 20 {
            std::fs::copy(b.path(), blobs.join(b.file_name())).unwrap();
        }
    }
    let tar = dir.join("seed.tar");
    run(Command::new("tar")
        .arg("-cf")
        .arg(&tar)
        .arg("-C")
        .arg(&stage)
        .args(["entry", "layout"]));
    tar
}

/// Starts `sproutd` in the lab on 127.0.0.1:7070 (its output in
/// /tmp/sd.log) and waits until it answers; `api` calls it.
const DAEMON_START: &str = r#"
ip link set lo up 2>/dev/null || ifconfig lo 127.0.0.1 up 2>/dev/null
sprout daemon --listen 127.0.0.1:7070 --data-dir /tmp/sd >>/tmp/sd.out 2>>/tmp/sd.log &
daemon=$!
i=0
until sprout api GET /v1/health >/dev/null 2>&1; do
  i=$((i+1)); [ $i -gt 600 ] && { echo "sproutd did not start"; cat /tmp/sd.log; exit 10; }
  sleep 0.1
done
api() { sprout api "$@" 2>/dev/null; }
vm_id() { echo "$1" | sed -n 's/.*"vmId": *"\([^"]*\)".*/\1/p'; }
"#;

/// The Debian image in the lab's sproutd with the vm runtime: its cache
/// seeded (seed_for_lab), a create builds the (image, vm) template and
/// restores it, and a command runs beside systemd.
const DEBIAN_SPROUTD: &str = r#"
mkdir -p /tmp/seed /opt/sprout/oci/images && tar -xf /lab/seed.tar -C /tmp/seed
e=$(ls /tmp/seed/entry)
mv /tmp/seed/entry/$e /opt/sprout/oci/images/$e
ln -s /lab/rootfs.ext4 /opt/sprout/oci/images/$e/rootfs.ext4
echo "sd-info: $(api GET /v1/info)"
out=$(sprout create --image oci:/tmp/seed/layout:1 --runtime vm --cpus 1 --memory 512 --json 2>/tmp/create.err | tr -d '\n')
echo "sd-created: $out"
id=$(vm_id "$out")
[ -n "$id" ] || { echo "create failed: $(cat /tmp/create.err)"; tail -50 /tmp/sd.log; exit 11; }
echo "sd-exec: $(api POST /v1/runtime/vms/$id/exec '{"command":"/bin/sh","argv":["-c","echo $(systemctl is-system-running --wait) $(cat /proc/1/comm) $(systemctl is-active sprout-agent)"]}')"
echo "sd-templates: $(api GET /v1/runtime/templates)"
echo "sd-get: $(api GET /v1/runtime/vms/$id)"
api DELETE /v1/runtime/vms/$id | sed -n 's/.*"deleted":\([a-z]*\).*/sd-deleted: \1/p'
kill $daemon; wait $daemon
echo "daemon-exit: $?"
"#;

const DEBIAN_SCRIPT: &str = r#"
sprout vm run --image /lab/rootfs.ext4 --memory-mib 512 --exec '
  echo python: $(python3 -c "import sys; print(sys.version)");
  i=0; until [ -s /tmp/main.out ] || [ $i -ge 120 ]; do sleep 1; i=$((i+1)); done;
  echo c-main: $(cat /tmp/main.out); echo c-pid1: $(cat /proc/1/comm)'
echo "c-status: $?"
sprout vm run --runtime vm --image /lab/rootfs.ext4 --memory-mib 512 --exec '
  echo vm-state: $(systemctl is-system-running --wait);
  echo vm-pid1: $(cat /proc/1/comm);
  echo vm-agent: $(systemctl is-active sprout-agent);
  test -e /tmp/main.out && echo vm-main: present || echo vm-main: absent'
echo "vm-status: $?"
"#;
