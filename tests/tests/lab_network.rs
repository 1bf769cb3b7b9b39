//! Sandbox networks through sproutd, in the emulated hardware-virtualization
//! lab (see `sprout_tests::lab`): each sandbox its own namespace, TAP and
//! address, NAT egress to a web server the script runs in a namespace of
//! its own (the internet's stand-in), `disableInternet`, isolation from
//! other sandboxes and from the host's own services, fork and sleep/wake.

use serde_json::Value;
use sprout_tests::lab;

const SCRIPT: &str = r#"
# iproute2's ip (busybox sh runs its own applet for a bare `ip`).
ip() { /usr/sbin/ip "$@"; }
ip link set lo up
# The internet's stand-in: a namespace with a web server, one hop away.
ip netns add inet || exit 3
ip link add inet-h type veth peer name eth0 netns inet || exit 3
ip addr add 198.51.100.1/24 dev inet-h && ip link set inet-h up || exit 3
ip -n inet link set lo up
ip -n inet addr add 198.51.100.2/24 dev eth0 && ip -n inet link set eth0 up || exit 3
mkdir -p /srv/www
echo "hello from outside" >/srv/www/index.html
ip netns exec inet busybox httpd -p 80 -h /srv/www || exit 3
# Services of the host itself: on loopback, and on every address.
busybox httpd -p 127.0.0.1:8081 -h /srv/www
busybox httpd -p 8082 -h /srv/www
sprout daemon --listen 127.0.0.1:7070 --data-dir /tmp/sd --no-templates >>/tmp/sd.out 2>>/tmp/sd.log &
i=0
until sprout api GET /v1/health >/dev/null 2>&1; do
  i=$((i+1)); [ $i -gt 600 ] && { echo "sproutd did not start"; cat /tmp/sd.log; exit 10; }
  sleep 0.1
done
api() { sprout api "$@" 2>/dev/null; }
echo "info: $(api GET /v1/info)"
create() {
  out=$(api POST /v1/runtime/schedule "$1") || { echo "schedule failed: $out"; tail -50 /tmp/sd.log; exit 11; }
  echo "$out" | sed -n 's/.*"vmId":"\([^"]*\)".*/\1/p'
}
js() { printf '%s' "$1" | sed 's/\\/\\\\/g; s/"/\\"/g; s/^/"/; s/$/"/'; }
x() { # x ID LABEL CMD: a shell command's exec answer, labelled
  echo "$2: $(api POST /v1/runtime/vms/$1/exec "{\"command\":\"/bin/sh\",\"argv\":[\"-c\",$(js "$3")]}")"
}
fetch='python3 -c "import sys,urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode().strip())"'
connect='python3 -c "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3); print(\"connected\")"'
myip='python3 -c "import socket,fcntl,struct; s=socket.socket(2,2); print(socket.inet_ntoa(fcntl.ioctl(s.fileno(),0x8915,struct.pack(\"256s\",b\"eth0\"))[20:24]))"'
me="cat /sys/class/net/eth0/address; $myip"
a=$(create '{"cpus":1,"memoryMb":256}') && [ -n "$a" ] || exit 12
b=$(create '{"cpus":1,"memoryMb":256}') && [ -n "$b" ] || exit 12
c=$(create '{"cpus":1,"memoryMb":256,"disableInternet":true}') && [ -n "$c" ] || exit 12
echo "vms: $a $b $c"
echo "c-view: $(api GET /v1/runtime/vms/$c)"
echo "host-links: $(ls /sys/class/net | tr '\n' ' ')"
echo "host-alias: $(cat /sys/class/net/sp0/ifalias)"
echo "host-nft: $(nft list table inet sprout | tr -s '\n\t ' ' ')"
x $a a-me "$me"
x $b b-me "$me"
x $c c-me "$me"
x $a a-out "$fetch http://198.51.100.2/"
x $c c-out "$fetch http://198.51.100.2/"
x $c c-exec "echo still here"
# B serves; A must not reach it, nor the host's own services.
api POST /v1/runtime/vms/$b/exec '{"command":"python3","argv":["-m","http.server","8000"],"background":true}' >/dev/null
bip=$(api POST /v1/runtime/vms/$b/exec "{\"command\":\"/bin/sh\",\"argv\":[\"-c\",$(js "$myip")]}" | sed -n 's/.*"stdout":"\([0-9.]*\)\\n".*/\1/p')
echo "b-ip: $bip"
x $b b-self "for i in \$(seq 100); do $fetch http://127.0.0.1:8000/ >/dev/null 2>&1 && echo serving && break; sleep 0.2; done"
x $a a-to-b "$connect $bip 8000"
x $a a-to-host "$connect 198.51.100.1 8082"
x $a a-to-host-veth "$connect 10.201.0.1 8082"
x $a a-to-host-lo "$connect 127.0.0.1 8081"
# Fork 3 of A: each child its own MAC and address, each reaches outside.
f=$(api POST /v1/runtime/vms/$a/fork '{"count":3}')
echo "fork: $f"
for k in $(echo "$f" | grep -o '"vmId":"[^"]*"' | cut -d'"' -f4); do
  x $k kid-me "$me"
  x $k kid-out "$fetch http://198.51.100.2/"
