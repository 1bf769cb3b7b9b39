//! sproutd with a real Linux guest, in the emulated hardware-virtualization
//! lab (see `sprout_tests::lab`): `sprout daemon` runs there, and the script
//! drives it with `sprout api` (the lab has no curl). Host-side API tests
//! that need no Linux guest are in service/tests/api.rs.

use serde_json::Value;
use sprout_tests::lab;

const SCRIPT: &str = r#"
ip link set lo up 2>/dev/null || ifconfig lo 127.0.0.1 up 2>/dev/null
# Every create cold-boots here (the boot path, and its jail, is what this
# test looks at; templates are tested in service/tests/lab_rest.rs).
start_daemon() {
  sprout daemon --listen 127.0.0.1:7070 --data-dir /tmp/sd --no-templates "$@" >>/tmp/sd.out 2>>/tmp/sd.log &
  daemon=$!
  i=0
  until sprout api GET /v1/health >/dev/null 2>&1; do
    i=$((i+1)); [ $i -gt 600 ] && { echo "sproutd did not start"; cat /tmp/sd.log; exit 10; }
    sleep 0.1
  done
}
api() { sprout api "$@" 2>/dev/null; }
start_daemon
echo "info: $(api GET /v1/info)"
out=$(api POST /v1/runtime/schedule '{"cpus":1,"memoryMb":256,"metadata":{"test":"lab"}}') ||
  { echo "schedule failed: $out"; cat /tmp/sd.log; exit 11; }
echo "scheduled: $out"
id=$(echo "$out" | sed -n 's/.*"vmId":"\([^"]*\)".*/\1/p')
[ -n "$id" ] || exit 12
# sproutd runs as root here: its worker is jailed.
pid=$(echo "$out" | sed -n 's/.*"workerPid":\([0-9]*\).*/\1/p')
echo "jail-status: $(grep -E '^(Seccomp|CapEff|NoNewPrivs):' /proc/$pid/status | tr -s '\t\n' '  ')"
echo "jail-root: $(ls /proc/$pid/root | tr '\n' ' ')"
echo "jail-vm: $(ls /proc/$pid/root/tmp/sd/vms/$id | tr '\n' ' ')"
echo "jail-mounts: $(awk '{ split($6, o, ","); print $5 "=" o[1] }' /proc/$pid/mountinfo | tr '\n' ' ')"
x="/v1/runtime/vms/$id/exec"
echo "python: $(api POST $x '{"command":"python3","argv":["-c","print(2**100)"]}')"
echo "shell: $(api POST $x '{"command":"/bin/sh","argv":["-c","echo $X; cat; echo oops >&2; exit 3"],"env":{"X":"from-env"},"stdin":"fed"}')"
echo "binary: $(api POST $x '{"command":"printf","argv":["\\377"]}')"
echo "timeout: $(api POST $x '{"command":"sleep","argv":["60"],"timeoutMs":1000}')"
echo "list: $(api GET '/v1/runtime/vms?metadata.test=lab')"
# Streamed: the first stdout event arrives while the process still runs. It
# waits for /tmp/go, which another exec makes only once "first" was seen.
sprout api --accept text/event-stream POST $x \
  '{"command":"/bin/sh","argv":["-c","echo first; while [ ! -e /tmp/go ]; do sleep 0.1; done; echo second; exit 7"]}' \
  >/tmp/sse.txt 2>/dev/null &
