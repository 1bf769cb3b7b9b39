//! `NetConfigure`: the guest's network interface, default route and resolver,
//! set with ioctls (the guest has no `ip`). `sproutd` sends it after every
//! boot, restore and fork, so that each sandbox has the MAC and address its
//! TAP device expects.
//!
//! The whole request is checked before anything changes. Then the interface
//! goes down (its MAC can change only then, on most drivers), takes the MAC,
//! the address and its netmask, comes up, and the default route and
//! `resolv.conf` follow. A step that fails ends the request with `Io` naming
//! the step; an interface taken down by then is brought back up.

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::net::Ipv4Addr;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::sync::Mutex;

use log::{debug, info};

use crate::protocol::{ErrorCode, ErrorMsg, NetConfigure, NetConfigured, MAX_IFNAME, MAX_NET_DNS};
use crate::sys::{NetCtl, IFF_LOOPBACK, IFF_UP_RUNNING};

/// Where the kernel lists network interfaces (in the network namespace of
/// whoever mounted it).
const SYS_CLASS_NET: &str = "/sys/class/net";
/// `ARPHRD_LOOPBACK`, the `type` of a loopback interface.
const ARPHRD_LOOPBACK: u16 = 772;

/// A request, checked.
#[derive(Debug, PartialEq, Eq)]
struct Plan {
    interface: Option<String>,
    mac: [u8; 6],
    address: Ipv4Addr,
    netmask: Ipv4Addr,
    gateway: Option<Ipv4Addr>,
    dns: Vec<Ipv4Addr>,
}

fn bad(message: String) -> ErrorMsg {
    ErrorMsg::new(ErrorCode::BadRequest, message)
}

fn mac_text(mac: &[u8; 6]) -> String {
    let parts: Vec<String> = mac.iter().map(|b| format!("{b:02x}")).collect();
    parts.join(":")
}

/// The netmask of a prefix of `len` (0 to 32) bits.
fn netmask(len: u8) -> Ipv4Addr {
    Ipv4Addr::from(u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0))
}

/// Whether `name` is a name Linux takes for an interface (as `dev_valid_name`
/// checks it): 1 to 15 bytes, not `.` or `..`, no `/`, `:`, NUL or white space.
fn valid_interface(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_IFNAME
        && name != "."
        && name != ".."
        && !name
            .bytes()
            .any(|b| b == b'/' || b == b':' || b == 0 || b.is_ascii_whitespace())
}

/// An address no host has: unspecified, loopback, multicast or broadcast.
fn not_a_host(ip: Ipv4Addr) -> bool {
    ip.is_unspecified() || ip.is_loopback() || ip.is_multicast() || ip.is_broadcast()
}

/// Checks `req` without acting on it.
fn plan(req: &NetConfigure) -> Result<Plan, ErrorMsg> {
    if let Some(name) = &req.interface {
        if !valid_interface(name) {
            return Err(bad(format!(
                "Interface name {name:?} is invalid: use 1 to {MAX_IFNAME} bytes, without \
                 '/', ':' or white space"
            )));
        }
    }
    let mac = mac_text(&req.mac);
    if req.mac[0] & 1 != 0 {
        return Err(bad(format!(
            "MAC address {mac} is a multicast address: the low bit of its first byte must be clear"
        )));
    }
    if req.mac == [0; 6] {
        return Err(bad(format!("MAC address {mac} is not an address")));
    }
    if !(1..=30).contains(&req.prefix_len) {
        return Err(bad(format!(
            "Prefix length {} is invalid: use 1 to 30",
            req.prefix_len
        )));
    }
    let address = Ipv4Addr::from(req.address);
    let netmask = netmask(req.prefix_len);
    let subnet = format!("{address}/{}", req.prefix_len);
    let host = |ip: Ipv4Addr| u32::from(ip) & !u32::from(netmask);
    let on_subnet = |ip: Ipv4Addr| host(ip) != 0 && host(ip) != !u32::from(netmask);
    if not_a_host(address) || !on_subnet(address) {
        return Err(bad(format!("Address {subnet} is not a host address")));
    }
    let gateway = req.gateway.map(Ipv4Addr::from);
    if let Some(gw) = gateway {
        let same_net =
            u32::from(gw) & u32::from(netmask) == u32::from(address) & u32::from(netmask);
        if not_a_host(gw) || !same_net || !on_subnet(gw) || gw == address {
            return Err(bad(format!(
                "Gateway {gw} is not another host of the subnet {subnet}"
            )));
        }
    }
    if req.dns.len() > MAX_NET_DNS {
        return Err(bad(format!(
            "{} name servers: at most {MAX_NET_DNS} are allowed",
            req.dns.len()
        )));
    }
    let dns: Vec<Ipv4Addr> = req.dns.iter().copied().map(Ipv4Addr::from).collect();
    if let Some(ip) = dns
        .iter()
        .find(|ip| ip.is_unspecified() || ip.is_multicast() || ip.is_broadcast())
    {
        return Err(bad(format!("Name server {ip} is not a host address")));
    }
    Ok(Plan {
        interface: req.interface.clone(),
        mac: req.mac,
        address,
        netmask,
        gateway,
        dns,
    })
}

