//! vsock packet handling: tx packets from the input (header and data spread over any
//! descriptors) through the device and its connection muxer, with a host stream that
//! asked for a connection and a host listener for guest connections, run by a real
//! event manager. Well-formed rx and event buffers take the device's answers.

#![no_main]

use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use devices::virtio::vsock::Vsock;
use devices::virtio::{VirtioDevice, VIRTIO_F_VERSION_1};
use event_manager::{EventManager, SubscriberOps};
use libfuzzer_sys::fuzz_target;
use sprout_fuzz::{
    fill_data, guest_memory, place_queue, set_addresses, take_u16, take_u8, GuestMemoryMmap,
    AVAIL_OFF, QUEUE_SPAN,
};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

const RAM: u64 = 0x2_0000;
const RXQ_BASE: u64 = 0;
const TXQ_BASE: u64 = QUEUE_SPAN;
const EVQ_BASE: u64 = 2 * QUEUE_SPAN;
const RX_BUFS: u64 = 3 * QUEUE_SPAN;
const RX_COUNT: u16 = 16;
const RX_LEN: u32 = 0x400;
const DATA: u64 = RX_BUFS + RX_COUNT as u64 * RX_LEN as u64;
/// The host listener guest connections to this port reach.
const HOST_PORT: u32 = 1234;

/// A queue of `count` device-writable buffers of `len` bytes from `bufs`.
fn writable_queue(mem: &GuestMemoryMmap, base: u64, bufs: u64, count: u16, len: u32) -> Queue {
    for i in 0..count {
        let d = base + u64::from(i) * 16;
        mem.write_obj(bufs + u64::from(i) * u64::from(len), GuestAddress(d))
            .unwrap();
        mem.write_obj(len, GuestAddress(d + 8)).unwrap();
        mem.write_obj(2u16, GuestAddress(d + 12)).unwrap(); // VRING_DESC_F_WRITE
        mem.write_obj(0u16, GuestAddress(d + 14)).unwrap();
        mem.write_obj(i, GuestAddress(base + AVAIL_OFF + 4 + u64::from(i) * 2))
            .unwrap();
    }
    mem.write_obj(count, GuestAddress(base + AVAIL_OFF + 2))
        .unwrap();
    let mut q = Queue::new(256).unwrap();
    q.set_size(count.next_power_of_two());
    set_addresses(&mut q, base);
    q.set_ready(true);
    q
}

fn socket_path() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("sprout-fuzz-vsock-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    });
    dir.join(format!("v{}.sock", N.fetch_add(1, Ordering::Relaxed)))
}

fuzz_target!(|data: &[u8]| {
    let mut input = data;
    let flags = take_u8(&mut input);
    let connect_port = take_u16(&mut input);
    let mem = guest_memory(RAM as usize);
    let rxq = writable_queue(&mem, RXQ_BASE, RX_BUFS, RX_COUNT, RX_LEN);
    let evq = writable_queue(&mem, EVQ_BASE, DATA - 64, 2, 8);
    let txq = place_queue(&mem, TXQ_BASE, &mut input);
    fill_data(&mem, DATA, RAM, input);

    let path = socket_path();
    let dev = Vsock::new(3, path.clone()).expect("vsock");
    let listener_path = PathBuf::from(format!("{}_{HOST_PORT}", path.display()));
    let _listener = (flags & 1 != 0).then(|| UnixListener::bind(&listener_path).unwrap());
    let dev = Arc::new(Mutex::new(dev));
    dev.lock()
        .unwrap()
        .activate(mem.clone(), VIRTIO_F_VERSION_1, vec![rxq, txq, evq])
        .expect("activate");
    let mut em = EventManager::<Arc<Mutex<Vsock>>>::new().expect("event manager");
    em.add_subscriber(dev.clone());

    let mut host = None;
    if flags & 2 != 0 {
        if let Ok(mut s) = UnixStream::connect(&path) {
            let _ = writeln!(s, "CONNECT {connect_port}");
            host = Some(s);
        }
    }
    for round in 0..4 {
        if round == 2 && flags & 4 != 0 {
            dev.lock().unwrap().send_transport_reset();
        }
        let _ = dev.lock().unwrap().queue_events()[1].write(1);
        let _ = em.run_with_timeout(0);
    }
    drop(host);
    let _ = em.run_with_timeout(0);
    drop(em);
    drop(dev);
    let _ = std::fs::remove_file(&listener_path);
});
