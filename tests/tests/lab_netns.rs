//! What sproutd needs of the emulated lab (tests/lab/, see docs/guest.md) to
//! give each sandbox a network: the outer kernel's tun, veth, nf_tables NAT
//! and conntrack modules, and iproute2's `ip` and `nft` in its initramfs
//! (tests/lab/build.sh). Two "sandbox" network namespaces, `a` (with a TAP)
//! and `b`, are joined to the root namespace by veth pairs named `sp*`; a
//! third, `inet`, stands for the outside world. An `inet` nftables table like
//! sproutd's masquerades the sandboxes' traffic out, drops what goes from
//! one sandbox to another, and drops connections a sandbox opens to the root
//! namespace while letting replies to the root namespace's own in (ct
//! state). From `a`, a page served in `inet` must come back (routed and
//! masqueraded: `inet` has no route to the sandboxes' addresses), and TCP
//! connects to listeners in the root namespace and in `b`, which answer
//! before the table is loaded, must time out after it.
//!
//! About 25 s of host time (one outer VM boot; two 5 s connect timeouts).

use std::time::Duration;

use sprout_tests::lab;

const SCRIPT: &str = r##"
fail() { echo "net: FAIL $*"; exit 1; }
# This script's shell is busybox's, which runs its own applets before
# anything on PATH (and its ip has no netns, veth or tuntap): name
# iproute2's. A program that is not busybox (sproutd, ip netns exec) finds
# /usr/sbin/ip first on PATH.
ip() { /usr/sbin/ip "$@"; }
secs() { awk -v s="$1" '{ printf "%.1f", $1 - s }' /proc/uptime; }
t0=$(cut -d' ' -f1 /proc/uptime)
echo "net: kernel $(uname -r)"
echo "net: ip: $(ip -V)"
echo "net: nft: $(nft --version)"
[ -c /dev/net/tun ] || fail "no /dev/net/tun"
ip link set lo up || fail "lo"

# Two sandboxes, a and b: each a network namespace joined to the root one by
# a veth pair (sp0, sp1 on the root side), set up with ip -n; a has a TAP.
ip netns add a || fail "ip netns add a"
echo "net: PATH's ip (from ip netns exec): $(ip netns exec a ip -V)"
ip netns add b || fail "ip netns add b"
ip link add sp0 type veth peer name eth0 netns a || fail "a veth into a"
ip link add sp1 type veth peer name eth0 netns b || fail "a veth into b"
ip addr add 10.201.0.1/30 dev sp0 && ip link set sp0 up || fail "sp0"
ip addr add 10.201.0.5/30 dev sp1 && ip link set sp1 up || fail "sp1"
ip -n a addr add 10.201.0.2/30 dev eth0 && ip -n a link set eth0 up && ip -n a link set lo up &&
  ip -n a route add default via 10.201.0.1 || fail "addresses in a"
ip -n b addr add 10.201.0.6/30 dev eth0 && ip -n b link set eth0 up && ip -n b link set lo up &&
  ip -n b route add default via 10.201.0.5 || fail "addresses in b"
ip -n a tuntap add tap0 mode tap && ip -n a link set tap0 up || fail "tap0 in a"
echo "net: tap0 in a: $(ip -n a -o link show tap0 | cut -d' ' -f2-3)"
# The outside world, inet, set up with ip -batch (and ip -n -batch).
ip -batch - <<'B' || fail "ip -batch"
netns add inet
link add in0 type veth peer name eth0 netns inet
address add 198.51.100.1/24 dev in0
link set in0 up
B
ip -n inet -batch - <<'B' || fail "ip -n inet -batch"
address add 198.51.100.2/24 dev eth0
link set eth0 up
link set lo up
B
echo 1 >/proc/sys/net/ipv4/ip_forward || fail "ip_forward"

# Listeners on the root namespace's side of a and in b, and a web server in
# inet that says whom it sees.
nc -ll -p 8080 -e /bin/busybox echo listener-hello </dev/null >/dev/null 2>&1 &
ip netns exec b busybox nc -ll -p 8080 -e /bin/busybox echo listener-hello </dev/null >/dev/null 2>&1 &
mkdir -p /tmp/www/cgi-bin
echo netns-page-ok >/tmp/www/index.html
printf '#!/bin/sh\necho "Content-Type: text/plain"\necho\necho "$REMOTE_ADDR"\n' >/tmp/www/cgi-bin/peer
chmod +x /tmp/www/cgi-bin/peer
ip netns exec inet busybox httpd -p 80 -h /tmp/www || fail "httpd in inet"
sleep 1

