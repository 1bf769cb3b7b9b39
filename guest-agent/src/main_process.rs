//! A sandbox's main process: what a `container`-runtime image runs when it
//! boots (its entrypoint and cmd, with its env, working directory and user).
//!
//! The host writes the spec into the base image at [`SPEC_PATH`] when it
//! converts an OCI image; the agent that PID 1 starts first reads it
//! (`sprout-agent --main PATH`) and starts it as a background process, so its
//! output is read, its stdin fed and its exit seen like any background
//! exec's. An image without a spec has no main process.

use serde::{Deserialize, Serialize};

use crate::protocol::{Exec, StdinMode, User};

/// Where the spec lives in a base image.
pub const SPEC_PATH: &str = "/.sprout/main.json";
/// Largest spec the agent reads.
pub const MAX_SPEC_BYTES: u64 = 1 << 20;
/// `PATH` when the image sets none (Docker's default).
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The main process of a sandbox.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MainProcess {
    /// The program (a path, or a name looked up in the spec's `PATH`) and its
    /// arguments: the image's entrypoint followed by its cmd.
    pub args: Vec<String>,
    /// The whole environment (nothing is inherited from the agent).
    pub env: Vec<(String, String)>,
    /// Absolute working directory.
    pub cwd: String,
    pub uid: u32,
    pub gid: u32,
}

impl MainProcess {
    /// Parses and checks a spec file's bytes.
    pub fn from_json(bytes: &[u8]) -> Result<MainProcess, String> {
        if bytes.len() as u64 > MAX_SPEC_BYTES {
            return Err(format!("the spec is over {MAX_SPEC_BYTES} bytes"));
        }
        let m: MainProcess =
            serde_json::from_slice(bytes).map_err(|e| format!("the spec is not valid: {e}"))?;
        if m.args.first().is_none_or(|a| a.is_empty()) {
            return Err("the spec names no program".into());
        }
        if !m.cwd.starts_with('/') {
            return Err(format!(
                "the spec's working directory {:?} is not absolute",
                m.cwd
            ));
        }
        Ok(m)
    }

    pub fn to_json(&self) -> Vec<u8> {
        // A struct of strings and integers always serializes.
        serde_json::to_vec_pretty(self).unwrap_or_default()
    }

    /// The background exec that runs it: no shell, no stdin, the spec's
    /// environment alone.
    pub fn to_exec(&self) -> Exec {
        let (command, argv) = match self.args.split_first() {
            Some((c, rest)) => (c.clone(), rest.to_vec()),
            None => (String::new(), Vec::new()),
        };
        Exec {
            command,
            argv,
            shell: false,
            env: self.env.clone(),
            clear_env: true,
            cwd: Some(self.cwd.clone()),
            user: Some(User {
                uid: self.uid,
                gid: self.gid,
            }),
            stdin: StdinMode::Null,
            timeout_ms: None,
            output_limit: None,
            background: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> MainProcess {
        MainProcess {
            args: vec!["/bin/sh".into(), "-c".into(), "echo hi".into()],
            env: vec![("PATH".into(), DEFAULT_PATH.into())],
            cwd: "/data".into(),
            uid: 1000,
            gid: 100,
        }
    }

    #[test]
    fn a_spec_round_trips_and_becomes_a_background_exec_of_its_own_environment() {
        let m = spec();
        assert_eq!(MainProcess::from_json(&m.to_json()).unwrap(), m);
        let e = m.to_exec();
        assert_eq!(e.command, "/bin/sh");
        assert_eq!(e.argv, ["-c", "echo hi"]);
        assert!(e.background && e.clear_env && !e.shell);
        assert_eq!(e.cwd.as_deref(), Some("/data"));
        assert_eq!(
            e.user,
            Some(User {
                uid: 1000,
                gid: 100
            })
        );
    }

    #[test]
    fn a_bad_spec_is_refused_with_its_reason() {
        let mut m = spec();
        m.args.clear();
        assert!(MainProcess::from_json(&m.to_json())
            .unwrap_err()
            .contains("no program"));
        let mut m = spec();
        m.cwd = "data".into();
        assert!(MainProcess::from_json(&m.to_json())
            .unwrap_err()
            .contains("not absolute"));
        assert!(MainProcess::from_json(b"{")
            .unwrap_err()
            .contains("not valid"));
        let big = vec![b' '; MAX_SPEC_BYTES as usize + 1];
        assert!(MainProcess::from_json(&big).unwrap_err().contains("over"));
    }
}
