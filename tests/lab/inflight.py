#!/usr/bin/env python3
"""In-flight I/O and memory workload that checks its own data, for snapshot
and restore tests in a Linux guest (tests/lab/restore-stress.sh).

  inflight.py start DIR [--mib N] [--threads T] [--mem-mib M]
      Starts the workload detached (it outlives the exec that started it) and
      returns once every writer has finished its first pass.
      Writers: T threads, each owning a slice of DIR/data (N MiB, 4 KiB
      blocks), opened O_DIRECT: so T requests are in flight at once. Each pass
      writes every block of the slice with the pass number (a header with the
      block, the pass and a CRC-32 of the payload), then reads every block
      back and checks it: a lost, stale, torn or misplaced write is an error.
      Memory: M MiB in 64 KiB chunks, each filled with its index and the pass
      number, then checked, over and over.
      DIR/status holds one line, rewritten (atomically) after every pass:
        passes=<writer passes done> errors=<n> mem_passes=<n> mem_errors=<n>
      Errors are also described in DIR/errors.log.
  inflight.py wait DIR --more K [--timeout S]
      Waits until K more writer passes (and one more memory pass) have
      finished than when it started, then prints the status; exit 1 on any
      error, 2 on timeout (the workload does not progress).
  inflight.py stop DIR
      Stops the workload after its current passes, checks every block of
      the file once more and prints the final status; exit 1 on any error.
  inflight.py selftest DIR
      The checker's negative control: one pass, then one block is rewritten
      with a payload its CRC does not match; the check must find exactly it.
"""

import mmap
import os
import struct
import sys
import threading
import time
import zlib

BLOCK = 4096
MAGIC = b"SPIO"
HEADER = struct.Struct("<4sIQQI")  # magic, writer, block, pass, crc32(payload)
CHUNK = 64 * 1024