done
x $a a-after-fork "$fetch http://198.51.100.2/"
# Sleep and a transparent wake: a new worker, the same address, still out.
echo "sleep: $(api POST /v1/runtime/vms/$a/sleep)"
x $a a-woken-me "$me"
x $a a-woken-out "$fetch http://198.51.100.2/"
grep -i 'network\|error' /tmp/sd.log | tail -20 | sed 's/^/log: /'
"#;

/// An exec's answer: (exit code, stdout, stderr).
fn exec(out: &lab::LabOutput, prefix: &str) -> Vec<(i64, String, String)> {
    out.values(prefix)
        .iter()
        .map(|s| {
            let v: Value = serde_json::from_str(s)
                .unwrap_or_else(|e| panic!("{prefix} {s}: {e}\n{}", out.stdout));
            (
                v["exitCode"].as_i64().unwrap_or(-1),
                v["stdout"].as_str().unwrap_or_default().to_owned(),
                v["stderr"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

/// `(mac, ip)` from the `me` command's output.
fn identity(e: &(i64, String, String)) -> (String, String) {
    let mut l = e.1.lines();
    (
        l.next().unwrap_or_default().to_owned(),
        l.next().unwrap_or_default().to_owned(),
    )
}

#[test]
fn sandboxes_reach_outside_through_nat_and_nothing_else() {
    let out = lab::Script::new(SCRIPT)
        .timeout(std::time::Duration::from_secs(1500))
        .run();
    out.assert_success();
    let o = &out.stdout;
    eprintln!("{o}");
    let info = out.json("info:");
    assert_eq!(info["network"]["egress"], true, "{o}");
    assert!(info["network"]["reason"].is_null(), "{o}");
    // Each host-side interface names its sandbox (the first is A's).
    let vms = out.values("vms:");
    let a_id = vms[0].split_whitespace().next().unwrap();
    assert_eq!(out.values("host-alias:"), [format!("sprout:{a_id}")], "{o}");
    let c_view = out.json("c-view:");
    assert_eq!(c_view["disableInternet"], true, "{o}");

    let outside = "hello from outside";
    let ok = |e: &(i64, String, String)| e.0 == 0 && e.1.trim() == outside;
    // A reaches the outside server through NAT; C (disableInternet) does
    // not, and its execs still work.
    assert!(exec(&out, "a-out:").iter().all(ok), "{o}");
    let c_out = exec(&out, "c-out:");
    assert!(c_out.len() == 1 && c_out[0].0 != 0, "{o}");
    assert!(
        c_out[0].2.contains("unreachable") || c_out[0].2.contains("timed out"),
        "{o}"
    );
    assert_eq!(exec(&out, "c-exec:")[0].1.trim(), "still here", "{o}");

    // Distinct MACs and addresses, each in 10.200.0.0/16.
    let a = identity(&exec(&out, "a-me:")[0]);
    let b = identity(&exec(&out, "b-me:")[0]);
    let c = identity(&exec(&out, "c-me:")[0]);
    let kids: Vec<(String, String)> = exec(&out, "kid-me:").iter().map(identity).collect();
    assert_eq!(kids.len(), 3, "{o}");
    let mut all = vec![a.clone(), b.clone(), c.clone()];
    all.extend(kids.iter().cloned());
    for (mac, ip) in &all {
        assert!(mac.starts_with("02:") && mac.len() == 17, "{mac:?}\n{o}");
        assert!(ip.starts_with("10.200."), "{ip:?}\n{o}");
    }
    let macs: std::collections::HashSet<_> = all.iter().map(|x| &x.0).collect();
    let ips: std::collections::HashSet<_> = all.iter().map(|x| &x.1).collect();
    assert_eq!(macs.len(), all.len(), "every MAC differs: {all:?}\n{o}");
    assert_eq!(ips.len(), all.len(), "every address differs: {all:?}\n{o}");

    // B serves on its own address, but A cannot reach it; nor the host's
    // services, on its own addresses or its loopback.
    assert_eq!(exec(&out, "b-self:")[0].1.trim(), "serving", "{o}");
    for p in ["a-to-b:", "a-to-host:", "a-to-host-veth:", "a-to-host-lo:"] {
        let e = &exec(&out, p)[0];
        assert!(e.0 != 0 && !e.1.contains("connected"), "{p} {e:?}\n{o}");
    }

    // Every child and the parent reach outside after the fork.
    let kid_out = exec(&out, "kid-out:");
    assert_eq!(kid_out.len(), 3, "{o}");
    assert!(kid_out.iter().all(ok), "{o}");
    assert!(exec(&out, "a-after-fork:").iter().all(ok), "{o}");

    // After sleep and a wake into a new worker: the same address, and out.
    let woken = identity(&exec(&out, "a-woken-me:")[0]);
    assert_eq!(woken, a, "{o}");
    assert!(exec(&out, "a-woken-out:").iter().all(ok), "{o}");
}
