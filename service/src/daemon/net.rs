//! Each sandbox's network: its worker's own network namespace (made by the
//! jail, `sprout_worker::jail::tap`) holds the VM's TAP, `tap0`; sproutd
//! joins that namespace to the host with a veth pair and routes it, and one
//! nftables table NATs the sandboxes' traffic out of the host's own routes.
//!
//! Addresses: sandbox slot `n` (0..16384, the lowest free) owns two /30s,
//! `10.200.0.0/16` inside its namespace (`tap0` is `.1`, the guest `.2`)
//! and `10.201.0.0/16` on the veth pair (the host side `sp{n}` is `.1`,
//! the namespace side `veth0` `.2`). Every guest has its own address, and a
//! fork's children get their own slot and MAC: cloned networking never
//! collides, and the guest is told its address again after every boot,
//! restore and fork (the agent's `NetConfigure`).
//!
//! The table `inet sprout` (made at start-up, replacing any earlier one):
//! sandboxes reach nothing on the host itself (its `input` from `sp*`
//! accepts only replies), nothing of each other (`sp*` to `sp*` is dropped
//! in `forward`), nor the link-local range (cloud metadata services) or the
//! host's default gateway (which, in QEMU's user network, is the host's own
//! loopback); everything else leaves masqueraded. A sandbox created with
//! `disableInternet` gets no veth pair at all: its TAP leads nowhere.
//!
//! A namespace ends with its worker, and its veth pair with it; a sandbox
//! keeps its slot (its address) across rest states until it is deleted.

use std::collections::HashMap;
use std::io::Write;
use std::net::Ipv4Addr;
use std::os::fd::AsFd;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Mutex;

use uuid::Uuid;

use super::lock;
use super::rtnl::Rtnl;

/// How many slots there are (a /30 each in a /16).
const SLOTS: u16 = 16384;
/// The TAP in every worker's namespace.
pub const TAP: &str = sprout_worker::jail::tap::TAP_NAME;
/// The MAC of every sandbox's `tap0` (the guest's gateway): the same in
/// every namespace, so a restored guest's ARP entry for it stays right.
const GATEWAY_MAC: [u8; 6] = [0x02, 0x73, 0x70, 0x00, 0x00, 0x01];
/// The nftables table sproutd owns.
const TABLE: &str = "sprout";

/// A sandbox's network, as its guest is told it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub slot: u16,
    pub mac: [u8; 6],
    pub address: Ipv4Addr,
    pub prefix_len: u8,
    /// None with `disableInternet`: there is nowhere to go.
    pub gateway: Option<Ipv4Addr>,
    pub dns: Vec<Ipv4Addr>,
}

impl Lease {
    pub fn mac_string(&self) -> String {
        mac_string(&self.mac)
    }
}