# A TCP connect from a, with a 5 s connect limit: what the listener says, or
# nc's error.
connect() {
  got=$(sleep 2 | ip netns exec a timeout 20 busybox nc -w 5 "$1" 8080 2>&1)
  echo "${got:-nothing} (status $?)"
}
echo "net: control a -> root: $(connect 10.201.0.1)"
echo "net: control a -> b: $(connect 10.201.0.6)"

# (nft 1.0.6: "fwd" is a keyword, not a chain name; a table on one line
# needs ";" before each "}".)
nft -f - <<'N' || fail "nft -f"
table inet sproutcheck {
  chain post {
    type nat hook postrouting priority 100;
    ip saddr 10.201.0.0/16 oifname != "sp*" counter masquerade
  }
  chain forward {
    type filter hook forward priority 0;
    iifname "sp*" oifname "sp*" counter drop
  }
  chain inp {
    type filter hook input priority 0;
    iifname "sp*" ct state established,related accept
    iifname "sp*" counter drop
  }
}
N
echo "net: nft table loaded"

echo "net: fetch: $(ip netns exec a timeout 30 busybox wget -q -O - http://198.51.100.2/ 2>&1)"
echo "net: inet saw: $(ip netns exec a timeout 30 busybox wget -q -O - http://198.51.100.2/cgi-bin/peer 2>&1)"
s=$(cut -d' ' -f1 /proc/uptime)
echo "net: a -> root: $(connect 10.201.0.1) after $(secs "$s") s"
s=$(cut -d' ' -f1 /proc/uptime)
echo "net: a -> b: $(connect 10.201.0.6) after $(secs "$s") s"
# Replies of what the root namespace starts still come in (ct state
# established).
if ping -c 1 -W 5 10.201.0.2 >/dev/null 2>&1; then echo "net: root pings a: ok"; else echo "net: root pings a: no answer"; fi
nft list table inet sproutcheck
packets() { nft list chain inet sproutcheck "$1" | sed -n 's/.*counter packets \([0-9]*\).*/\1/p'; }
echo "net: masquerade packets: $(packets post)"
echo "net: forward drop packets: $(packets forward)"
echo "net: input drop packets: $(packets inp)"
echo "net: done in $(secs "$t0") s (lab clock)"
"##;

/// The value of the one output line `net: <key>: <value>`.
fn value<'a>(out: &'a lab::LabOutput, key: &str) -> &'a str {
    let v = out.values(&format!("net: {key}:"));
    assert_eq!(
        v.len(),
        1,
        "no single 'net: {key}:' line in:\n{}",
        out.stdout
    );
    v[0]
}

fn packets(out: &lab::LabOutput, key: &str) -> u64 {
    let v = value(out, key);
    v.parse()
        .unwrap_or_else(|_| panic!("{key}: {v:?} is not a count\n{}", out.stdout))
}

#[test]
fn the_lab_has_network_namespaces_veth_tap_and_nftables_nat() {
    let out = lab::Script::new(SCRIPT)
        .timeout(Duration::from_secs(240))
        .run();
    eprintln!("lab run took {:.0} s host time", out.elapsed.as_secs_f64());
    out.assert_success();
    let o = &out.stdout;
    // iproute2's own ip and nft, not busybox's applet.
    assert!(value(&out, "ip").contains("iproute2"), "{o}");
    assert!(
        value(&out, "PATH's ip (from ip netns exec)").contains("iproute2"),
        "{o}"
    );
    assert!(value(&out, "nft").starts_with("nftables v"), "{o}");
    assert!(value(&out, "tap0 in a").contains("UP"), "{o}");
    // The listeners answer while nothing filters.
    for key in ["control a -> root", "control a -> b"] {
        assert_eq!(value(&out, key), "listener-hello (status 0)", "{o}");
    }
    assert!(o.contains("net: nft table loaded"), "{o}");
    // Out to inet: routed, and masqueraded to the root namespace's address
    // there (httpd shows it IPv4-mapped).
    assert_eq!(value(&out, "fetch"), "netns-page-ok", "{o}");
    let peer = value(&out, "inet saw");
    let ip = peer.trim_start_matches("[::ffff:").trim_end_matches(']');
    assert_eq!(ip, "198.51.100.1", "not masqueraded\n{o}");
    // Into the root namespace and into another sandbox: dropped (no answer,
    // not refused).
    for key in ["a -> root", "a -> b"] {
        let v = value(&out, key);
        assert!(
            v.starts_with("nc: timed out (status 1)"),
            "{key}: {v:?}, expected a connect that times out\n{o}"
        );
    }
    // Replies to the root namespace's own traffic come in.
    assert_eq!(value(&out, "root pings a"), "ok", "{o}");
    assert!(packets(&out, "masquerade packets") >= 2, "{o}");
    assert!(packets(&out, "forward drop packets") >= 1, "{o}");
    assert!(packets(&out, "input drop packets") >= 1, "{o}");
}
