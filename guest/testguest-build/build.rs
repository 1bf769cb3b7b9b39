//! Builds the test guest (guest/testguest, its own cargo workspace) with a nested
//! `cargo build --release --target x86_64-unknown-none` and exports the ELF's path
//! as `TESTGUEST_PATH`.

use std::env;
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const TARGET: &str = "x86_64-unknown-none";

fn main() {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let guest_dir = manifest.parent().expect("guest/").to_path_buf();
    let src = guest_dir.join("testguest");
    let abi = guest_dir.join("abi");
    for p in [
        src.join("src"),
        src.join("Cargo.toml"),
        src.join("build.rs"),
        src.join("link.ld"),
        src.join(".cargo/config.toml"),
        abi.join("src"),
        abi.join("Cargo.toml"),
    ] {
        println!("cargo:rerun-if-changed={}", p.display());
    }

    // `SPROUT_TESTGUEST_SKIP=1` (set by fuzz/.cargo/config.toml): the fuzz
    // crate links sproutd's router, which never boots a guest there, on a
    // nightly toolchain that need not have the guest's target. The guest is
    // not built, and TESTGUEST_PATH names a file that does not exist
    // (sproutd then lists no `testguest` image).
    println!("cargo:rerun-if-env-changed=SPROUT_TESTGUEST_SKIP");
    if env::var_os("SPROUT_TESTGUEST_SKIP").is_some_and(|v| v == "1") {
        let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
        let none = out_dir.join("testguest.not-built");
        let _ = fs::remove_file(&none);
        println!("cargo:rustc-env=TESTGUEST_PATH={}", none.display());
        return;
    }

    check_target_installed();

    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let target_dir = nested_target_dir(&out_dir);
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(&src)
        .args(["build", "--release", "--target", TARGET, "--target-dir"])
        .arg(&target_dir)
        // Our stdout is cargo's directive channel: keep the nested build off it.
        .stdout(Stdio::from(std::io::stderr()));
    for (key, _) in env::vars_os() {
        if leaks_into_nested_build(&key) {
            cmd.env_remove(key);
        }
    }
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run cargo to build the test guest: {e}"));
    if !status.success() {
        panic!(
            "building the test guest failed ({status}); the output is above. To build it by \
             hand: cd {} && cargo build --release",
            src.display()
        );
    }

    // A copy per OUT_DIR: a later build into the shared target dir never changes
    // the file a test binary points at.
    let built = target_dir.join(TARGET).join("release").join("testguest");
    let elf = out_dir.join("testguest.elf");
    fs::copy(&built, &elf)
        .unwrap_or_else(|e| panic!("cannot copy {} to {}: {e}", built.display(), elf.display()));
    println!("cargo:rustc-env=TESTGUEST_PATH={}", elf.display());
}

/// Fails with the fix when the target's standard library is missing (the nested
/// build would otherwise stop at "can't find crate for `core`").
fn check_target_installed() {
    let rustc = env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let libdir = Command::new(&rustc)
        .args(["--print", "target-libdir", "--target", TARGET])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    let has_core = libdir
        .and_then(|d| fs::read_dir(d).ok())
        .is_some_and(|mut entries| {
            entries
                .any(|e| e.is_ok_and(|e| e.file_name().to_string_lossy().starts_with("libcore-")))
        });
    if !has_core {
        panic!(
            "the test guest needs the Rust target {TARGET}, which is not installed: \
             run `rustup target add {TARGET}`"
        );
    }
}

/// One nested target dir for every profile of the outer build
/// (`<target>/testguest`), so the guest is not rebuilt per profile.
fn nested_target_dir(out_dir: &Path) -> PathBuf {
    // OUT_DIR = <target>[/<triple>]/<profile>/build/<pkg>-<hash>/out
    let mut up = out_dir.ancestors();
    match (up.nth(2), up.nth(1)) {
        (Some(build), Some(target)) if build.file_name() == Some("build".as_ref()) => {
            target.join("testguest")
        }
        _ => out_dir.join("target"),
    }
}

/// Build-script and outer-build settings that must not reach the nested cargo:
/// flags meant for the host build would override the guest's .cargo/config.toml.
fn leaks_into_nested_build(key: &OsString) -> bool {
    let k = key.to_string_lossy();
    (k.starts_with("CARGO_") && k != "CARGO_HOME")
        || matches!(
            &*k,
            "RUSTFLAGS"
                | "RUSTDOCFLAGS"
                | "RUSTC_WRAPPER"
                | "RUSTC_WORKSPACE_WRAPPER"
                | "RUSTC_LINKER"
                | "TARGET"
                | "HOST"
                | "OUT_DIR"
                | "OPT_LEVEL"
                | "PROFILE"
                | "DEBUG"
                | "NUM_JOBS"
        )
}