/// The interfaces listed in `dir` (a `/sys/class/net`), sorted by name, each
/// with whether it is a loopback. Entries without a `type` (as
/// `bonding_masters`) are not interfaces.
fn interfaces(dir: &Path) -> io::Result<Vec<(String, bool)>> {
    let mut found = Vec::new();
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        let Ok(kind) = fs::read_to_string(entry.path().join("type")) else {
            continue;
        };
        let loopback = kind.trim().parse::<u16>().ok() == Some(ARPHRD_LOOPBACK);
        found.push((name, loopback));
    }
    found.sort();
    Ok(found)
}

/// The first non-loopback interface of `dir` (a `/sys/class/net`), by name.
fn default_interface(dir: &Path) -> Result<String, ErrorMsg> {
    let all = interfaces(dir).map_err(|e| {
        ErrorMsg::new(
            ErrorCode::Io,
            format!(
                "Cannot list the network interfaces in {}: {e}",
                dir.display()
            ),
        )
    })?;
    all.into_iter()
        .find(|(_, loopback)| !loopback)
        .map(|(name, _)| name)
        .ok_or_else(|| {
            ErrorMsg::new(
                ErrorCode::NotFound,
                format!(
                    "There is no network interface but the loopback (in {})",
                    dir.display()
                ),
            )
        })
}

/// The interfaces' names, for an error message.
fn known_interfaces() -> String {
    match interfaces(Path::new(SYS_CLASS_NET)) {
        Ok(all) if !all.is_empty() => {
            let names: Vec<String> = all.into_iter().map(|(n, _)| n).collect();
            format!("there are {}", names.join(", "))
        }
        _ => format!("{SYS_CLASS_NET} lists none"),
    }
}

/// The text of a `resolv.conf` naming `dns`.
fn render_resolv_conf(dns: &[Ipv4Addr]) -> String {
    let mut text = String::from("# Written by sprout-agent (NetConfigure).\n");
    for ip in dns {
        text.push_str(&format!("nameserver {ip}\n"));
    }
    text
}

/// Replaces `path` atomically with `text`, mode 0644: a temporary file in the
/// same directory, renamed over it (a symlink there is replaced, not followed).
fn replace_file(path: &Path, text: &str) -> io::Result<()> {
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no file name"))?;
    let tmp = path.with_file_name(format!(".{}.sprout-tmp", name.to_string_lossy()));
    match fs::remove_file(&tmp) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let written = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&tmp)?;
        f.set_permissions(fs::Permissions::from_mode(0o644))?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written
}

