//! `NetConfigure` against the agent run as a host process, in a network
//! namespace of its own (`ip netns exec`) holding `dummy` interfaces, so the
//! host's network is never touched; name servers go to a file in a temp dir
//! (the hidden `--resolv-conf`), never to the host's `/etc/resolv.conf`. A
//! kernel without the `dummy` link type gets a `veth` pair instead (its peer,
//! named after it with a `p`, up in the same namespace).
//!
//! Needs root and iproute2 (`ip`, and the `dummy` or `veth` link type):
//! without them these tests say why on stderr and pass without running.

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::Agent;
use guest_agent::client::Client;
use guest_agent::protocol::{ErrorCode, NetConfigure};

const IF: &str = "sprouttest0";

/// A network namespace, deleted on drop.
struct Netns {
    name: String,
}

impl Netns {
    /// A fresh namespace, or why there can be none here.
    fn new() -> Result<Netns, String> {
        if !rustix::process::geteuid().is_root() {
            return Err("not running as root".into());
        }
        match Command::new("ip").arg("-V").output() {
            Ok(o) if o.status.success() => {}
            _ => return Err("`ip` (iproute2) is missing".into()),
        }
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let name = format!(
            "sprout-test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        run(&["ip", "netns", "add", &name]).map_err(|e| format!("cannot add a netns: {e}"))?;
        let ns = Netns { name };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// `ip -n NS args...`, its stdout.
    fn ip(&self, args: &[&str]) -> Result<String, String> {
        let mut all = vec!["ip", "-n", &self.name];
        all.extend_from_slice(args);
        run(&all)
    }

    /// Adds an Ethernet interface `name` that leads nowhere: a dummy, else
    /// one end of a veth pair.
    fn add_dummy(&self, name: &str) -> Result<(), String> {
        let Err(no_dummy) = self.ip(&["link", "add", name, "type", "dummy"]) else {
            return Ok(());
        };
        let peer = format!("{name}p");
        let veth = ["link", "add", name, "type", "veth", "peer", "name", &peer];
        self.ip(&veth)
            .and_then(|_| self.ip(&["link", "set", &peer, "up"]))
            .map(drop)
            .map_err(|e| format!("cannot add a dummy interface ({no_dummy}) nor a veth ({e})"))
    }

    /// The agent, in this namespace, allowed to change it.
    fn agent(&self, resolv_conf: &Path) -> Agent {
        let resolv = resolv_conf.to_str().unwrap();
        Agent::start_wrapped(
            &["ip", "netns", "exec", &self.name],
            &["--allow-identity", "--resolv-conf", resolv],
        )
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = run(&["ip", "netns", "del", &self.name]);
    }
}

fn run(argv: &[&str]) -> Result<String, String> {
    let out = Command::new(argv[0])
        .args(&argv[1..])
        .output()
        .map_err(|e| format!("{argv:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{argv:?}: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A namespace with a dummy interface `IF`, or `None` after saying why not.
fn netns_with_dummy(test: &str) -> Option<Netns> {
    let made = Netns::new().and_then(|ns| ns.add_dummy(IF).map(|()| ns));
    match made {
        Ok(ns) => Some(ns),
        Err(why) => {
            eprintln!("SKIPPED {test}: {why}");
            None
        }
    }
}

fn request() -> NetConfigure {
    NetConfigure {
        mac: [0x02, 0x00, 0x00, 0xaa, 0xbb, 0xcc],
        address: [10, 77, 0, 2],
        prefix_len: 24,
        gateway: Some([10, 77, 0, 1]),
        dns: vec![[10, 77, 0, 1], [9, 9, 9, 9]],
        interface: Some(IF.into()),
    }
}

/// The default routes of the namespace, one per line, trimmed.
fn default_routes(ns: &Netns) -> Vec<String> {
    ns.ip(&["-4", "route", "show", "default"])
        .unwrap()
        .lines()
        .map(|l| l.trim().to_owned())
        .filter(|l| !l.is_empty())
        .collect()
}

/// The MAC, the address and prefix, and the default route come out as asked
/// (another interface's default route replaced); name servers go to the
/// resolver file, replacing a symlink there. A second request without an
/// interface picks the dummy (the only non-loopback one), replaces the
/// address, and leaves the resolver file alone when it names no server.
#[tokio::test]
async fn configures_a_dummy_interface() {
    let Some(ns) = netns_with_dummy("configures_a_dummy_interface") else {
        return;
    };
    // Another interface with a default route of its own, to be replaced.
    ns.add_dummy("sprouttest1").unwrap();
    ns.ip(&["addr", "add", "192.168.50.2/24", "dev", "sprouttest1"])
        .unwrap();
    ns.ip(&["link", "set", "sprouttest1", "up"]).unwrap();
    ns.ip(&["route", "add", "default", "via", "192.168.50.1"])
        .unwrap();
    let files = tempfile::tempdir().unwrap();
    let stub = files.path().join("stub-resolv.conf");
    std::fs::write(&stub, "nameserver 127.0.0.53\n").unwrap();
    let resolv = files.path().join("resolv.conf");
    std::os::unix::fs::symlink(&stub, &resolv).unwrap();

    let agent = ns.agent(&resolv);
    let c = agent.client();
    assert_eq!(c.net_configure(request()).await.unwrap(), IF);

    let link = ns.ip(&["-o", "link", "show", "dev", IF]).unwrap();
    assert!(link.contains("link/ether 02:00:00:aa:bb:cc "), "{link}");
    assert!(link.contains(",UP"), "{link}");
    let addr = ns.ip(&["-o", "-4", "addr", "show", "dev", IF]).unwrap();
    assert!(addr.contains("inet 10.77.0.2/24 "), "{addr}");
    assert!(addr.contains("brd 10.77.0.255 "), "{addr}");
    let routes = default_routes(&ns);
    assert_eq!(routes.len(), 1, "{routes:?}");
    assert!(
        routes[0].starts_with(&format!("default via 10.77.0.1 dev {IF}")),
        "{routes:?}"
    );
    let meta = std::fs::symlink_metadata(&resolv).unwrap();
    assert!(meta.file_type().is_file(), "the symlink was not replaced");
    let text = std::fs::read_to_string(&resolv).unwrap();
    let servers: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(servers, ["nameserver 10.77.0.1", "nameserver 9.9.9.9"]);
    assert_eq!(
        std::fs::read_to_string(&stub).unwrap(),
        "nameserver 127.0.0.53\n"
    );

    // Again, the interface left to the agent, and no name servers.
    ns.ip(&["link", "del", "sprouttest1"]).unwrap();
    let again = NetConfigure {
        mac: [0x0a, 0x11, 0x22, 0x33, 0x44, 0x55],
        address: [10, 88, 0, 5],
        prefix_len: 16,
        gateway: Some([10, 88, 255, 254]),
        dns: vec![],
        interface: None,
    };
    assert_eq!(c.net_configure(again).await.unwrap(), IF);
    let link = ns.ip(&["-o", "link", "show", "dev", IF]).unwrap();
    assert!(link.contains("link/ether 0a:11:22:33:44:55 "), "{link}");
    let addr = ns.ip(&["-o", "-4", "addr", "show", "dev", IF]).unwrap();
    assert!(addr.contains("inet 10.88.0.5/16 "), "{addr}");
    assert!(!addr.contains("10.77.0.2"), "{addr}");
    let routes = default_routes(&ns);
    assert_eq!(routes.len(), 1, "{routes:?}");
    assert!(
        routes[0].starts_with(&format!("default via 10.88.255.254 dev {IF}")),
        "{routes:?}"
    );
    assert_eq!(std::fs::read_to_string(&resolv).unwrap(), text);
}

/// Bad values are `BadRequest`, an interface the guest lacks `NotFound` naming
/// it, the loopback is refused: each before anything changes, and the agent
/// serves on.
#[tokio::test]
async fn bad_requests_change_nothing() {
    let Some(ns) = netns_with_dummy("bad_requests_change_nothing") else {
        return;
    };
    let files = tempfile::tempdir().unwrap();
    let resolv = files.path().join("resolv.conf");
    let agent = ns.agent(&resolv);
    let c = agent.client();
    let before = ns.ip(&["-o", "link", "show", "dev", IF]).unwrap();

    async fn refused(c: &Client, req: NetConfigure, code: ErrorCode, says: &str) {
        let e = c.net_configure(req).await.err().unwrap();
        assert_eq!(e.code(), Some(code), "{e}");
        assert!(e.to_string().contains(says), "{e}");
    }
    let bad = ErrorCode::BadRequest;
    let r = request;
    refused(
        &c,
        NetConfigure {
            prefix_len: 31,
            ..r()
        },
        bad,
        "31",
    )
    .await;
    refused(
        &c,
        NetConfigure {
            prefix_len: 0,
            ..r()
        },
        bad,
        "Prefix",
    )
    .await;
    let mac = [0x01, 0, 0x5e, 0, 0, 1];
    refused(&c, NetConfigure { mac, ..r() }, bad, "multicast").await;
    let dns = vec![[1, 1, 1, 1]; 5];
    refused(&c, NetConfigure { dns, ..r() }, bad, "at most 4").await;
    let gateway = Some([10, 78, 0, 1]);
    refused(&c, NetConfigure { gateway, ..r() }, bad, "Gateway").await;
    let interface = Some("a/b".into());
    refused(&c, NetConfigure { interface, ..r() }, bad, "a/b").await;
    let interface = Some("x".repeat(16));
    refused(&c, NetConfigure { interface, ..r() }, bad, "invalid").await;
    let interface = Some("nosuch0".into());
    let notfound = ErrorCode::NotFound;
    refused(&c, NetConfigure { interface, ..r() }, notfound, "nosuch0").await;
    let interface = Some("lo".into());
    refused(&c, NetConfigure { interface, ..r() }, bad, "loopback").await;

    assert_eq!(ns.ip(&["-o", "link", "show", "dev", IF]).unwrap(), before);
    let addr = ns.ip(&["-o", "-4", "addr", "show", "dev", IF]).unwrap();
    assert!(addr.trim().is_empty(), "{addr}");
    assert!(default_routes(&ns).is_empty());
    assert!(!resolv.exists());
    // lo is still up.
    let lo = ns.ip(&["-o", "link", "show", "dev", "lo"]).unwrap();
    assert!(lo.contains(",UP"), "{lo}");

    // With no interface but the loopback, none is chosen.
    ns.ip(&["link", "del", IF]).unwrap();
    let none = NetConfigure {
        interface: None,
        ..r()
    };
    refused(&c, none, notfound, "no network interface but the loopback").await;
    c.ping().await.unwrap();
}

/// An agent without `--allow-identity` refuses it before looking at it (this
/// one runs on the host's own network: it must change nothing).
#[tokio::test]
async fn an_agent_without_allow_identity_refuses_it() {
    let agent = Agent::start();
    let c = agent.client();
    let e = c.net_configure(request()).await.err().unwrap();
    assert_eq!(e.code(), Some(ErrorCode::Forbidden), "{e}");
    assert!(e.to_string().contains("--allow-identity"), "{e}");
    c.ping().await.unwrap();
}