sse=$!
i=0
while ! grep -q first /tmp/sse.txt; do i=$((i+1)); [ $i -gt 1200 ] && break; sleep 0.1; done
echo "stream-seen: first=$(grep -c first /tmp/sse.txt) second=$(grep -c second /tmp/sse.txt)"
api POST $x '{"command":"touch","argv":["/tmp/go"]}' >/dev/null
wait $sse
echo "stream-status: $?"
sed 's/^/sse: /' /tmp/sse.txt
# Background: a process that outlives the stream it was watched on, replays
# from Last-Event-ID, takes stdin, and is signalled (its whole group).
bg=$(api POST $x '{"command":"/bin/sh","argv":["-c","for i in 1 2 3; do echo line$i; done; read l; echo got:$l; sleep 1000 & wait"],"background":true,"stdinOpen":true}')
echo "bg: $bg"
eid=$(echo "$bg" | sed -n 's/.*"execId":\([0-9]*\).*/\1/p')
p="/v1/runtime/vms/$id/processes/$eid"
sprout api --accept text/event-stream GET $p/events >/tmp/a1.txt 2>/dev/null &
a1=$!
i=0
while ! grep -q line3 /tmp/a1.txt; do i=$((i+1)); [ $i -gt 1200 ] && break; sleep 0.1; done
kill $a1; wait $a1 2>/dev/null
sed 's/^/a1: /' /tmp/a1.txt
echo "procs: $(api GET /v1/runtime/vms/$id/processes)"
echo "stdin: $(api POST $p/stdin '{"data":"hello\n"}')"
# Resume after the next-to-last event the first stream saw: the replay
# starts with the last one (the agent may have put several lines in one).
last=$(sed -n 's/^id: //p' /tmp/a1.txt | tail -1)
resume=$((last - 1))
echo "resume-after: $resume"
sprout api --accept text/event-stream --header "Last-Event-ID: $resume" GET $p/events >/tmp/a2.txt 2>/dev/null &
a2=$!
i=0
while ! grep -q got:hello /tmp/a2.txt; do i=$((i+1)); [ $i -gt 1200 ] && break; sleep 0.1; done
count_sleepers='{"command":"/bin/sh","argv":["-c","for p in /proc/[0-9]*; do read -r c < $p/comm 2>/dev/null && [ $c = sleep ] && echo $p; done | wc -l"]}'
echo "sleepers-before: $(api POST $x "$count_sleepers")"
echo "signal: $(api POST $p/signal '{"signal":"TERM"}')"
wait $a2
sed 's/^/a2: /' /tmp/a2.txt
echo "procs-after: $(api GET /v1/runtime/vms/$id/processes)"
echo "sleepers: $(api POST $x "$count_sleepers")"
# Files, under /workspace.
f="/v1/runtime/vms/$id/files"
echo "mkdir: $(api POST $f/mkdir '{"path":"d/e","parents":true}')"
echo "put: $(api PUT "$f/content?path=d/e/hello.txt" 'héllo wörld')"
echo "get: $(api GET "$f/content?path=d/e/hello.txt")"
echo "ls: $(api GET "$f?path=d/e")"
head -c 1048576 /dev/zero | tr '\0' a > /tmp/1m
echo "put-1m: $(api PUT "$f/content?path=one.txt" --data-file /tmp/1m)"
echo b >> /tmp/1m
echo "put-1m1: $(api PUT "$f/content?path=two.txt" --data-file /tmp/1m)"
api POST $x '{"command":"/bin/sh","argv":["-c","head -c 1100000 /dev/zero | tr \"\\\\0\" b > /workspace/big.txt"]}' >/dev/null
echo "cut-header: $(api -i GET "$f/content?path=big.txt" | head -c 400 | grep -ci '^x-truncated: true')"
echo "cut-bytes: $(api GET "$f/content?path=big.txt" | wc -c)"
for bad in ../x ../../etc/passwd /etc/passwd d/../../x %2e%2e/x; do
  echo "escape: $(api GET "$f/content?path=$bad")"
done
echo "missing: $(api GET "$f/content?path=nope.txt")"
# 64 MiB up and down raw, streamed: the same bytes back, and sproutd's
# peak RSS stays under the file's size.
head -c 67108864 /dev/urandom > /tmp/64m
echo "raw-put: $(api PUT "$f/raw?path=big.bin" --data-file /tmp/64m)"
api GET "$f/raw?path=big.bin" > /tmp/64m.back
echo "raw-sha: $(sha256sum < /tmp/64m | cut -c1-64) $(head -c 67108864 /tmp/64m.back | sha256sum | cut -c1-64) $(wc -c < /tmp/64m.back)"
echo "raw-missing: $(api GET "$f/raw?path=nope.bin")"
echo "hwm-kib: $(awk '/^VmHWM:/ { print $2 }' /proc/$daemon/status)"
rm -f /tmp/64m /tmp/64m.back
echo "rm: $(api DELETE "$f?path=d&recursive=true")"
echo "ls-after: $(api GET "$f?path=.")"
# A second sandbox, on the busybox image, whose worker is killed: it is
# failed at once, its exec refused as such; the first one is untouched.
out2=$(api POST /v1/runtime/schedule '{"image":"test","cpus":1,"memoryMb":128}') ||
  { echo "schedule 2 failed: $out2"; cat /tmp/sd.log; exit 13; }
echo "second: $out2"
id2=$(echo "$out2" | sed -n 's/.*"vmId":"\([^"]*\)".*/\1/p')
pid2=$(echo "$out2" | sed -n 's/.*"workerPid":\([0-9]*\).*/\1/p')
kill -9 "$pid2"
# Its worker is watched (a pidfd): the sandbox fails with no exec to notice.
i=0
until api GET /v1/runtime/vms/$id2 | grep -q '"state":"failed"'; do
  i=$((i+1)); [ $i -gt 300 ] && break
  sleep 0.1
done
echo "dead-exec: $(api POST /v1/runtime/vms/$id2/exec '{"command":"true"}')"
echo "dead: $(api GET /v1/runtime/vms/$id2)"
echo "delete2: $(api DELETE /v1/runtime/vms/$id2)"
# kill -9 of sproutd: the next one re-adopts the sandbox, which still runs.
kill -9 $daemon; wait $daemon 2>/dev/null
start_daemon
echo "adopted: $(api GET /v1/runtime/vms/$id)"
echo "again: $(api POST $x '{"command":"cat","argv":["/proc/sys/kernel/hostname"]}')"
echo "delete: $(api DELETE /v1/runtime/vms/$id)"
echo "gone: $(api GET /v1/runtime/vms/$id)"
echo "left: $(api GET /v1/runtime/vms)"
echo "jails-left: $(ls /tmp/sd/jails | wc -l)"
echo "mounts-left: $(grep -c ' /tmp/sd/' /proc/self/mountinfo)"
ps | grep -c '[s]prout worker' | sed 's/^/workers: /'
kill $daemon; wait $daemon
echo "daemon-exit: $?"
# --- Exec limits: 200 concurrent execs over 4 sandboxes, each echoing its
# own token; every answer is that output or 429 with Retry-After. Admitted
# execs mark their start (/workspace/up-N) and wait for /workspace/go,
# written through the files API (not an exec: not limited) once every
# refusal is in, so exactly 24 (the global limit) run. First 20 to sandbox 1
# alone (8 admitted: its limit), then 180 over the other three (16 more,
# then the global limit), 20 at a time: each batch is answered or started
# before the next is sent, so no admitted exec waits for its guest to start
# it while the emulated machine spawns a storm of clients.
start_daemon --max-execs-per-vm 8 --max-execs 24
lim_pids=
for v in 1 2 3 4; do
  api POST /v1/runtime/schedule '{"image":"test","cpus":1,"memoryMb":128}' >/tmp/lim-vm$v &
  lim_pids="$lim_pids $!"