/// Applies `req` to this machine (blocking), writing name servers to
/// `resolv_conf` (`/etc/resolv.conf` but in tests).
pub(super) fn configure(req: &NetConfigure, resolv_conf: &Path) -> Result<NetConfigured, ErrorMsg> {
    let plan = plan(req)?;
    // One configuration at a time: two interleaved would leave a mix of both.
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let name = match plan.interface.clone() {
        Some(name) => name,
        None => default_interface(Path::new(SYS_CLASS_NET))?,
    };
    let io_err = |what: String, e: io::Error| ErrorMsg::new(ErrorCode::Io, format!("{what}: {e}"));
    let net = NetCtl::new()
        .map_err(|e| io_err("Cannot open a socket to configure the network".into(), e))?;
    let flags = match net.flags(&name) {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::ENODEV) => {
            return Err(ErrorMsg::new(
                ErrorCode::NotFound,
                format!(
                    "There is no network interface {name:?} ({})",
                    known_interfaces()
                ),
            ))
        }
        Err(e) => return Err(io_err(format!("Cannot read the flags of {name}"), e)),
    };
    if flags & IFF_LOOPBACK != 0 {
        return Err(bad(format!("{name} is a loopback interface")));
    }

    // 1. Down (a failure is not one: some drivers take a new MAC while up).
    if let Err(e) = net.set_flags(&name, flags & !IFF_UP_RUNNING) {
        debug!("cannot take {name} down: {e}");
    }
    let mac = mac_text(&plan.mac);
    let while_down = || {
        net.set_mac(&name, plan.mac)
            .map_err(|e| io_err(format!("Cannot set the MAC address of {name} to {mac}"), e))?;
        // 2. The address, then its netmask.
        net.set_address(&name, plan.address).map_err(|e| {
            io_err(
                format!("Cannot set the address of {name} to {}", plan.address),
                e,
            )
        })?;
        net.set_netmask(&name, plan.netmask).map_err(|e| {
            io_err(
                format!("Cannot set the netmask of {name} to {}", plan.netmask),
                e,
            )
        })
    };
    if let Err(e) = while_down() {
        if let Err(up) = net.set_flags(&name, flags) {
            debug!("cannot restore the flags of {name}: {up}");
        }
        return Err(e);
    }
    // 3. Up.
    let now = net.flags(&name).unwrap_or(flags & !IFF_UP_RUNNING);
    net.set_flags(&name, now | IFF_UP_RUNNING)
        .map_err(|e| io_err(format!("Cannot bring {name} up"), e))?;
    // 4. The default route, replacing any other.
    if let Some(gw) = plan.gateway {
        let gone = net.delete_default_routes();
        debug!("{gone} default routes deleted");
        net.add_default_route(&name, gw).map_err(|e| {
            io_err(
                format!("Cannot add the default route via {gw} on {name}"),
                e,
            )
        })?;
    }
    // 5. The resolver.
    if !plan.dns.is_empty() {
        replace_file(resolv_conf, &render_resolv_conf(&plan.dns))
            .map_err(|e| io_err(format!("Cannot write {}", resolv_conf.display()), e))?;
    }
    info!(
        "network: {name} is {mac}, {}/{}, gateway {:?}, name servers {:?}",
        plan.address, req.prefix_len, plan.gateway, plan.dns
    );
    Ok(NetConfigured { interface: name })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> NetConfigure {
        NetConfigure {
            mac: [0x02, 0, 0, 0xaa, 0xbb, 0xcc],
            address: [10, 0, 0, 2],
            prefix_len: 24,
            gateway: Some([10, 0, 0, 1]),
            dns: vec![[10, 0, 0, 1], [1, 1, 1, 1]],
            interface: None,
        }
    }

    fn refused(r: NetConfigure) -> String {
        let e = plan(&r).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadRequest, "{}", e.message);
        e.message
    }

    #[test]
    fn netmasks() {
        assert_eq!(netmask(24), Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!(netmask(1), Ipv4Addr::new(128, 0, 0, 0));
        assert_eq!(netmask(30), Ipv4Addr::new(255, 255, 255, 252));
        assert_eq!(netmask(0), Ipv4Addr::UNSPECIFIED);
        assert_eq!(netmask(32), Ipv4Addr::BROADCAST);
    }

    #[test]
    fn a_good_request_is_planned() {
        let p = plan(&req()).unwrap();
        assert_eq!(p.address, Ipv4Addr::new(10, 0, 0, 2));
        assert_eq!(p.netmask, Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!(p.gateway, Some(Ipv4Addr::new(10, 0, 0, 1)));
        assert_eq!(p.dns.len(), 2);
        let mut r = req();
        r.gateway = None;
        r.dns = vec![];
        r.interface = Some("eth0".into());
        r.prefix_len = 30;
        plan(&r).unwrap();
        r.interface = Some("x".repeat(MAX_IFNAME));
        plan(&r).unwrap();
    }

    #[test]
    fn bad_requests_are_refused() {
        for len in [0, 31, 32, 33] {
            let m = refused(NetConfigure {
                prefix_len: len,
                ..req()
            });
            assert!(m.contains("Prefix length"), "{m}");
        }
        let m = refused(NetConfigure {
            mac: [0x03, 0, 0, 0, 0, 1],
            ..req()
        });
        assert!(
            m.contains("multicast") && m.contains("03:00:00:00:00:01"),
            "{m}"
        );
        refused(NetConfigure {
            mac: [0; 6],
            ..req()
        });
        let m = refused(NetConfigure {
            dns: vec![[1, 1, 1, 1]; 5],
            ..req()
        });
        assert!(m.contains("at most 4"), "{m}");
        refused(NetConfigure {
            dns: vec![[0, 0, 0, 0]],
            ..req()
        });
        for name in ["", "a/b", "a:b", "a b", ".", "..", "a\0b"] {
            refused(NetConfigure {
                interface: Some(name.into()),
                ..req()
            });
        }
        refused(NetConfigure {
            interface: Some("x".repeat(MAX_IFNAME + 1)),
            ..req()
        });
        for address in [
            [0, 0, 0, 0],
            [127, 0, 0, 1],
            [224, 0, 0, 1],
            [10, 0, 0, 0],
            [10, 0, 0, 255],
        ] {
            refused(NetConfigure { address, ..req() });
        }
        for gw in [[10, 0, 1, 1], [10, 0, 0, 2], [10, 0, 0, 255], [10, 0, 0, 0]] {
            let m = refused(NetConfigure {
                gateway: Some(gw),
                ..req()
            });
            assert!(m.contains("Gateway"), "{m}");
        }
    }

    #[test]
    fn the_default_interface_is_the_first_non_loopback_by_name() {
        let t = tempfile::tempdir().unwrap();
        let add = |name: &str, kind: &str| {
            fs::create_dir(t.path().join(name)).unwrap();
            fs::write(t.path().join(name).join("type"), format!("{kind}\n")).unwrap();
        };
        let e = default_interface(t.path()).unwrap_err();
        assert_eq!(e.code, ErrorCode::NotFound);
        add("lo", "772");
        fs::write(t.path().join("bonding_masters"), "").unwrap();
        assert_eq!(
            default_interface(t.path()).unwrap_err().code,
            ErrorCode::NotFound
        );
        add("eth1", "1");
        add("eth0", "1");
        add("a-loop", "772");
        assert_eq!(default_interface(t.path()).unwrap(), "eth0");
        let gone = t.path().join("nothing");
        assert_eq!(default_interface(&gone).unwrap_err().code, ErrorCode::Io);
    }

    #[test]
    fn resolv_conf_is_rendered_and_replaces_a_symlink() {
        let dns = [Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(1, 1, 1, 1)];
        let text = render_resolv_conf(&dns);
        let lines: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(lines, ["nameserver 10.0.0.1", "nameserver 1.1.1.1"]);

        let t = tempfile::tempdir().unwrap();
        let target = t.path().join("stub-resolv.conf");
        fs::write(&target, "nameserver 127.0.0.53\n").unwrap();
        let conf = t.path().join("resolv.conf");
        std::os::unix::fs::symlink(&target, &conf).unwrap();
        replace_file(&conf, &text).unwrap();
        assert!(fs::symlink_metadata(&conf).unwrap().file_type().is_file());
        assert_eq!(fs::read_to_string(&conf).unwrap(), text);
        assert_eq!(
            fs::read_to_string(&target).unwrap(),
            "nameserver 127.0.0.53\n"
        );
        let mode = fs::metadata(&conf).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o644);
        // No temporary file is left behind, and a second write replaces the first.
        replace_file(&conf, "nameserver 9.9.9.9\n").unwrap();
        assert_eq!(fs::read_dir(t.path()).unwrap().count(), 2);
        assert_eq!(fs::read_to_string(&conf).unwrap(), "nameserver 9.9.9.9\n");
    }
}
