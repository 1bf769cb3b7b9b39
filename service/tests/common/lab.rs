//! `sproutd --lab`, for the tests that drive Linux sandboxes from this
//! host through the emulated lab.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// The lab, built (or found in the cache) by tests/lab/build.sh.
pub fn lab() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new(root.join("tests/lab/build.sh"))
        .stderr(Stdio::inherit())
        .output()
        .expect("run tests/lab/build.sh");
    assert!(out.status.success(), "tests/lab/build.sh failed");
    // (Its last line: the lab's directory.)
    let stdout = String::from_utf8(out.stdout).unwrap();
    PathBuf::from(
        stdout
            .lines()
            .last()
            .expect("build.sh names the lab")
            .trim(),
    )
}

pub struct Hosted {
    pub child: Child,
    pub base: String,
    pub banner: Vec<String>,
}

impl Hosted {
    /// As the tests of lab_hosted.rs run it (with exec limits to pass on).
    pub fn start(lab: &Path, data_dir: &Path) -> Hosted {
        Self::start_with(
            lab,
            data_dir,
            2048,
            &["--max-execs-per-vm", "7", "--max-execs", "77"],
        )
    }

    /// `sproutd --lab` with `mib` of lab RAM and `extra` arguments.
    pub fn start_with(lab: &Path, data_dir: &Path, mib: u32, extra: &[&str]) -> Hosted {
        Self::start_env(lab, data_dir, mib, extra, &[])
    }

    /// With `envs` set in its environment too.
    pub fn start_env(
        lab: &Path,
        data_dir: &Path,
        mib: u32,
        extra: &[&str],
        envs: &[(&str, &str)],
    ) -> Hosted {
        std::fs::create_dir_all(data_dir).unwrap();
        let log = std::fs::File::create(data_dir.with_extension("log")).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_sproutd"))
            .args([
                "--lab",
                "--lab-memory-mib",
                &mib.to_string(),
                "--listen",
                "127.0.0.1:0",
            ])
            // Passed on to the lab's sproutd (/v1/info shows them).
            .args(extra)
            .arg("--data-dir")
            .arg(data_dir)
            .env("SPROUT_LAB", lab)
            .envs(envs.iter().copied())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("start sproutd");
        // The banner: the address line, then how to use it. It comes once
        // the lab's sproutd answers through the forwarded port.
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut banner = Vec::new();
        loop {
            let mut line = String::new();
            let n = out.read_line(&mut line).unwrap();
            assert!(
                n > 0,
                "sproutd ended before it listened: {}",
                std::fs::read_to_string(data_dir.with_extension("log")).unwrap_or_default()
            );
            banner.push(line.trim_end().to_owned());
            if line.contains("Stop with Ctrl-C") {
                break;
            }
        }
        let base = banner[0]
            .strip_prefix("sproutd listening on ")
            .unwrap_or_else(|| panic!("first line: {:?}", banner[0]))
            .to_owned();
        Hosted {
            child,
            base,
            banner,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// SIGINT, as Ctrl-C sends it; the exit status.
    pub fn interrupt(mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        Command::new("kill").args(["-INT", &pid]).status().unwrap();
        self.child.wait().unwrap()
    }
}

impl Drop for Hosted {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A create: while its template is built, `503 template_building` with
/// `Retry-After`, retried as it says.
pub async fn schedule(
    c: &reqwest::Client,
    h: &Hosted,
    body: serde_json::Value,
) -> serde_json::Value {
    let t = std::time::Instant::now();
    loop {
        let r = c
            .post(h.url("/v1/runtime/schedule"))
            .json(&body)
            .send()
            .await
            .unwrap();
        let st = r.status().as_u16();
        let retry = r
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().parse::<u64>().unwrap());
        let v: serde_json::Value = r.json().await.unwrap();
        if st == 503
            && matches!(
                v["error"]["code"].as_str(),
                Some("template_building" | "image_pulling")
            )
        {
            let secs = retry.expect("a 503 template_building or image_pulling has a Retry-After");
            assert!(secs >= 1, "{secs}");
            assert!(
                t.elapsed() < std::time::Duration::from_secs(600),
                "the template is not built: {v}"
            );
            tokio::time::sleep(std::time::Duration::from_secs(secs.min(5))).await;
            continue;
        }
        assert_eq!(st, 201, "{v}");
        return v;
    }
}