pub fn mac_string(m: &[u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// The MAC of sandbox `id`'s network device: locally administered,
/// unicast, from its id (a fork's children have their own ids).
pub fn mac_for(id: Uuid) -> [u8; 6] {
    let b = id.as_bytes();
    [0x02, b[0], b[1], b[2], b[3], b[4]]
}

/// `10.{base}.x.y` for offset `n*4 + k`.
fn addr(base: u8, slot: u16, k: u16) -> Ipv4Addr {
    let v = u32::from(slot) * 4 + u32::from(k);
    Ipv4Addr::new(10, base, (v >> 8) as u8, v as u8)
}

/// The host-side interface of slot `n`.
fn host_if(slot: u16) -> String {
    format!("sp{slot}")
}

pub struct Network {
    /// Why sandboxes have no network here (None: they have one).
    unavailable: Option<String>,
    /// Why sandboxes that have one reach nothing outside anyway.
    no_egress: Option<String>,
    dns: Vec<Ipv4Addr>,
    /// Each sandbox's slot, held until it is deleted.
    slots: Mutex<HashMap<Uuid, u16>>,
}

impl Network {
    /// A host without a network for sandboxes.
    pub fn off(why: impl Into<String>) -> Network {
        Network {
            unavailable: Some(why.into()),
            no_egress: None,
            dns: Vec::new(),
            slots: Mutex::new(HashMap::new()),
        }
    }

    /// Checks what sandbox networks need here and sets up the host's side
    /// (forwarding on, the nftables table); says why not where it cannot.
    /// Guests resolve names with `dns`, else with the host's resolvers.
    pub fn start(jailed: bool, enabled: bool, dns: &[Ipv4Addr]) -> Network {
        if !enabled {
            return Network::off("--no-network was given");
        }
        match setup(jailed) {
            Ok(()) => Network {
                unavailable: None,
                no_egress: None,
                dns: if dns.is_empty() {
                    host_dns()
                } else {
                    dns.to_vec()
                },
                slots: Mutex::new(HashMap::new()),
            },
            Err(why) => Network::off(why),
        }
    }

    /// The resolvers guests are given.
    pub fn dns(&self) -> &[Ipv4Addr] {
        &self.dns
    }

    /// Whether sandboxes get a network device (and their guests an address).
    pub fn enabled(&self) -> bool {
        self.unavailable.is_none()
    }

    /// Whether sandboxes reach outside the host (unless `disableInternet`).
    pub fn egress(&self) -> bool {
        self.enabled() && self.no_egress.is_none()
    }

    /// Sandboxes have their network, but this host's own reaches nothing
    /// outside: `why`.
    pub fn set_no_egress(&mut self, why: impl Into<String>) {
        self.no_egress = Some(why.into());
    }

    /// Why sandboxes have no network, or no egress, if so.
    pub fn unavailable(&self) -> Option<&str> {
        self.unavailable.as_deref().or(self.no_egress.as_deref())
    }

    /// Joins the network namespace of worker `pid` (which runs sandbox
    /// `id`'s VM on its `tap0`) to the host: addresses, routes, and unless
    /// `internet` is false a veth pair to the host. Blocking (rtnetlink
    /// requests, `rtnl.rs`); attaches of different sandboxes run in
    /// parallel (only the slot choice is serialized).
    ///
    /// A sandbox keeps its slot across workers. Each host-side interface
    /// carries its sandbox's id as its alias: the one an earlier worker of
    /// this sandbox left is deleted, while one of another sandbox (another
    /// sproutd on this host may have taken the slot meanwhile, or be
    /// taking it now) sends this one to another slot.
    pub fn attach(&self, id: Uuid, pid: u32, internet: bool) -> Result<Lease, String> {
        let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))
            .map_err(|e| format!("Cannot open the network namespace of worker {pid}: {e}"))?;
        self.attach_ns(id, &ns, internet)
    }

    /// [`attach`](Self::attach) to the namespace `ns`.
    fn attach_ns(&self, id: Uuid, ns: &std::fs::File, internet: bool) -> Result<Lease, String> {
        let mut host = Rtnl::open().map_err(|e| format!("Cannot open rtnetlink: {e}"))?;
        let alias = format!("sprout:{id}");
        let mut last = String::new();
        for _ in 0..8 {
            let slot = self.slot(id)?;
            let name = host_if(slot);
            let sys = Path::new("/sys/class/net").join(&name);
            if sys.exists() {
                let owner = std::fs::read_to_string(sys.join("ifalias")).unwrap_or_default();
                if owner.trim() != alias {
                    lock(&self.slots).remove(&id);
                    continue;
                }
                // This sandbox's own, from a worker that ended.
                if let Ok(i) = host.index(&name) {
                    let _ = host.del_link(i);
                }
            }
            match self.join(&mut host, id, slot, ns, internet, &alias) {
                Ok(l) => return Ok(l),
                Err((true, e)) => {
                    lock(&self.slots).remove(&id);
                    last = e;
                }
                Err((false, e)) => return Err(e),
            }
        }
        Err(format!("No free sandbox network slot was found ({last})"))
    }

    /// [`attach`](Self::attach) on `slot`; a failure says whether the
    /// slot's host interface was taken meanwhile (try another).
    fn join(
        &self,
        host: &mut Rtnl,
        id: Uuid,
        slot: u16,
        ns: &std::fs::File,
        internet: bool,
        alias: &str,
    ) -> Result<Lease, (bool, String)> {
        let name = host_if(slot);
        let (gw, guest) = (addr(200, slot, 1), addr(200, slot, 2));
        let (vhost, vns) = (addr(201, slot, 1), addr(201, slot, 2));
        let fail = |what: &str, e: std::io::Error| (false, format!("{what}: {e}"));
        // The host's side first, whole (its route's next hop is on a link
        // whose other end is not up yet: the kernel takes it, "linkdown"),
        // then the namespace's.
        if internet {
            host.add_veth(&name, "veth0", ns.as_fd()).map_err(|e| {
                (
                    e.kind() == std::io::ErrorKind::AlreadyExists,
                    format!("Cannot make the veth pair {name}: {e}"),
                )
            })?;
            let i = host
                .index(&name)
                .map_err(|e| fail(&format!("Cannot find {name}"), e))?;
            host.set_up(i, None, Some(alias))
                .and_then(|()| host.add_addr(i, vhost, 30))
                .and_then(|()| host.add_route(addr(200, slot, 0), 30, vns, i))
                .map_err(|e| fail(&format!("Cannot set {name} up"), e))?;
        }
        let inside = |what: &str, e: std::io::Error| {
            (
                false,
                format!("In the sandbox's network namespace, {what}: {e}"),
            )
        };
        let mut nsl =
            Rtnl::in_namespace(ns.as_fd()).map_err(|e| inside("cannot open rtnetlink", e))?;
        let lo = nsl.index("lo").map_err(|e| inside("no lo", e))?;
        nsl.set_up(lo, None, None)
            .map_err(|e| inside("cannot set lo up", e))?;
        let tap = nsl.index(TAP).map_err(|e| inside("no TAP", e))?;
        nsl.set_up(tap, Some(GATEWAY_MAC), None)
            .and_then(|()| nsl.add_addr(tap, gw, 30))
            .map_err(|e| inside(&format!("cannot set {TAP} up"), e))?;
        if internet {
            let v = nsl.index("veth0").map_err(|e| inside("no veth0", e))?;
            nsl.add_addr(v, vns, 30)
                .and_then(|()| nsl.set_up(v, None, None))
                .and_then(|()| nsl.add_route(Ipv4Addr::UNSPECIFIED, 0, vhost, v))
                .map_err(|e| inside("cannot set veth0 up", e))?;
        }
        Ok(Lease {
            slot,
            mac: mac_for(id),
            address: guest,
            prefix_len: 30,
            gateway: internet.then_some(gw),
            dns: if internet {
                self.dns.clone()
            } else {
                Vec::new()
            },
        })
    }

    /// Sandbox `id`'s slot: the one it holds, else the lowest free one.
    fn slot(&self, id: Uuid) -> Result<u16, String> {
        let mut slots = lock(&self.slots);
        if let Some(&s) = slots.get(&id) {
            return Ok(s);
        }
        let held: std::collections::HashSet<u16> = slots.values().copied().collect();
        let free = (0..SLOTS)
            .find(|s| !held.contains(s) && !Path::new("/sys/class/net").join(host_if(*s)).exists());
        let s =
            free.ok_or_else(|| format!("Every one of the {SLOTS} sandbox networks is in use"))?;
        slots.insert(id, s);
        Ok(s)
    }

    /// Sandbox `id` is deleted: its slot is free once its worker's
    /// namespace (and veth pair) is gone.
    pub fn release(&self, id: Uuid) {
        lock(&self.slots).remove(&id);
    }
}