def payload(block, gen):
    unit = struct.pack("<QQ", block, gen)
    return (unit * (BLOCK // len(unit)))[: BLOCK - HEADER.size]


def make_block(writer, block, gen):
    p = payload(block, gen)
    return HEADER.pack(MAGIC, writer, block, gen, zlib.crc32(p)) + p


def check_block(data, block, gen):
    """None if the block holds pass `gen` of `block`, else what is wrong."""
    magic, _w, b, g, crc = HEADER.unpack_from(data)
    if magic != MAGIC:
        return "no header (magic %r)" % magic
    if b != block:
        return "holds block %d" % b
    if zlib.crc32(data[HEADER.size:]) != crc:
        return "payload does not match its CRC (torn or corrupted)"
    if data[HEADER.size:] != payload(block, g):
        return "payload is not pass %d's" % g
    if gen is not None and g != gen:
        return "holds pass %d, not %d" % (g, gen)
    return None


class State:
    def __init__(self, d):
        self.d = d
        self.lock = threading.Lock()
        self.passes = 0
        self.errors = 0
        self.mem_passes = 0
        self.mem_errors = 0
        self.stop = False

    def error(self, what):
        with self.lock:
            self.errors += 1
            with open(os.path.join(self.d, "errors.log"), "a") as f:
                f.write(what + "\n")

    def line(self):
        return "passes=%d errors=%d mem_passes=%d mem_errors=%d" % (
            self.passes, self.errors, self.mem_passes, self.mem_errors)

    def publish(self):
        with self.lock:
            tmp = os.path.join(self.d, "status.tmp")
            with open(tmp, "w") as f:
                f.write(self.line() + "\n")
            os.rename(tmp, os.path.join(self.d, "status"))


def aligned():
    return mmap.mmap(-1, BLOCK)


def writer(st, fd, w, first, count, started):
    buf = aligned()
    gen = 0
    while not st.stop:
        gen += 1
        for b in range(first, first + count):
            buf.seek(0)
            buf.write(make_block(w, b, gen))
            if os.pwrite(fd, buf, b * BLOCK) != BLOCK:
                st.error("writer %d: short write of block %d" % (w, b))
        for b in range(first, first + count):
            if os.preadv(fd, [buf], b * BLOCK) != BLOCK:
                st.error("writer %d: short read of block %d" % (w, b))
                continue
            why = check_block(bytes(buf), b, gen)
            if why:
                st.error("writer %d pass %d: block %d %s" % (w, gen, b, why))
        with st.lock:
            st.passes += 1
        st.publish()
        started.release()


def memory(st, mib):
    n = mib * 1024 * 1024 // CHUNK
    chunks = [None] * n
    gen = 0
    while not st.stop:
        gen += 1
        for i in range(n):
            chunks[i] = bytearray(struct.pack("<QQ", i, gen) * (CHUNK // 16))
        for i in range(n):
            if chunks[i] != struct.pack("<QQ", i, gen) * (CHUNK // 16):
                with st.lock:
                    st.mem_errors += 1
                st.error("memory pass %d: chunk %d changed" % (gen, i))
        with st.lock:
            st.mem_passes += 1
        st.publish()


def status(d):
    try:
        with open(os.path.join(d, "status")) as f:
            return dict(kv.split("=") for kv in f.read().split())
    except (OSError, ValueError):
        return None


def run(d, mib, threads, mem_mib, ready_fd):
    path = os.path.join(d, "data")
    blocks = mib * 1024 * 1024 // BLOCK
    # Allocate the file first, so O_DIRECT writes go straight to the disk.
    with open(path, "wb") as f:
        f.write(b"\0" * (blocks * BLOCK))
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    st = State(d)
    per = blocks // threads
    started = threading.Semaphore(0)
    ts = [threading.Thread(target=writer, args=(st, fd, w, w * per, per, started), daemon=True)
          for w in range(threads)]
    ts.append(threading.Thread(target=memory, args=(st, mem_mib), daemon=True))
    for t in ts:
        t.start()
    for _ in range(threads):
        started.acquire()
    os.write(ready_fd, b"ok\n")
    os.close(ready_fd)
    while not os.path.exists(os.path.join(d, "stop")):
        time.sleep(0.2)
    st.stop = True
    for t in ts:
        t.join()
    # A last check of every block: each holds some pass of itself, whole.
    buf = aligned()
    for b in range(per * threads):
        os.preadv(fd, [buf], b * BLOCK)
        why = check_block(bytes(buf), b, None)
        if why:
            st.error("final check: block %d %s" % (b, why))
    st.publish()
    # Whole or absent: a reader polls for it.
    tmp = os.path.join(d, "done.tmp")
    with open(tmp, "w") as f:
        f.write(st.line() + "\n")
    os.rename(tmp, os.path.join(d, "done"))


def start(d, mib, threads, mem_mib):
    os.makedirs(d, exist_ok=True)
    for name in ("status", "errors.log", "stop", "done", "done.tmp"):
        try:
            os.unlink(os.path.join(d, name))
        except FileNotFoundError:
            pass
    r, w = os.pipe()
    if os.fork() == 0:
        os.close(r)
        os.setsid()
        if os.fork() != 0:
            os._exit(0)
        null = os.open("/dev/null", os.O_RDWR)
        log = os.open(os.path.join(d, "workload.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        try:
            run(d, mib, threads, mem_mib, w)
        except BaseException as e:  # recorded for the test to show
            print("inflight: the workload failed: %r" % (e,), flush=True)
            os._exit(1)
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        got = f.read()
    if got != "ok\n":
        sys.exit("inflight: the workload did not start (see %s/workload.log)" % d)
    print("inflight: started " + (status_line(d) or ""))


def status_line(d):
    s = status(d)
    return None if s is None else " ".join("%s=%s" % kv for kv in s.items())


def wait(d, more, timeout):
    s0 = status(d)
    if s0 is None:
        sys.exit("inflight: no status in %s" % d)
    want = int(s0["passes"]) + more
    want_mem = int(s0["mem_passes"]) + 1
    deadline = time.monotonic() + timeout
    while True:
        s = status(d)
        if s and (int(s["errors"]) or int(s["mem_errors"])):
            print("inflight: ERRORS " + status_line(d))
            os.system("head -20 %s/errors.log" % d)
            sys.exit(1)
        if s and int(s["passes"]) >= want and int(s["mem_passes"]) >= want_mem:
            print("inflight: progressed " + status_line(d))
            return
        if time.monotonic() > deadline:
            print("inflight: STALLED " + str(status_line(d)))
            sys.exit(2)
        time.sleep(0.2)


def stop(d, timeout=600):
    open(os.path.join(d, "stop"), "w").close()
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(d, "done")):
        if time.monotonic() > deadline:
            print("inflight: STALLED at stop " + str(status_line(d)))
            sys.exit(2)
        time.sleep(0.2)
    with open(os.path.join(d, "done")) as f:
        line = f.read().strip()
    print("inflight: final " + line)
    s = dict(kv.split("=") for kv in line.split())
    if int(s["errors"]) or int(s["mem_errors"]):
        os.system("head -20 %s/errors.log" % d)
        sys.exit(1)


def selftest(d):
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "data")
    blocks = 16
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    for b in range(blocks):
        os.pwrite(fd, make_block(0, b, 1), b * BLOCK)
    bad = bytearray(make_block(0, 5, 1))
    bad[100] ^= 0xFF
    os.pwrite(fd, bytes(bad), 5 * BLOCK)
    # A block written to the wrong place.
    os.pwrite(fd, make_block(0, 9, 1), 11 * BLOCK)
    found = []
    for b in range(blocks):
        why = check_block(os.pread(fd, BLOCK, b * BLOCK), b, 1)
        if why:
            found.append(b)
    os.close(fd)
    print("inflight: selftest found bad blocks %s" % found)
    if found != [5, 11]:
        sys.exit(1)


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    cmd, d, rest = argv[1], argv[2], argv[3:]
    opts = {}
    while rest:
        if len(rest) < 2 or not rest[0].startswith("--"):
            sys.exit("inflight: bad arguments %r" % rest)
        opts[rest[0][2:]] = int(rest[1])
        rest = rest[2:]
    if cmd == "start":
        start(d, opts.get("mib", 4), opts.get("threads", 8), opts.get("mem-mib", 16))
    elif cmd == "wait":
        wait(d, opts.get("more", 2), opts.get("timeout", 600))
    elif cmd == "stop":
        stop(d)
    elif cmd == "selftest":
        selftest(d)
    else:
        sys.exit("inflight: unknown command %r" % cmd)


if __name__ == "__main__":
    main(sys.argv)
