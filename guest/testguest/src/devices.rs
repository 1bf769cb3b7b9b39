//! The virtio devices vCPU 0 drives, found through the command line.

use crate::blk::Blk;
use crate::bootparams::BootInfo;
use crate::net::Net;
use crate::println;
use crate::rng::Rng;
use crate::virtio::{Transport, ID_BLOCK, ID_NET, ID_RNG, ID_VSOCK};
use crate::vsock::Vsock;
use core::sync::atomic::{AtomicU64, Ordering};
use guest_abi::layout::VIRTIO_MMIO_MAX;

const MAX_BLK: usize = VIRTIO_MMIO_MAX as usize;

pub struct Devices {
    pub blk: [Option<Blk>; MAX_BLK],
    pub nblk: usize,
    pub vsock: Option<Vsock>,
    pub rng: Option<Rng>,
    pub net: Option<Net>,
}

/// `CMD_PROBE`'s answer, published for every vCPU.
static PROBE: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];

impl Devices {
    /// Initialises every device on the command line (blk index = order found).
    pub fn probe(info: &BootInfo) -> Self {
        let mut d = Self {
            blk: [const { None }; MAX_BLK],
            nblk: 0,
            vsock: None,
            rng: None,
            net: None,
        };
        for dev in info.virtio_devices() {
            let Some((t, id)) = Transport::probe(dev.addr) else {
                println!("virtio: no device at {:#x}", dev.addr);
                continue;
            };
            let ok = match id {
                ID_BLOCK if d.nblk < MAX_BLK => Blk::new(t).map(|b| {
                    d.blk[d.nblk] = Some(b);
                    d.nblk += 1;
                }),
                ID_VSOCK if d.vsock.is_none() => Vsock::new(t).map(|v| d.vsock = Some(v)),
                ID_RNG if d.rng.is_none() => Rng::new(t).map(|r| d.rng = Some(r)),
                ID_NET if d.net.is_none() => Net::new(t).map(|n| d.net = Some(n)),
                _ => {
                    println!("virtio: device id {} at {:#x} not used", id, dev.addr);
                    continue;
                }
            };
            if ok.is_none() {
                println!(
                    "virtio: device id {} at {:#x} failed to initialise",
                    id, dev.addr
                );
            }
        }
        let cid = d.vsock.as_ref().map_or(0, |v| v.cid);
        let vals = [
            d.nblk as u64,
            d.vsock.is_some() as u64,
            d.rng.is_some() as u64,
            cid,
        ];
        for (p, v) in PROBE.iter().zip(vals) {
            p.store(v, Ordering::Release);
        }
        d
    }

    pub fn blk(&mut self, dev: u64) -> Option<&mut Blk> {
        self.blk.get_mut(usize::try_from(dev).ok()?)?.as_mut()
    }
}

/// `CMD_PROBE`'s rets, on any vCPU once vCPU 0 probed (the vsock CID as of then,
/// or the current one on vCPU 0).
pub fn probe_rets(devs: Option<&Devices>) -> [u64; 4] {
    let mut r = PROBE.each_ref().map(|p| p.load(Ordering::Acquire));
    if let Some(v) = devs.and_then(|d| d.vsock.as_ref()) {
        r[3] = v.cid;
    }
    r
}