/// Runs `cmd` (stdin piped, stderr kept) with `input` on its stdin; its
/// stderr when it fails.
fn feed(cmd: &mut Command, input: &str) -> Result<(), String> {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run it: {e}"))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(input.as_bytes())
            .map_err(|e| format!("cannot write to it: {e}"))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("it did not end: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Forwarding on and the nftables table in place: what every sandbox
/// network needs from the host.
fn setup(jailed: bool) -> Result<(), String> {
    if !jailed {
        return Err(
            "workers are not jailed (each sandbox's network is its jailed worker's own \
                    network namespace: sproutd must run as root, without --no-jail)"
                .into(),
        );
    }
    if !Path::new("/dev/net/tun").exists() {
        return Err("this host has no /dev/net/tun (the tun module is not loaded)".into());
    }
    let nft = Command::new("nft")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !nft {
        return Err("`nft` is not installed (apt-get install nftables)".into());
    }
    std::fs::write("/proc/sys/net/ipv4/ip_forward", "1\n")
        .map_err(|e| format!("cannot turn IPv4 forwarding on: {e}"))?;
    let mut denied = vec!["169.254.0.0/16".to_string()];
    if let Some(gw) = default_gateway() {
        denied.push(gw.to_string());
    }
    let rules = ruleset(&denied);
    feed(Command::new("nft").args(["-f", "-"]), &rules).map_err(|e| {
        format!("nftables refused sproutd's table ({e}; are the nf_tables and NAT modules there?)")
    })
}

/// The table, replacing any earlier one (`table` then `delete table`
/// makes the delete succeed whether or not it existed).
fn ruleset(denied: &[String]) -> String {
    format!(
        "table inet {TABLE}\ndelete table inet {TABLE}\n\
         table inet {TABLE} {{\n\
         \tchain input {{\n\t\ttype filter hook input priority filter; policy accept;\n\
         \t\tiifname \"sp*\" ct state established,related accept\n\
         \t\tiifname \"sp*\" drop\n\t}}\n\
         \tchain forward {{\n\t\ttype filter hook forward priority filter; policy accept;\n\
         \t\tiifname \"sp*\" oifname \"sp*\" drop\n\
         \t\tiifname \"sp*\" ip daddr {{ {} }} drop\n\t}}\n\
         \tchain postrouting {{\n\t\ttype nat hook postrouting priority srcnat; policy accept;\n\
         \t\tip saddr 10.200.0.0/16 oifname != \"sp*\" masquerade\n\t}}\n}}\n",
        denied.join(", ")
    )
}

/// The IPv4 default route's gateway, from /proc/net/route.
fn default_gateway() -> Option<Ipv4Addr> {
    let s = std::fs::read_to_string("/proc/net/route").ok()?;
    s.lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() > 2 && f[1] == "00000000" {
            let g = u32::from_str_radix(f[2], 16).ok()?;
            // /proc/net/route is in host (little-endian) byte order.
            (g != 0).then(|| Ipv4Addr::from(g.swap_bytes()))
        } else {
            None
        }
    })
}