done
for p in $lim_pids; do wait $p; done
lim_ids=
for v in 1 2 3 4; do
  lid=$(sed -n 's/.*"vmId":"\([^"]*\)".*/\1/p' /tmp/lim-vm$v)
  [ -n "$lid" ] || { echo "limits: schedule $v failed: $(cat /tmp/lim-vm$v)"; cat /tmp/sd.log; exit 14; }
  lim_ids="$lim_ids $lid"
done
lim_inflight() { api GET /metrics | sed -n 's/^sproutd_execs_in_flight //p'; }
lim_until() { # until sproutd has N execs in flight
  i=0
  until [ "$(lim_inflight)" = $1 ]; do
    i=$((i+1)); [ $i -gt 600 ] && { echo "limits: $(lim_inflight) in flight, not $1"; break; }
    sleep 0.2
  done
}
# A streamed exec whose client goes while its process prints nothing: its
# slot is freed and its process group killed at once.
lid=$(echo $lim_ids | cut -d' ' -f1)
sprout api --accept text/event-stream POST /v1/runtime/vms/$lid/exec \
  '{"command":"/bin/sh","argv":["-c","sleep 1000; echo never"]}' >/dev/null 2>&1 &
sse=$!
lim_until 1
kill $sse; wait $sse 2>/dev/null
lim_until 0
sleepers() { api POST /v1/runtime/vms/$lid/exec "$count_sleepers" | sed -n 's/.*"stdout":"\([0-9]*\)\\n".*/\1/p'; }
i=0
until [ "$(sleepers)" = 0 ]; do i=$((i+1)); [ $i -gt 100 ] && break; sleep 0.2; done
echo "lim-sse-gone: $(lim_inflight) $(sleepers)"
mkdir -p /tmp/lim
lim_exec() { # N SANDBOX-INDEX
  lid=$(echo $lim_ids | cut -d' ' -f$2)
  sprout api -i POST /v1/runtime/vms/$lid/exec \
    "{\"command\":\"/bin/sh\",\"argv\":[\"-c\",\": >/workspace/up-$1; while [ ! -e /workspace/go ]; do sleep 2; done; echo tok-$1\"]}" \
    >/tmp/lim/$1 2>/dev/null &
  lim_pids="$lim_pids $!"
}
lim_answered() { cat /tmp/lim/* 2>/dev/null | grep -c '^HTTP/1.1 '; }
lim_up() { # how many admitted execs have started, over every sandbox
  t=0
  for l in $lim_ids; do
    t=$((t + $(api GET "/v1/runtime/vms/$l/files?path=." | grep -o '"name":"up-' | wc -l)))
  done
  echo $t
}
lim_settle() { # until the first N execs are each answered or started
  i=0
  until [ $(($(lim_answered) + $(lim_up))) -ge $1 ]; do
    i=$((i+1)); [ $i -gt 600 ] && { echo "limits: $(lim_answered) answered, $(lim_up) started of $1"; break; }
    sleep 0.5
  done
}
lim_pids=
n=0
while [ $n -lt 20 ]; do lim_exec $n 1; n=$((n+1)); done
lim_settle 20
while [ $n -lt 200 ]; do
  lim_exec $n $((n % 3 + 2)); n=$((n+1))
  if [ $((n % 20)) = 0 ]; then lim_settle $n; fi
done
echo "lim-held: $(api GET /metrics | grep '^sproutd_execs_in_flight')"
for lid in $lim_ids; do api PUT "/v1/runtime/vms/$lid/files/content?path=go" go >/dev/null; done
for p in $lim_pids; do wait $p; done
n=0
while [ $n -lt 200 ]; do
  f=/tmp/lim/$n
  st=$(head -1 $f | cut -d' ' -f2)
  ra=$(sed -n 's/^[Rr]etry-[Aa]fter: *\([0-9]*\).*/\1/p' $f | head -1)
  echo "lim: $n ${st:--} ${ra:--} $(sed '1,/^$/d' $f | tr -d '\n')"
  n=$((n+1))
done
api GET /metrics | grep '^sproutd_execs_' | sed 's/^/lim-metrics: /'
for lid in $lim_ids; do echo "lim-delete: $(api DELETE /v1/runtime/vms/$lid)"; done
kill $daemon; wait $daemon
echo "lim-daemon-exit: $?"
"#;

/// SSE events (name, data, id) from the stream's lines, in order.
fn sse_events(lines: &[&str]) -> Vec<(String, String, String)> {
    let mut events = Vec::new();
    let (mut name, mut data, mut id) = (String::new(), String::new(), String::new());
    for l in lines.iter().chain([&""]) {
        if l.is_empty() {
            if !name.is_empty() || !data.is_empty() {
                events.push((
                    std::mem::take(&mut name),
                    std::mem::take(&mut data),
                    std::mem::take(&mut id),
                ));
            }
        } else if let Some(v) = l.strip_prefix("event:") {
            name = v.trim().to_owned();
        } else if let Some(v) = l.strip_prefix("data:") {
            data.push_str(v.trim());
        } else if let Some(v) = l.strip_prefix("id:") {
            id = v.trim().to_owned();
        }
    }
    events
}

#[test]
fn sproutd_schedules_a_linux_sandbox_runs_execs_in_it_and_deletes_it() {
    // The exec-limits block boots four more sandboxes.
    let out = lab::Script::new(SCRIPT)
        .timeout(std::time::Duration::from_secs(1500))
        .run();
    out.assert_success();
    let o = &out.stdout;
    let info = out.json("info:");
    assert_eq!(info["hostMode"]["linuxGuests"], true, "{o}");
    let s = out.json("scheduled:");
    assert_eq!(s["state"], "running", "{o}");
    assert_eq!(s["image"], "default", "{o}");
    let id = s["vmId"].as_str().unwrap();
    // Its worker is jailed: seccomp, no capabilities, and a root with only
    // the jail's own entries, the kernel and image (/opt) and the
    // sandbox's vm/ (/tmp).
    let st = out.values("jail-status:");
    for want in ["Seccomp: 2", "CapEff: 0000000000000000", "NoNewPrivs: 1"] {
        assert!(st[0].contains(want), "{want:?} not in {st:?}\n{o}");
    }
    assert_eq!(out.values("jail-root:"), ["dev opt proc tmp worker"], "{o}");
    assert_eq!(out.values("jail-vm:"), ["vm"], "{o}");
    // Mounted in its view: the jail's own and exactly what the VM needs,
    // kernel and base image read-only, its vm/ read-write.
    let mut mounts: Vec<&str> = out.values("jail-mounts:")[0].split_whitespace().collect();
    mounts.sort_unstable();
    let vm = format!("/tmp/sd/vms/{id}/vm=rw");
    let mut want = vec![
        "/=rw",
        "/dev=ro",
        "/proc/self=ro",
        "/opt/sprout/vmlinux=ro",
        "/opt/sprout/images/default.ext4=ro",
        vm.as_str(),
    ];
    want.sort_unstable();
    assert_eq!(mounts, want, "{o}");

    let py = out.json("python:");
    assert_eq!(py["stdout"], "1267650600228229401496703205376\n", "{o}");
    assert_eq!(py["exitCode"], 0, "{o}");
    assert_eq!(py["timedOut"], false, "{o}");
    assert_eq!(py["stdoutBase64"], false, "{o}");

    let sh = out.json("shell:");
    assert_eq!(sh["stdout"], "from-env\nfed", "{o}");
    assert_eq!(sh["stderr"], "oops\n", "{o}");
    assert_eq!(sh["exitCode"], 3, "{o}");

    let bin = out.json("binary:");
    assert_eq!(bin["stdoutBase64"], true, "{o}");
    assert_eq!(bin["stdout"], "/w==", "{o}");

    let t = out.json("timeout:");
    assert_eq!(t["timedOut"], true, "{o}");
    assert_eq!(t["signal"], 9, "{o}");

    let list = out.json("list:");
    assert_eq!(list["vms"].as_array().unwrap().len(), 1, "{o}");
    assert_eq!(list["vms"][0]["vmId"], id, "{o}");

    // The streamed exec: "first" was there before "second" existed.
    assert_eq!(out.values("stream-seen:"), ["first=1 second=0"], "{o}");
    assert_eq!(out.values("stream-status:"), ["0"], "{o}");
    let events = sse_events(&out.values("sse:"));
    let ids: Vec<u64> = events.iter().map(|e| e.2.parse().unwrap()).collect();
    assert_eq!(ids, (1..=ids.len() as u64).collect::<Vec<_>>(), "{o}");
    let stdout: String = events
        .iter()
        .filter(|e| e.0 == "stdout")
        .map(|e| {
            let d: Value = serde_json::from_str(&e.1).unwrap();
            assert_eq!(d["base64"], false, "{o}");
            d["data"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(stdout, "first\nsecond\n", "{o}");
    let last = events.last().unwrap();
    assert_eq!(last.0, "exit", "{o}");
    let exit: Value = serde_json::from_str(&last.1).unwrap();
    assert_eq!(exit["exitCode"], 7, "{o}");

    // Files.
    assert_eq!(out.json("mkdir:")["created"], true, "{o}");
    assert_eq!(out.json("put:")["bytes"], "héllo wörld".len(), "{o}");
    assert_eq!(out.values("get:"), ["héllo wörld"], "{o}");
    let ls = out.json("ls:");
    assert_eq!(ls["entries"][0]["name"], "hello.txt", "{o}");
    assert_eq!(ls["entries"][0]["type"], "file", "{o}");
    assert_eq!(ls["entries"][0]["size"], "héllo wörld".len(), "{o}");
    assert_eq!(out.json("put-1m:")["bytes"], 1 << 20, "{o}");
    assert_eq!(
        out.json("put-1m1:")["error"]["code"],
        "payload_too_large",
        "{o}"
    );
    assert_eq!(out.values("cut-header:"), ["1"], "{o}");
    // 1 MiB, and the newline sprout api adds.
    assert_eq!(
        out.values("cut-bytes:"),
        [((1 << 20) + 1).to_string()],
        "{o}"
    );
    let escapes = out.values("escape:");
    assert_eq!(escapes.len(), 5, "{o}");
    for e in escapes {
        let v: Value = serde_json::from_str(e).unwrap();
        assert_eq!(v["error"]["code"], "path_escape", "{e}\n{o}");
    }
    assert_eq!(
        out.json("missing:")["error"]["code"],
        "file_not_found",
        "{o}"
    );
    assert_eq!(out.json("raw-put:")["bytes"], 64 << 20, "{o}");
    let sha = out.values("raw-sha:");
    let sha: Vec<&str> = sha[0].split_whitespace().collect();
    assert_eq!(sha.len(), 3, "{o}");
    assert_eq!(sha[0], sha[1], "the download is the upload\n{o}");
    // 64 MiB and the newline sprout api adds.
    assert_eq!(sha[2], ((64 << 20) + 1).to_string(), "{o}");
    assert_eq!(
        out.json("raw-missing:")["error"]["code"],
        "file_not_found",
        "{o}"
    );
    let hwm: u64 = out.values("hwm-kib:")[0].parse().unwrap();
    assert!(hwm < 64 * 1024, "sproutd's peak RSS {hwm} KiB\n{o}");
    assert_eq!(out.json("rm:")["deleted"], true, "{o}");
    let after = out.json("ls-after:");
    let names: Vec<&str> = after["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert!(!names.contains(&"d"), "{names:?}\n{o}");
    assert!(names.contains(&"one.txt"), "{names:?}\n{o}");
    assert!(
        !names.contains(&"two.txt"),
        "a refused write wrote nothing\n{o}"
    );

    // Background process.
    let bg = out.json("bg:");
    let eid = bg["execId"].as_u64().unwrap();
    assert!(bg["pid"].as_u64().unwrap() > 1, "{o}");
    let a1 = sse_events(&out.values("a1:"));
    let a1_out: String = a1
        .iter()
        .filter(|e| e.0 == "stdout")
        .map(|e| {
            serde_json::from_str::<Value>(&e.1).unwrap()["data"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(a1_out, "line1\nline2\nline3\n", "{o}");
    let procs = out.json("procs:");
    let p = procs["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["execId"] == eid)
        .unwrap_or_else(|| panic!("{eid} not listed\n{o}"));
    assert_eq!(
        p["running"], true,
        "dropping its stream left it running\n{o}"
    );
    assert_eq!(p["stdinOpen"], true, "{o}");
    assert_eq!(out.json("stdin:")["bytes"], 6, "{o}");
    let a2 = sse_events(&out.values("a2:"));
    // The replay after event `resume` is what the first stream saw after it
    // (at least its last event), then the live events.
    let resume: u64 = out.values("resume-after:")[0].parse().unwrap();
    let replayed: Vec<_> = a1
        .iter()
        .filter(|e| e.2.parse::<u64>().unwrap() > resume)
        .collect();
    assert!(!replayed.is_empty(), "{o}");
    assert!(a2.len() > replayed.len(), "{o}");
    for (x, y) in replayed.iter().zip(&a2) {
        assert_eq!(*x, y, "{o}");
    }
    assert!(
        a2.iter().all(|e| e.2.parse::<u64>().unwrap() > resume),
        "{o}"
    );
    let a2_out: String = a2
        .iter()
        .filter(|e| e.0 == "stdout")
        .map(|e| {
            serde_json::from_str::<Value>(&e.1).unwrap()["data"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert!(a2_out.ends_with("got:hello\n"), "{o}");
    let last = a2.last().unwrap();
    assert_eq!(last.0, "exit", "{o}");
    let exit: Value = serde_json::from_str(&last.1).unwrap();
    assert_eq!(exit["signal"], 15, "{o}");
    assert_eq!(out.json("signal:")["signal"], 15, "{o}");
    let after = out.json("procs-after:");
    let p = after["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["execId"] == eid)
        .unwrap();
    assert_eq!(p["running"], false, "{o}");
    assert_eq!(p["exit"]["signal"], 15, "{o}");
    // The signal reached the process group: its sleep child, there before
    // it, is gone too.
    assert_eq!(out.json("sleepers-before:")["stdout"], "1\n", "{o}");
    assert_eq!(out.json("sleepers:")["stdout"], "0\n", "{o}");

    let second = out.json("second:");
    assert_eq!(second["image"], "test", "{o}");
    assert_eq!(second["state"], "running", "{o}");
    // The worker's watch (a pidfd) usually fails the sandbox before the
    // exec comes (409 invalid_state); else the exec finds it (502).
    let dead_exec = out.json("dead-exec:");
    assert!(
        ["invalid_state", "agent_unavailable"]
            .contains(&dead_exec["error"]["code"].as_str().unwrap()),
        "{o}"
    );
    let dead = out.json("dead:");
    assert_eq!(dead["state"], "failed", "{o}");
    let why = dead["failureReason"].as_str().unwrap();
    assert!(why.contains("killed") || why.contains("gone"), "{o}");
    assert_eq!(out.json("delete2:")["deleted"], true, "{o}");

    let adopted = out.json("adopted:");
    assert_eq!(adopted["state"], "running", "{o}");
    assert_eq!(adopted["workerPid"], s["workerPid"], "{o}");
    let again = out.json("again:");
    assert_eq!(again["exitCode"], 0, "{o}");
    assert!(!again["stdout"].as_str().unwrap().trim().is_empty(), "{o}");

    assert_eq!(out.json("delete:")["deleted"], true, "{o}");
    assert_eq!(out.json("gone:")["error"]["code"], "vm_not_found", "{o}");
    assert_eq!(out.json("left:")["vms"].as_array().unwrap().len(), 0, "{o}");
    assert_eq!(out.values("workers:"), ["0"], "{o}");
    assert_eq!(out.values("jails-left:"), ["0"], "{o}");
    assert_eq!(out.values("mounts-left:"), ["0"], "{o}");
    assert_eq!(out.values("daemon-exit:"), ["0"], "{o}");
    exec_limits(&out);
}

/// The exec-limits block: 200 concurrent execs over 4 sandboxes, each
/// answer the request's own output or a 429 envelope with Retry-After, and
/// as many admitted as the limits allow (--max-execs-per-vm 8, --max-execs
/// 24), each answer as the committed OpenAPI document describes it.
fn exec_limits(out: &lab::LabOutput) {
    let o = &out.stdout;
    let doc: Value = serde_json::from_str(include_str!("../../docs/openapi.json")).unwrap();
    let schema = |name: &str| &doc["components"]["schemas"][name];
    // Every key is one the schema names, every required key is there.
    let fits = |name: &str, v: &Value| {
        let s = schema(name);
        let props = s["properties"].as_object().unwrap();
        let m = v.as_object().unwrap_or_else(|| panic!("{v}"));
        assert!(m.keys().all(|k| props.contains_key(k)), "{name}: {v}");
        for r in s["required"].as_array().unwrap() {
            assert!(m.contains_key(r.as_str().unwrap()), "{name}: {r} in {v}");
        }
    };
    // The streamed exec whose client went: nothing in flight, no sleep.
    let gone = out.values("lim-sse-gone:");
    assert_eq!(gone, ["0 0"], "{o}");
    assert_eq!(
        out.values("lim-held:"),
        ["sproutd_execs_in_flight 24"],
        "{o}"
    );
    let lines = out.values("lim:");
    assert_eq!(lines.len(), 200, "{o}");
    let (mut ok, mut refused) = (0, 0);
    for l in lines {
        let mut f = l.splitn(4, ' ');
        let (n, status, retry, body) = (
            f.next().unwrap(),
            f.next().unwrap(),
            f.next().unwrap(),
            f.next().unwrap_or(""),
        );
        let v: Value = serde_json::from_str(body).unwrap_or_else(|e| {
            panic!(
                "{l}: {e}
{o}"
            )
        });
        match status {
            "200" => {
                fits("ExecResult", &v);
                assert_eq!(v["stdout"], format!("tok-{n}\n"), "{l}\n{o}");
                assert_eq!(v["exitCode"], 0, "{l}");
                ok += 1;
            }
            "429" => {
                fits("ErrorEnvelope", &v);
                assert_eq!(v["error"]["code"], "too_many_requests", "{l}");
                assert!(retry.parse::<u64>().is_ok_and(|r| r >= 1), "{l}");
                refused += 1;
            }
            _ => panic!("exec {n}: {l}\n{o}"),
        }
    }
    assert_eq!((ok, refused), (24, 176), "{o}");
    let m = out.values("lim-metrics:");
    assert!(m.contains(&"sproutd_execs_in_flight 0"), "{m:?}");
    let by = |limit: &str| -> u64 {
        let p = format!("sproutd_execs_refused_total{{limit=\"{limit}\"}} ");
        m.iter()
            .find_map(|l| l.strip_prefix(&p))
            .unwrap_or_else(|| panic!("{p} in {m:?}"))
            .parse()
            .unwrap()
    };
    // Sandbox 1 alone refused 12 at its own limit; the others met the
    // global one at least once (16 over three sandboxes of 8 each).
    assert!(by("sandbox") >= 12, "{m:?}");
    assert!(by("global") >= 1, "{m:?}");
    assert_eq!(by("sandbox") + by("global"), 176, "{m:?}");
    let deleted = out.values("lim-delete:");
    assert_eq!(deleted.len(), 4, "{o}");
    for d in deleted {
        assert!(d.contains(r#""deleted":true"#), "{d}");
    }
    assert_eq!(out.values("lim-daemon-exit:"), ["0"], "{o}");
}

/// A template is bound to the image it was built over. Here sproutd serves
/// an image `mini` (busybox and the agent, built in the lab with mkfs.ext4
/// -d, `/etc/version` saying which build) from its own cache. The first
/// create builds its template, the second restores it; the image is then
/// rebuilt (another mkfs: another superblock) and put in its place, as an
/// update does. The next create builds the template again and its guest reads
/// the new image whole. A sandbox asleep across the rebuild, and a user
/// snapshot taken over the old image, restore over the old image's version
/// sproutd kept; with that gone too, the snapshot is refused, saying why, and
/// restores again once the old image is back. A restart removes the kept
/// versions nothing needs.
const IMAGE_CHANGE: &str = r#"
ip link set lo up 2>/dev/null || ifconfig lo 127.0.0.1 up 2>/dev/null
export SPROUT_CACHE=/tmp/c
mkdir -p /tmp/c/images
ln -s /opt/sprout/vmlinux /tmp/c/vmlinux
ln -s /opt/sprout/images/scratch.ext4 /tmp/c/images/scratch.ext4
cat >/tmp/sprout-init <<'SPROUT_INIT_END'
@INIT@
SPROUT_INIT_END
mk() {
  r=/tmp/root-$1
  mkdir -p $r/bin $r/sbin $r/usr/bin $r/usr/sbin $r/etc $r/dev $r/proc $r/sys $r/tmp $r/run $r/mnt $r/root $r/workspace
  chmod 1777 $r/tmp
  cp /bin/busybox $r/bin/busybox
  for a in $(/bin/busybox --list-full); do [ -e $r/$a ] || ln -s /bin/busybox $r/$a; done
  cp /opt/sprout/images/.sprout-agent.stripped $r/sbin/sprout-agent
  cp /tmp/sprout-init $r/sbin/sprout-init
  chmod 0755 $r/sbin/sprout-agent $r/sbin/sprout-init
  printf 'root:x:0:0:root:/root:/bin/sh\n' >$r/etc/passwd
  printf 'root:x:0:\n' >$r/etc/group
  echo "$1" >$r/etc/version
  mkfs.ext4 -q -F -L mini -O ^has_journal -m 0 -E root_owner=0:0 -d $r /tmp/mini-$1.ext4 16M || exit 20
}
mk one
mk two
put() { cp /tmp/mini-$1.ext4 /tmp/c/images/mini.tmp && mv /tmp/c/images/mini.tmp /tmp/c/images/mini.ext4; }
put one
sprout daemon --listen 127.0.0.1:7070 --data-dir /tmp/sd >/tmp/sd.out 2>/tmp/sd.log &
sdpid=$!
i=0
until sprout api GET /v1/health >/dev/null 2>&1; do
  i=$((i+1)); [ $i -gt 600 ] && { echo "sproutd did not start"; cat /tmp/sd.log; exit 10; }
  sleep 0.1
done
api() { sprout api "$@" 2>/dev/null; }
# $1: a label; $2: the create's body. Retries while the template builds.
create() {
  i=0
  while :; do
    out=$(api POST /v1/runtime/schedule "$2")
    case "$out" in
      *template_building*)
        echo "$1-building: yes"
        i=$((i+1)); [ $i -gt 1800 ] && { echo "$1: no template"; tail -50 /tmp/sd.log; exit 11; }
        sleep 0.5 ;;
      *) break ;;
    esac
  done
  echo "$1: $out"
  id=$(echo "$out" | sed -n 's/.*"vmId":"\([^"]*\)".*/\1/p')
  [ -n "$id" ] || return 0
  echo "$1-version: $(api POST /v1/runtime/vms/$id/exec '{"command":"cat","argv":["/etc/version"]}')"
  echo "$1-read: $(api POST /v1/runtime/vms/$id/exec '{"command":"/bin/sh","argv":["-c","ls /bin | wc -l; cat /etc/passwd; md5sum /bin/busybox /sbin/sprout-agent | wc -l"]}')"
}
mini='{"image":"mini","cpus":1,"memoryMb":256}'
create first "$mini"
echo "templates-1: $(api GET /v1/runtime/templates)"
create second "$mini"
second=$id
snap=$(api POST /v1/runtime/vms/$id/snapshot '{}')
echo "snapshot: $snap"
sid=$(echo "$snap" | sed -n 's/.*"snapshotId":"\([^"]*\)".*/\1/p')
# Asleep across the rebuild, with a process running.
echo "bg: $(api POST /v1/runtime/vms/$second/exec '{"command":"/bin/sleep","argv":["7777"],"background":true}')"
echo "sleep: $(api POST /v1/runtime/vms/$second/sleep '{}')"
put two
create third "$mini"
echo "templates-2: $(api GET /v1/runtime/templates)"
echo "kept-2: $(ls /tmp/sd/images | wc -l)"
echo "woken-version: $(api POST /v1/runtime/vms/$second/exec '{"command":"cat","argv":["/etc/version"]}')"
echo "woken-ps: $(api POST /v1/runtime/vms/$second/exec '{"command":"/bin/sh","argv":["-c","ps -o args | grep -c [7]777"]}')"
create from-snapshot "{\"snapshot\":\"$sid\"}"
# Its kept version gone too: refused, saying why.
rm -f /tmp/sd/images/*.img
create from-snapshot-gone "{\"snapshot\":\"$sid\"}"
put one
create from-snapshot-again "{\"snapshot\":\"$sid\"}"
grep -i "building the template again" /tmp/sd.log | sed 's/^/log: /'
# At start, sproutd removes the kept versions nothing needs.
touch /tmp/sd/images/1-00000000000000000000000000000000.img
kill $sdpid; wait $sdpid
sprout daemon --listen 127.0.0.1:7070 --data-dir /tmp/sd >/tmp/sd.out 2>/tmp/sd2.log &
i=0
until sprout api GET /v1/health >/dev/null 2>&1; do
  i=$((i+1)); [ $i -gt 600 ] && { echo "sproutd did not start again"; cat /tmp/sd2.log; exit 12; }
  sleep 0.1
done
echo "kept-after-restart: $(ls /tmp/sd/images | tr '\n' ' ')"
grep -i "image versions nothing" /tmp/sd2.log | sed 's/^/log2: /'
"#;

#[test]
fn a_template_is_built_again_when_its_image_changes_and_snapshots_keep_the_old_one() {
    let script = IMAGE_CHANGE.replace(
        "@INIT@",
        include_str!("../../guest/images/sprout-init").trim_end(),
    );
    let out = lab::Script::new(script)
        .timeout(std::time::Duration::from_secs(1500))
        .run();
    out.assert_success();
    let o = &out.stdout;
    let exec_out = |label: &str| out.json(&format!("{label}:"))["stdout"].clone();
    // Built once, restored once, both over build one.
    assert!(!out.values("first-building:").is_empty(), "{o}");
    assert!(out.values("second-building:").is_empty(), "{o}");
    let first = out.json("first:");
    let second = out.json("second:");
    assert_eq!(first["state"], "running", "{o}");
    assert_eq!(second["snapshotId"], first["snapshotId"], "{o}");
    for l in ["first", "second"] {
        assert_eq!(exec_out(&format!("{l}-version")), "one\n", "{l}: {o}");
    }
    let t1 = out.json("templates-1:");
    let t1 = &t1["templates"][0];
    assert_eq!(t1["state"], "ready", "{o}");
    assert_eq!(t1["snapshotId"], first["snapshotId"], "{o}");
    // The image changed: built again, and the new guest reads build two
    // whole (before, it restored the old template over the new disk: the
    // old one's file contents, or EIO and EBADMSG from a file system that
    // did not match).
    assert!(!out.values("third-building:").is_empty(), "{o}");
    let third = out.json("third:");
    assert_eq!(third["state"], "running", "{o}");
    assert_ne!(third["snapshotId"], first["snapshotId"], "{o}");
    assert_eq!(exec_out("third-version"), "two\n", "{o}");
    for l in ["first", "second", "third"] {
        let r = out.json(&format!("{l}-read:"));
        assert_eq!(r["exitCode"], 0, "{l}: {o}");
        let lines: Vec<&str> = r["stdout"].as_str().unwrap().lines().collect();
        assert_eq!(
            lines[1..],
            ["root:x:0:0:root:/root:/bin/sh", "2"],
            "{l}: {o}"
        );
    }
    let t2 = out.json("templates-2:");
    assert_eq!(t2["templates"][0]["snapshotId"], third["snapshotId"], "{o}");
    assert!(
        out.values("log:")
            .iter()
            .any(|l| l.contains("not the one its template was built over")),
        "{o}"
    );
    // Build one was kept when its template booted, build two when its did.
    assert_eq!(out.values("kept-2:"), ["2"], "{o}");
    // The sandbox asleep across the rebuild wakes over build one, its
    // process alive; the user snapshot over build one restores over it.
    assert_eq!(exec_out("woken-version"), "one\n", "{o}");
    assert_eq!(exec_out("woken-ps"), "1\n", "{o}");
    assert_eq!(exec_out("from-snapshot-version"), "one\n", "{o}");
    // With build one gone from everywhere: refused, naming the image and
    // why; restored once build one is back in place.
    let refused = out.json("from-snapshot-gone:");
    let msg = refused["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("/tmp/c/images/mini.ext4") && msg.contains("rebuilt or changed"),
        "{o}"
    );
    assert!(out.values("from-snapshot-gone-version:").is_empty(), "{o}");
    assert_eq!(exec_out("from-snapshot-again-version"), "one\n", "{o}");
    // The restart removed the version nothing needs, and kept build one's
    // (kept again by that last restore, and its image's version now).
    let kept = out.values("kept-after-restart:");
    assert_eq!(kept.len(), 1, "{o}");
    let kept: Vec<&str> = kept[0].split_whitespace().collect();
    assert_eq!(kept.len(), 1, "{o}");
    assert!(
        kept[0].ends_with(".img") && !kept[0].starts_with("1-0"),
        "{o}"
    );
    assert!(
        out.values("log2:")
            .iter()
            .any(|l| l.contains("removed 1 image versions")),
        "{o}"
    );
}
