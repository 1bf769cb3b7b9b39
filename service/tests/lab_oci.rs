//! An OCI image boots as a Linux guest: built with umoci on this host (busybox
//! and files over three layers, whiteouts and an opaque directory among
//! them), made into a base image by `sprout image pull`, then run with
//! `sprout vm run --image` inside the emulated lab (tests/lab/), where
//! Sprout's init and agent, added by the conversion, bring it up and run
//! commands in it.

mod common;
use common::oci::*;

use sprout_tests::lab;

#[test]
fn an_oci_image_boots_with_sprouts_init_and_agent_and_runs_commands() {
    require_tools();
    let dir = tempfile::tempdir().unwrap();
    let layout = build_test_image(&dir.path().join("layout"), "1", "booted");
    let cache = dir.path().join("cache");
    let out = pull(&cache, &layout.reference());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let img: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let path = std::path::PathBuf::from(img["path"].as_str().unwrap());

    let run = lab::Script::new(
        "sprout vm run --image /lab/rootfs.ext4 --exec '\
           echo os: $(cat /etc/os-release); echo motd: $(cat /etc/motd); \
           test -e /etc/x && echo x: present || echo x: absent; \
           test -e /etc/gone && echo gone: present || echo gone: absent; \
           echo opq: $(ls /data/opq); echo marker: $(cat /lib/marker); \
           echo private: $(stat -c %u:%g:%a /home/user/private); \
           echo data > /workspace/w && echo workspace: $(cat /workspace/w); \
           echo pid1: $(cat /proc/1/comm)'\n\
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
    assert_eq!(one("status:"), "0");
    assert_eq!(one("os:"), "ID=sprout-oci-test");
    assert_eq!(one("motd:"), "second");
    assert_eq!(one("x:"), "absent");
    assert_eq!(one("gone:"), "absent");
    assert_eq!(one("opq:"), "upper");
    assert_eq!(one("marker:"), "via the symlink");
    assert_eq!(one("private:"), "1000:1000:600");
    assert_eq!(one("workspace:"), "data");
    assert_eq!(one("pid1:"), "sprout-agent");
}
