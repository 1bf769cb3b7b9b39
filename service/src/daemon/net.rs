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
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Mutex;

use uuid::Uuid;

use super::lock;

/// How many slots there are (a /30 each in a /16).
const SLOTS: u16 = 16384;
/// The TAP in every worker's namespace.
pub const TAP: &str = sprout_worker::jail::tap::TAP_NAME;
/// The MAC of every sandbox's `tap0` (the guest's gateway): the same in
/// every namespace, so a restored guest's ARP entry for it stays right.
const GATEWAY_MAC: &str = "02:73:70:00:00:01";
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
    /// One attach at a time (slot choice, interface names).
    attach: Mutex<()>,
}

impl Network {
    /// A host without a network for sandboxes.
    pub fn off(why: impl Into<String>) -> Network {
        Network {
            unavailable: Some(why.into()),
            no_egress: None,
            dns: Vec::new(),
            slots: Mutex::new(HashMap::new()),
            attach: Mutex::new(()),
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
                attach: Mutex::new(()),
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
    /// `internet` is false a veth pair to the host. Blocking (runs `ip`).
    ///
    /// A sandbox keeps its slot across workers. Each host-side interface
    /// carries its sandbox's id as its alias: the one an earlier worker of
    /// this sandbox left is deleted, while one of another sandbox (another
    /// sproutd on this host may have taken the slot meanwhile, or be
    /// taking it now) sends this one to another slot.
    pub fn attach(&self, id: Uuid, pid: u32, internet: bool) -> Result<Lease, String> {
        let _one = lock(&self.attach);
        let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))
            .map_err(|e| format!("Cannot open the network namespace of worker {pid}: {e}"))?;
        let alias = format!("sprout:{id}");
        let mut last = String::new();
        for _ in 0..8 {
            let slot = self.slot(id)?;
            let host = host_if(slot);
            let sys = Path::new("/sys/class/net").join(&host);
            if sys.exists() {
                let owner = std::fs::read_to_string(sys.join("ifalias")).unwrap_or_default();
                if owner.trim() != alias {
                    lock(&self.slots).remove(&id);
                    continue;
                }
                let _ = ip(None, &format!("link del {host}\n"));
            }
            match self.join(id, slot, pid, &ns, internet, &alias) {
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
        id: Uuid,
        slot: u16,
        pid: u32,
        ns: &std::fs::File,
        internet: bool,
        alias: &str,
    ) -> Result<Lease, (bool, String)> {
        let host = host_if(slot);
        let (gw, guest) = (addr(200, slot, 1), addr(200, slot, 2));
        let (vhost, vns) = (addr(201, slot, 1), addr(201, slot, 2));
        // The host's side first, whole (its route's next hop is on a link
        // whose other end is not up yet: the kernel takes it, "linkdown"),
        // then the namespace's: two `ip` runs.
        if internet {
            ip(
                None,
                &format!(
                    "link add {host} type veth peer name veth0 netns {pid}\n\
                     link set {host} alias {alias}\n\
                     addr add {vhost}/30 dev {host}\nlink set {host} up\n\
                     route add {}/30 via {vns} dev {host}\n",
                    addr(200, slot, 0)
                ),
            )
            .map_err(|e| (e.contains("File exists"), e))?;
        }
        let mut inside = format!(
            "link set lo up\nlink set {TAP} down\nlink set {TAP} address {GATEWAY_MAC}\n\
             addr flush dev {TAP}\naddr add {gw}/30 dev {TAP}\nlink set {TAP} up\n"
        );
        if internet {
            inside.push_str(&format!(
                "addr add {vns}/30 dev veth0\nlink set veth0 up\nroute add default via {vhost}\n"
            ));
        }
        ip(Some(ns), &inside).map_err(|e| (false, e))?;
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

/// Runs `ip -batch -` on `script`, in the network namespace `ns` if given
/// (the child joins it before it runs `ip`).
fn ip(ns: Option<&std::fs::File>, script: &str) -> Result<(), String> {
    let mut cmd = Command::new("ip");
    cmd.args(["-batch", "-"]);
    if let Some(ns) = ns {
        let fd = ns.as_raw_fd();
        // SAFETY: the closure runs in the child between fork and exec and
        // makes only async-signal-safe system calls (setns, open, write,
        // close) on data it does not allocate: the namespace's descriptor
        // (open in the parent, inherited) and static strings.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // Forwarding, per namespace (this /proc/sys/net is the
                // namespace's own now).
                let f = libc::open(
                    c"/proc/sys/net/ipv4/ip_forward".as_ptr(),
                    libc::O_WRONLY | libc::O_CLOEXEC,
                );
                if f < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let n = libc::write(f, b"1\n".as_ptr().cast(), 2);
                libc::close(f);
                if n != 2 {
                    return Err(std::io::Error::other("cannot turn forwarding on"));
                }
                Ok(())
            });
        }
    }
    feed(&mut cmd, script).map_err(|e| {
        format!(
            "ip (iproute2) failed: {e} (commands: {})",
            script.trim().replace('\n', "; ")
        )
    })
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
    for (tool, arg, pkg) in [("ip", "-V", "iproute2"), ("nft", "--version", "nftables")] {
        let ok = Command::new(tool)
            .arg(arg)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            return Err(format!("`{tool}` is not installed (apt-get install {pkg})"));
        }
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