/// The host's resolvers a guest can reach (loopback ones cannot be): those
/// of `/etc/resolv.conf`, else, behind systemd-resolved's loopback stub,
/// the upstream ones it lists.
fn host_dns() -> Vec<Ipv4Addr> {
    ["/etc/resolv.conf", "/run/systemd/resolve/resolv.conf"]
        .iter()
        .map(|p| parse_resolv(&std::fs::read_to_string(p).unwrap_or_default()))
        .find(|v| !v.is_empty())
        .unwrap_or_default()
}

fn parse_resolv(s: &str) -> Vec<Ipv4Addr> {
    s.lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|v| v.trim().parse::<Ipv4Addr>().ok())
        .filter(|a| !a.is_loopback() && !a.is_unspecified())
        .take(3)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    /// `cmd args...`, its stdout, or why it failed.
    fn run(cmd: &str, args: &[&str]) -> Result<String, String> {
        let o = Command::new(cmd)
            .args(args)
            .output()
            .map_err(|e| format!("{cmd}: {e}"))?;
        if o.status.success() {
            Ok(String::from_utf8_lossy(&o.stdout).into_owned())
        } else {
            Err(format!(
                "{cmd} {args:?}: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ))
        }
    }

    /// A network namespace like a jailed worker's (`lo` and a `tap0`),
    /// deleted on drop with everything in it.
    struct Netns(String);

    impl Netns {
        fn new(tag: &str) -> Netns {
            let name = format!("sprout-net-{}-{tag}", std::process::id());
            run("ip", &["netns", "add", &name]).unwrap();
            let ns = Netns(name);
            ns.ip(&["tuntap", "add", TAP, "mode", "tap"]).unwrap();
            ns
        }
        fn ip(&self, args: &[&str]) -> Result<String, String> {
            let mut all = vec!["-n", &self.0];
            all.extend_from_slice(args);
            run("ip", &all)
        }
        fn file(&self) -> std::fs::File {
            std::fs::File::open(format!("/run/netns/{}", self.0)).unwrap()
        }
    }

    impl Drop for Netns {
        fn drop(&mut self) {
            let _ = run("ip", &["netns", "del", &self.0]);
        }
    }

    /// Attaches over rtnetlink on this host, in namespaces of the test's
    /// own (the host's side is a real `sp<N>` while it runs): addresses,
    /// MACs, routes and forwarding as the guest is told them; the same
    /// sandbox keeps its slot in a new namespace and its old interface is
    /// replaced; another sandbox gets another slot; `disableInternet`
    /// gets no veth pair and no route. Needs root and iproute2 (to make
    /// the namespaces and look at them): without them it says why and
    /// passes without running.
    #[test]
    fn attach_joins_a_namespace_to_the_host_over_rtnetlink() {
        if !rustix::process::geteuid().is_root() || run("ip", &["-V"]).is_err() {
            eprintln!("skipped: needs root and iproute2");
            return;
        }
        let net = Network::off("test");
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let ns1 = Netns::new("a1");
        let t = std::time::Instant::now();
        let la = net.attach_ns(a, &ns1.file(), true).unwrap();
        eprintln!("attach took {:?}", t.elapsed());
        let (s, host) = (la.slot, host_if(la.slot));
        assert_eq!(la.address, addr(200, s, 2));
        assert_eq!(la.gateway, Some(addr(200, s, 1)));
        assert_eq!(la.mac, mac_for(a));
        let tap = ns1.ip(&["addr", "show", "dev", TAP]).unwrap();
        assert!(
            tap.contains(&format!("inet {}/30", addr(200, s, 1))),
            "{tap}"
        );
        assert!(tap.contains("link/ether 02:73:70:00:00:01"), "{tap}");
        assert!(tap.contains(",UP"), "{tap}");
        let veth = ns1.ip(&["addr", "show", "dev", "veth0"]).unwrap();
        assert!(
            veth.contains(&format!("inet {}/30", addr(201, s, 2))),
            "{veth}"
        );
        let routes = ns1.ip(&["route"]).unwrap();
        assert!(
            routes.contains(&format!("default via {} dev veth0", addr(201, s, 1))),
            "{routes}"
        );
        assert!(ns1.ip(&["link", "show", "lo"]).unwrap().contains(",UP"));
        let fwd = run(
            "ip",
            &[
                "netns",
                "exec",
                &ns1.0,
                "cat",
                "/proc/sys/net/ipv4/ip_forward",
            ],
        )
        .unwrap();
        assert_eq!(fwd.trim(), "1");
        let h = run("ip", &["addr", "show", "dev", &host]).unwrap();
        assert!(h.contains(&format!("inet {}/30", addr(201, s, 1))), "{h}");
        let hl = run("ip", &["link", "show", "dev", &host]).unwrap();
        assert!(hl.contains(&format!("alias sprout:{a}")), "{hl}");
        let hr = run("ip", &["route", "show", "dev", &host]).unwrap();
        assert!(
            hr.contains(&format!("{}/30 via {}", addr(200, s, 0), addr(201, s, 2))),
            "{hr}"
        );

        // The pair carries traffic: the host connects to a listener in
        // the namespace, on the namespace's side of the pair.
        let ns_file = ns1.file();
        let listener = std::thread::scope(|sc| {
            sc.spawn(|| {
                // SAFETY: a namespace descriptor that outlives this thread,
                // which alone joins it and then ends.
                let r = unsafe { libc::setns(ns_file.as_raw_fd(), libc::CLONE_NEWNET) };
                assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
                std::net::TcpListener::bind((addr(201, s, 2), 0)).unwrap()
            })
            .join()
            .unwrap()
        });
        let to = listener.local_addr().unwrap();
        std::net::TcpStream::connect_timeout(&to, std::time::Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("connect to {to} in the namespace: {e}"));
        listener.accept().unwrap();

        // Another sandbox, another slot.
        let ns2 = Netns::new("b");
        let lb = net.attach_ns(b, &ns2.file(), true).unwrap();
        assert_ne!(lb.slot, s);
        assert_ne!(lb.address, la.address);

        // Sandbox a in a new worker (its old one still there, as after a
        // kill): same slot, its leftover interface replaced.
        let ns3 = Netns::new("a2");
        let again = net.attach_ns(a, &ns3.file(), true).unwrap();
        assert_eq!(again, la);
        assert!(
            ns1.ip(&["link", "show", "veth0"]).is_err(),
            "the old pair is gone"
        );
        assert!(ns3
            .ip(&["addr", "show", "dev", "veth0"])
            .unwrap()
            .contains("inet "));

        // disableInternet: the TAP only, nowhere to go.
        let c = Uuid::new_v4();
        let ns4 = Netns::new("c");
        let lc = net.attach_ns(c, &ns4.file(), false).unwrap();
        assert_eq!(lc.gateway, None);
        assert!(lc.dns.is_empty());
        assert!(ns4.ip(&["link", "show", "veth0"]).is_err());
        assert!(!ns4.ip(&["route"]).unwrap().contains("default"));
        assert!(!Path::new("/sys/class/net").join(host_if(lc.slot)).exists());

        // A namespace that is gone takes its pair with it.
        drop(ns3);
        let gone = (0..200).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(10));
            !Path::new("/sys/class/net").join(&host).exists()
        });
        assert!(gone, "{host} outlived its namespace");
        for id in [a, b, c] {
            net.release(id);
        }
    }

    #[test]
    fn slots_make_distinct_subnets() {
        assert_eq!(addr(200, 0, 1), Ipv4Addr::new(10, 200, 0, 1));
        assert_eq!(addr(200, 0, 2), Ipv4Addr::new(10, 200, 0, 2));
        assert_eq!(addr(201, 1, 1), Ipv4Addr::new(10, 201, 0, 5));
        assert_eq!(addr(200, 64, 2), Ipv4Addr::new(10, 200, 1, 2));
        assert_eq!(addr(200, SLOTS - 1, 2), Ipv4Addr::new(10, 200, 255, 254));
        assert_eq!(host_if(SLOTS - 1), "sp16383");
    }

    #[test]
    fn macs_are_unicast_local_and_differ_by_sandbox() {
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let m = mac_for(a);
        assert_eq!(m[0] & 1, 0);
        assert_eq!(m[0] & 2, 2);
        assert_ne!(mac_for(a), mac_for(b));
        assert_eq!(mac_string(&[2, 0xab, 0, 1, 2, 3]), "02:ab:00:01:02:03");
    }

    #[test]
    fn resolvers_skip_loopback_and_junk() {
        let r = "# x\nnameserver 127.0.0.53\nnameserver 10.0.2.3\nnameserver ::1\n\
                 nameserver nonsense\nsearch lan\nnameserver 1.1.1.1\n";
        assert_eq!(
            parse_resolv(r),
            [Ipv4Addr::new(10, 0, 2, 3), Ipv4Addr::new(1, 1, 1, 1)]
        );
    }

    #[test]
    fn the_ruleset_denies_what_it_is_given() {
        let r = ruleset(&["169.254.0.0/16".into(), "10.0.2.2".into()]);
        assert!(
            r.contains("ip daddr { 169.254.0.0/16, 10.0.2.2 } drop"),
            "{r}"
        );
        assert!(
            r.starts_with("table inet sprout\ndelete table inet sprout\n"),
            "{r}"
        );
    }
}
