//! moto's S3 server (tests/s3/install.sh) on loopback, for the tests of
//! the snapshot store.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use reqwest::Client;

pub const BUCKET: &str = "sprout-snapshots";
pub const CREDS: [(&str, &str); 2] = [
    ("AWS_ACCESS_KEY_ID", "sprout-test"),
    ("AWS_SECRET_ACCESS_KEY", "sprout-test-secret"),
];

pub fn moto() -> PathBuf {
    if let Some(p) = std::env::var_os("SPROUT_MOTO") {
        return p.into();
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/s3/install.sh");
    let out = Command::new(script)
        .output()
        .expect("run tests/s3/install.sh");
    assert!(
        out.status.success(),
        "tests/s3/install.sh: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// moto's S3 server on loopback (port 0: any), its bucket made.
pub struct S3 {
    child: Child,
    pub port: u16,
}

impl S3 {
    pub async fn start(port: u16) -> S3 {
        let mut child = Command::new(moto())
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start moto_server");
        let mut err = BufReader::new(child.stderr.take().unwrap());
        let mut port = 0;
        let mut seen = String::new();
        while port == 0 {
            let mut line = String::new();
            assert!(err.read_line(&mut line).unwrap() > 0, "moto said: {seen}");
            seen.push_str(&line);
            if let Some(rest) = line.split("Running on http://127.0.0.1:").nth(1) {
                port = rest.trim().trim_end_matches('/').parse().unwrap();
            }
        }
        // Its requests' log: read on, so that a full pipe never stops it.
        let log = std::env::temp_dir().join(format!("moto-{port}.log"));
        std::thread::spawn(move || {
            use std::io::Write as _;
            let mut f = std::fs::File::create(log).ok();
            for l in err.lines().map_while(Result::ok) {
                if let Some(f) = f.as_mut() {
                    let _ = writeln!(f, "{l}");
                }
            }
        });
        let s = S3 { child, port };
        let r = Client::new().put(s.url(BUCKET)).send().await.unwrap();
        assert!(r.status().is_success(), "make the bucket: {}", r.status());
        s
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}/{path}", self.port)
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The keys under `prefix`.
    pub async fn keys(&self, prefix: &str) -> Vec<String> {
        let xml = Client::new()
            .get(self.url(&format!("{BUCKET}?list-type=2&prefix={prefix}")))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        xml.split("<Key>")
            .skip(1)
            .filter_map(|k| k.split("</Key>").next())
            .map(str::to_owned)
            .collect()
    }

    /// Runs Python `code` with `s3` (a boto3 client of this server) and
    /// `BUCKET` defined, from moto's venv (the server wants signed
    /// requests for what sproutd wrote); what it printed.
    pub fn boto(&self, code: &str) -> String {
        let py = moto().with_file_name("python3");
        let script = format!(
            "import boto3, json, time\n\
             s3 = boto3.client('s3', endpoint_url='{}', region_name='us-east-1',\n\
                 aws_access_key_id='{}', aws_secret_access_key='{}')\n\
             BUCKET = '{BUCKET}'\n{code}\n",
            self.endpoint(),
            CREDS[0].1,
            CREDS[1].1
        );
        let out = Command::new(py).arg("-c").arg(script).output().unwrap();
        assert!(
            out.status.success(),
            "boto3 failed: {}\n{code}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Flips the last byte of object `key`.
    pub fn corrupt(&self, key: &str) {
        self.boto(&format!(
            "b = bytearray(s3.get_object(Bucket=BUCKET, Key='{key}')['Body'].read())\n\
             assert b\n\
             b[-1] ^= 0x5a\n\
             s3.put_object(Bucket=BUCKET, Key='{key}', Body=bytes(b))"
        ));
    }

    pub fn stop(mut self) -> u16 {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.port
    }
}

impl Drop for S3 {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
