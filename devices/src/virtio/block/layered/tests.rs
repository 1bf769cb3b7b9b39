//! Layered disk tests: read-through, copy-up, layer writing model-checked against an
//! in-memory image, refused files, and the cost of a layer of a large sparse disk.

use std::os::unix::fs::MetadataExt;

use vmm_sys_util::tempdir::TempDir;

use super::*;

const CS: usize = CLUSTER_SIZE as usize;

/// A small deterministic generator (xorshift64*).
struct Rand(u64);

impl Rand {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

struct Dir {
    dir: TempDir,
    n: std::cell::Cell<u32>,
}

impl Dir {
    fn new() -> Self {
        Self {
            dir: TempDir::new().unwrap(),
            n: std::cell::Cell::new(0),
        }
    }

    /// A fresh path in the directory.
    fn path(&self, what: &str) -> PathBuf {
        self.n.set(self.n.get() + 1);
        self.dir.as_path().join(format!("{what}-{}", self.n.get()))
    }

    fn raw(&self, contents: &[u8]) -> LayerFiles {
        let p = self.path("raw");
        std::fs::write(&p, contents).unwrap();
        LayerFiles::raw(p)
    }

    fn disk(&self, layers: Vec<LayerFiles>, size: u64) -> Arc<LayeredDisk> {
        Arc::new(LayeredDisk::create(layers, &self.path("top"), size).unwrap())
    }

    fn layer(&self, d: &LayeredDisk, kind: LayerKind) -> (LayerFiles, LayerStats) {
        let files = LayerFiles::mapped(self.path("data"), self.path("map"));
        let map = files.map.as_ref().unwrap();
        let stats = d.write_layer(&files.data, map, kind).unwrap();
        (files, stats)
    }
}

fn read_all(d: &Arc<LayeredDisk>) -> Vec<u8> {
    let mut buf = vec![0u8; d.size() as usize];
    d.clone().read_at(&mut buf, 0).unwrap();
    buf
}

fn write(d: &Arc<LayeredDisk>, data: &[u8], off: u64) {
    d.clone().write_at(data, off).unwrap();
}

#[test]
fn reads_come_from_the_highest_layer_holding_each_cluster() {
    let dir = Dir::new();
    let size = 8 * CS as u64;
    // No layer at all: zeros.
    let empty = dir.disk(vec![], size);
    assert!(read_all(&empty).iter().all(|&b| b == 0));

    let base: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
    let base_files = dir.raw(&base);
    let d1 = dir.disk(vec![base_files.clone()], size);
    assert!(read_all(&d1) == base);
    write(&d1, &[0xbb; CS], 2 * CLUSTER_SIZE);
    let (l1, stats) = dir.layer(&d1, LayerKind::Diff);
    assert_eq!(stats.clusters, 1);
    assert_eq!(stats.data_bytes, CLUSTER_SIZE);

    // The diff alone holds one cluster; under it, nothing: zeros elsewhere.
    let alone = dir.disk(vec![l1.clone()], size);
    let got = read_all(&alone);
    assert!(got[2 * CS..3 * CS].iter().all(|&b| b == 0xbb));
    assert!(got[..2 * CS].iter().chain(&got[3 * CS..]).all(|&b| b == 0));

    // On the base: the diff's cluster, the base's others, the top's own above both.
    let d2 = dir.disk(vec![base_files, l1], size);
    write(&d2, &[0xcc; 1000], 3 * CLUSTER_SIZE + 100);
    let mut want = base.clone();
    want[2 * CS..3 * CS].fill(0xbb);
    want[3 * CS + 100..3 * CS + 1100].fill(0xcc);
    assert!(read_all(&d2) == want);
    // Unaligned reads across sources.
    let mut part = vec![0u8; CS + 300];
    d2.clone()
        .read_at(&mut part, 2 * CLUSTER_SIZE + 4000)
        .unwrap();
    assert_eq!(part, want[2 * CS + 4000..3 * CS + 4300]);
    assert_eq!(d2.layer_count(), 2);
    // Out of range accesses fail.
    let mut b = [0u8; 2];
    assert!(d2.clone().read_at(&mut b, size - 1).is_err());
    assert!(d2.clone().write_at(&b, u64::MAX).is_err());
}

#[test]
fn partial_writes_copy_up_the_rest_of_the_cluster() {
    let dir = Dir::new();
    // Ends in a short cluster of 1536 bytes.
    let size = 4 * CS as u64 + 1536;
    let mut model: Vec<u8> = (0..size).map(|i| (i * 7 % 253) as u8).collect();
    let base = dir.raw(&model);
    let d = dir.disk(vec![base.clone()], size);

    // One sector inside cluster 0.
    write(&d, &[1; 512], 512);
    model[512..1024].fill(1);
    // Straddling clusters 1 and 2.
    write(&d, &[2; 1024], 2 * CLUSTER_SIZE - 512);
    model[2 * CS - 512..2 * CS + 512].fill(2);
    // A sector of the short last cluster.
    write(&d, &[3; 512], 4 * CLUSTER_SIZE + 512);
    model[4 * CS + 512..4 * CS + 1024].fill(3);
    assert!(read_all(&d) == model);
    assert_eq!(d.allocated_clusters(), 4);
    assert_eq!(d.dirty_clusters(), 4);

    // A cluster the top holds is not copied up again: a later change below (which a
    // real layer never has) does not show through.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&base.data)
        .unwrap()
        .write_all_at(&[9; CS], 0)
        .unwrap();
    write(&d, &[4; 512], 0);
    model[..512].fill(4);
    assert!(read_all(&d) == model);

    // A whole-cluster write needs no copy-up, and covers the short last cluster too.
    write(&d, &[5; 1536], 4 * CLUSTER_SIZE);
    model[4 * CS..].fill(5);
    assert!(read_all(&d) == model);
    d.mark_clean();
    assert_eq!(d.dirty_clusters(), 0);
    assert_eq!(d.allocated_clusters(), 4);
}

/// Random writes over four rounds, a layer after each (diff, diff, full, diff),
/// checked against an in-memory image; then stacks of those layers, reopened, read
/// back the image as it was when their last layer was written.
#[test]
fn layers_reopen_as_the_image_they_froze() {
    let dir = Dir::new();
    let size = 64 * CS as u64 + 1536;
    let mut rng = Rand(0x5eed_1234_abcd_0001);
    let base_bytes = rng.bytes(size as usize);
    let base = dir.raw(&base_bytes);
    let mut model = base_bytes;
    let d = dir.disk(vec![base.clone()], size);

    let kinds = [
        LayerKind::Diff,
        LayerKind::Diff,
        LayerKind::Full,
        LayerKind::Diff,
    ];
    let mut layers = Vec::new();
    let mut frozen = Vec::new();
    for (round, kind) in kinds.into_iter().enumerate() {
        let mut touched = std::collections::BTreeSet::new();
        for _ in 0..40 {
            let sectors = size / 512;
            let start = rng.below(sectors);
            let len = 1 + rng.below(20.min(sectors - start));
            let (off, len) = (start * 512, len * 512);
            let data = rng.bytes(len as usize);
            write(&d, &data, off);
            model[off as usize..(off + len) as usize].copy_from_slice(&data);
            touched.extend(off / CLUSTER_SIZE..=(off + len - 1) / CLUSTER_SIZE);
            if rng.below(4) == 0 {
                // Some zero writes: present in the layer, stored as holes.
                let z = rng.below(sectors - 8) * 512;
                write(&d, &[0; 4096], z);
                model[z as usize..z as usize + 4096].fill(0);
                touched.extend(z / CLUSTER_SIZE..=(z + 4095) / CLUSTER_SIZE);
            }
            let mut probe = vec![0u8; 3000];
            let at = rng.below(size - 3000);
            d.clone().read_at(&mut probe, at).unwrap();
            assert!(
                probe == model[at as usize..at as usize + 3000],
                "round {round}"
            );
        }
        assert_eq!(d.dirty_clusters(), touched.len() as u64, "round {round}");
        let (files, stats) = dir.layer(&d, kind);
        let want_clusters = match kind {
            LayerKind::Full => size.div_ceil(CLUSTER_SIZE),
            LayerKind::Diff => touched.len() as u64,
        };
        assert_eq!(stats.clusters, want_clusters, "round {round}");
        assert!(stats.data_bytes <= stats.clusters * CLUSTER_SIZE);
        d.mark_clean();
        layers.push(files);
        frozen.push(model.clone());
    }
    assert!(read_all(&d) == model);

    let (l1, l2, l3, l4) = (&layers[0], &layers[1], &layers[2], &layers[3]);
    let stacks = [
        (vec![base.clone(), l1.clone()], 0),
        (vec![base.clone(), l1.clone(), l2.clone()], 1),
        (vec![l3.clone()], 2),
        (vec![l3.clone(), l4.clone()], 3),
        (
            vec![base.clone(), l1.clone(), l2.clone(), l3.clone(), l4.clone()],
            3,
        ),
    ];
    for (i, (stack, want)) in stacks.into_iter().enumerate() {
        let got = read_all(&dir.disk(stack, size));
        assert!(got == frozen[want], "stack {i}");
    }

    // A full layer of a reopened stack is the whole disk on its own, and a stack
    // keeps working for writes.
    let stack = dir.disk(vec![l3.clone(), l4.clone()], size);
    write(&stack, &[7; 512], 0);
    let mut last = model.clone();
    last[..512].fill(7);
    let (full, _) = dir.layer(&stack, LayerKind::Full);
    assert!(read_all(&dir.disk(vec![full], size)) == last);
}

#[test]
fn bad_files_are_refused() {
    let dir = Dir::new();
    let size = 16 * CS as u64;
    let d = dir.disk(vec![], size);
    write(&d, &[1; 100], 5000);
    let (good, _) = dir.layer(&d, LayerKind::Diff);
    let good_map = good.map.clone().unwrap();
    assert!(LayeredDisk::create(vec![good.clone()], &dir.path("top"), size).is_ok());

    let with_map = |bytes: &[u8]| {
        let m = dir.path("badmap");
        std::fs::write(&m, bytes).unwrap();
        let files = LayerFiles::mapped(good.data.clone(), m);
        LayeredDisk::create(vec![files], &dir.path("top"), size).unwrap_err()
    };
    let map = std::fs::read(&good_map).unwrap();
    let mut flipped = map.clone();
    flipped[40] ^= 0x10;
    for (bytes, want) in [
        (&map[..map.len() / 2], "is 24 bytes"),
        (&[][..], "is 0 bytes"),
        (&flipped[..], "checksum"),
    ] {
        let err = with_map(bytes);
        assert!(matches!(err, LayeredError::Map { .. }), "{err}");
        let chain = format!("{err}: {}", std::error::Error::source(&err).unwrap());
        assert!(chain.starts_with("Bad cluster map"), "{chain}");
        assert!(chain.contains(want), "{chain}");
    }
    // A map of another disk size: refused even with data of the right size.
    let other = dir.disk(vec![], 2 * size);
    let (big, _) = dir.layer(&other, LayerKind::Full);
    let files = LayerFiles::mapped(good.data.clone(), big.map.unwrap());
    assert!(matches!(
        LayeredDisk::create(vec![files], &dir.path("top"), size),
        Err(LayeredError::Map { .. })
    ));
    // Data of the wrong size, a missing file.
    let short = dir.raw(&[0; 4096]);
    assert!(matches!(
        LayeredDisk::create(vec![short], &dir.path("top"), size),
        Err(LayeredError::LayerSize { found: 4096, .. })
    ));
    let missing = LayerFiles::raw(dir.path("missing"));
    assert!(matches!(
        LayeredDisk::create(vec![missing], &dir.path("top"), size),
        Err(LayeredError::Open { .. })
    ));
    // Bad sizes, an existing top, too many layers.
    for bad in [0, 1000, MAX_DISK_SIZE + 512] {
        assert!(matches!(
            LayeredDisk::create(vec![], &dir.path("top"), bad),
            Err(LayeredError::DiskSize(_))
        ));
    }
    assert!(matches!(
        LayeredDisk::create(vec![], &good.data, size),
        Err(LayeredError::Exists(_))
    ));
    let many = vec![good.clone(); MAX_LAYERS + 1];
    assert!(matches!(
        LayeredDisk::create(many, &dir.path("top"), size),
        Err(LayeredError::TooManyLayers(65))
    ));
    // Writing a layer over existing files is refused and leaves them alone.
    let before = std::fs::read(&good.data).unwrap();
    let fresh = dir.path("map");
    let err = d
        .write_layer(&good.data, &fresh, LayerKind::Full)
        .unwrap_err();
    assert!(matches!(err, LayeredError::Exists(_)), "{err}");
    assert!(!fresh.exists());
    let fresh = dir.path("data");
    let err = d
        .write_layer(&fresh, &good_map, LayerKind::Full)
        .unwrap_err();
    assert!(matches!(err, LayeredError::Exists(_)), "{err}");
    assert!(!fresh.exists());
    assert_eq!(std::fs::read(&good.data).unwrap(), before);
}

/// A 16 GiB disk over a sparse raw base with 1 MiB of data, 3 MiB written on top: its
/// full layer holds 4 MiB, not 16 GiB.
#[test]
fn layer_of_a_sparse_16_gib_disk_costs_its_data() {
    const GIB: u64 = 1 << 30;
    const MIB: usize = 1 << 20;
    let size = 16 * GIB;
    let dir = Dir::new();
    let base = dir.path("base");
    {
        let f = File::create(&base).unwrap();
        f.set_len(size).unwrap();
        f.write_all_at(&vec![0x42; MIB], 8 * GIB).unwrap();
    }
    let d = dir.disk(vec![LayerFiles::raw(&base)], size);
    let writes = [
        (0, 0x11u8),
        (5 * GIB + 4096, 0x22),
        (size - MIB as u64, 0x33),
    ];
    for (off, fill) in writes {
        write(&d, &vec![fill; MIB], off);
    }

    let (full, stats) = dir.layer(&d, LayerKind::Full);
    assert_eq!(stats.clusters, 4 * MIB as u64 / CLUSTER_SIZE);
    assert_eq!(stats.data_bytes, 4 * MIB as u64);
    let meta = std::fs::metadata(&full.data).unwrap();
    assert_eq!(meta.len(), size);
    let allocated = meta.blocks() * 512;
    assert!(
        allocated <= 4 * MIB as u64 + 256 * 1024,
        "full layer takes {allocated} bytes"
    );
    // The map lists the four runs of data (header, run count, a run of 16
    // bytes each, checksum), not one bit per cluster (512 KiB).
    assert_eq!(stats.map_bytes, 32 + 8 + 4 * 16 + 8);

    let (diff, dstats) = dir.layer(&d, LayerKind::Diff);
    assert_eq!(dstats.data_bytes, 3 * MIB as u64);
    assert!(std::fs::metadata(&diff.data).unwrap().blocks() * 512 <= 3 * MIB as u64 + 256 * 1024);

    for stack in [vec![full], vec![LayerFiles::raw(&base), diff]] {
        let r = dir.disk(stack, size);
        let mut buf = vec![0u8; MIB];
        for (off, fill) in writes.into_iter().chain([(8 * GIB, 0x42)]) {
            r.clone().read_at(&mut buf, off).unwrap();
            assert!(buf.iter().all(|&b| b == fill), "at {off:#x}");
        }
        r.clone().read_at(&mut buf, 12 * GIB).unwrap();
        assert!(buf.iter().all(|&b| b == 0));
    }
}

#[test]
fn block_device_over_a_layered_disk() {
    use super::super::test_utils::*;
    use crate::virtio::VirtioDevice;
    use virtio_bindings::bindings::virtio_blk::{
        VIRTIO_BLK_S_OK, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
    };
    use vm_memory::{Bytes, GuestAddress};

    let dir = Dir::new();
    let size = 8 * CS as u64;
    let base = dir.raw(&vec![0x5a; size as usize]);
    let disk = dir.disk(vec![base], size);
    let mut b = super::super::Block::with_layered(disk.clone(), false, "layered").unwrap();
    assert!(Arc::ptr_eq(b.layered_disk().unwrap(), &disk));
    assert_eq!(b.capacity_sectors(), size / 512);

    let mem = guest_memory();
    let vq = MockQueue::new(&mem, 16);
    activate(&mut b, &mem, &vq);
    mem.write_slice(&[0xee; 512], GuestAddress(DATA)).unwrap();
    header(&mem, HDR, VIRTIO_BLK_T_OUT, 3);
    let descs = [D(HDR, 16, false), D(DATA, 512, false), D(STATUS, 1, true)];
    assert_eq!(run(&mut b, &vq, &descs), (0, 1));
    assert_eq!(status(&mem), VIRTIO_BLK_S_OK);
    assert_eq!(disk.dirty_clusters(), 1);

    header(&mem, HDR, VIRTIO_BLK_T_IN, 0);
    let descs = [D(HDR, 16, false), D(DATA, 4096, true), D(STATUS, 1, true)];
    assert_eq!(run(&mut b, &vq, &descs), (0, 4097));
    let mut got = vec![0u8; 4096];
    mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
    assert!(got[..3 * 512].iter().all(|&x| x == 0x5a));
    assert!(got[3 * 512..4 * 512].iter().all(|&x| x == 0xee));
    assert!(got[4 * 512..].iter().all(|&x| x == 0x5a));
    assert!(b.is_activated());
    // Plain-file devices have no layered disk.
    let img = TempImage::new(&[0; 4096]);
    assert!(new_block(&img, false, "").layered_disk().is_none());
}

#[test]
fn an_existing_file_as_top_keeps_guest_writes_and_snapshots_only_its_data() {
    use std::os::unix::fs::FileExt;
    let dir = vmm_sys_util::tempdir::TempDir::new_with_prefix("/tmp/sprout-layered-open").unwrap();
    let top = dir.as_path().join("disk.img");
    let f = std::fs::File::create(&top).unwrap();
    f.set_len(1 << 30).unwrap();
    f.write_all_at(&[7u8; 4096], 8192).unwrap();
    drop(f);
    use crate::virtio::block::DiskBackend;
    let mut disk = std::sync::Arc::new(LayeredDisk::open_file(&top).unwrap());
    assert_eq!(disk.size(), 1 << 30);
    assert_eq!(disk.allocated_clusters(), 1);
    let mut buf = [0u8; 512];
    disk.read_at(&mut buf, 8192 + 512).unwrap();
    assert_eq!(buf, [7u8; 512]);
    disk.write_at(&[9u8; 512], 1 << 20).unwrap();
    // The write landed in the file itself.
    let mut on_file = [0u8; 512];
    std::fs::File::open(&top)
        .unwrap()
        .read_exact_at(&mut on_file, 1 << 20)
        .unwrap();
    assert_eq!(on_file, [9u8; 512]);
    assert_eq!(disk.dirty_clusters(), 1);
    let (d, m) = (dir.as_path().join("l.data"), dir.as_path().join("l.map"));
    let stats = disk.write_layer(&d, &m, LayerKind::Full).unwrap();
    assert_eq!(stats.clusters, 2);
    // Reopened as a layer under a fresh top, it reads the same bytes.
    let mut again = std::sync::Arc::new(
        LayeredDisk::create(
            vec![LayerFiles::mapped(d, m)],
            &dir.as_path().join("top2"),
            1 << 30,
        )
        .unwrap(),
    );
    again.read_at(&mut buf, 1 << 20).unwrap();
    assert_eq!(buf, [9u8; 512]);
    assert!(LayeredDisk::open_file(&dir.as_path().join("missing")).is_err());
}

/// A staged diff holds what was dirty when it was staged, written later as
/// the same layer `write_layer` would have written then; writes after the
/// staging are not in it and count toward the next diff.
#[test]
fn a_staged_diff_is_the_layer_of_its_instant() {
    let dir = Dir::new();
    let size = 16 * CS as u64 + 512;
    let base: Vec<u8> = (0..size).map(|i| (i % 241) as u8).collect();
    let base_files = dir.raw(&base);
    let d = dir.disk(vec![base_files.clone()], size);
    let mut r = Rand(7);
    let first = r.bytes(3 * CS);
    write(&d, &first, CLUSTER_SIZE + 17);
    write(&d, &[0; 100], 16 * CLUSTER_SIZE + 12);
    let at_stage = read_all(&d);
    let staged = d.stage_diff().unwrap();
    assert_eq!(d.dirty_clusters(), 0);
    assert_eq!(staged.bytes(), 4 * CLUSTER_SIZE + 512);
    // The guest writes on: over a staged cluster and a new one.
    write(&d, &[0xee; CS], CLUSTER_SIZE);
    write(&d, &[0xdd; 10], 9 * CLUSTER_SIZE);
    assert_eq!(d.dirty_clusters(), 2);

    let files = LayerFiles::mapped(dir.path("data"), dir.path("map"));
    let stats = staged
        .write(&files.data, files.map.as_ref().unwrap())
        .unwrap();
    assert_eq!(stats.clusters, 5);
    // Refused over existing files, which it leaves alone.
    assert!(staged
        .write(&files.data, files.map.as_ref().unwrap())
        .is_err());
    assert!(files.data.exists());
    let frozen = dir.disk(vec![base_files.clone(), files.clone()], size);
    assert!(read_all(&frozen) == at_stage);

    // The next diff, on it, holds the writes after the staging.
    let (next, stats) = dir.layer(&d, LayerKind::Diff);
    assert_eq!(stats.clusters, 2);
    let now = dir.disk(vec![base_files, files, next], size);
    assert!(read_all(&now) == read_all(&d));
}

/// A kept top over a read-only template: the template shows through where
/// the top holds nothing, writes (partial clusters copied up first) land in
/// the top file only, and the same file reopened over the same template is
/// the same disk; the template never changes.
#[test]
fn a_kept_top_over_a_template_reads_through_and_reopens_as_the_same_disk() {
    use crate::virtio::block::DiskBackend;
    let dir = Dir::new();
    let size = 16 * CS as u64;
    let base: Vec<u8> = (0..size).map(|i| (i % 239) as u8 + 1).collect();
    let template = dir.raw(&base);
    let top = dir.path("disk.ext4");
    std::fs::File::create(&top).unwrap().set_len(size).unwrap();

    let d = std::sync::Arc::new(LayeredDisk::open_file_over(vec![template.clone()], &top).unwrap());
    assert_eq!((d.layer_count(), d.allocated_clusters()), (1, 0));
    assert!(
        read_all(&d) == base,
        "the template shows through an empty top"
    );
    let mut want = base.clone();
    write(&d, &[0xaa; 100], 3 * CLUSTER_SIZE + 50);
    want[3 * CS + 50..3 * CS + 150].fill(0xaa);
    write(&d, &[0; CS], 7 * CLUSTER_SIZE);
    want[7 * CS..8 * CS].fill(0);
    assert!(read_all(&d) == want);
    assert_eq!(d.allocated_clusters(), 2);
    d.clone().flush().unwrap();
    drop(d);

    // Only the written clusters are in the top; the partial one was copied
    // up whole; the template is untouched.
    let top_bytes = std::fs::read(&top).unwrap();
    assert!(top_bytes[3 * CS..4 * CS] == want[3 * CS..4 * CS]);
    assert!(top_bytes[..3 * CS].iter().all(|&b| b == 0));
    assert!(std::fs::read(&template.data).unwrap() == base);

    let again = std::sync::Arc::new(LayeredDisk::open_file_over(vec![template], &top).unwrap());
    assert_eq!(again.allocated_clusters(), 2);
    assert!(read_all(&again) == want, "reopened, the same disk");

    // A template of another size is refused.
    let other = dir.raw(&base[..8 * CS]);
    assert!(matches!(
        LayeredDisk::open_file_over(vec![other], &top),
        Err(LayeredError::LayerSize { .. })
    ));
}

#[test]
fn an_unsynced_layer_is_the_same_layer_as_a_synced_one() {
    let dir = Dir::new();
    let size = 6 * CS as u64;
    let base: Vec<u8> = (0..size).map(|i| (i % 241) as u8).collect();
    let base_files = dir.raw(&base);
    let d = dir.disk(vec![base_files.clone()], size);
    write(&d, &[0x5e; 700], CLUSTER_SIZE + 30);
    write(&d, &[0x17; CS], 4 * CLUSTER_SIZE);
    let want = read_all(&d);
    for kind in [LayerKind::Diff, LayerKind::Full] {
        let (synced, s1) = dir.layer(&d, kind);
        let unsynced = LayerFiles::mapped(dir.path("data"), dir.path("map"));
        let map = unsynced.map.as_ref().unwrap();
        let s2 = d.write_layer_unsynced(&unsynced.data, map, kind).unwrap();
        assert_eq!((s1.clusters, s1.data_bytes), (s2.clusters, s2.data_bytes));
        let read = |p: &Path| std::fs::read(p).unwrap();
        assert!(read(&synced.data) == read(&unsynced.data), "{kind:?} data");
        assert_eq!(
            read(synced.map.as_ref().unwrap()),
            read(map),
            "{kind:?} map"
        );
        let layers = match kind {
            LayerKind::Diff => vec![base_files.clone(), unsynced],
            LayerKind::Full => vec![unsynced],
        };
        assert!(
            read_all(&dir.disk(layers, size)) == want,
            "{kind:?} reopened"
        );
    }
    // Refused like a synced one onto an existing map.
    let (taken, _) = dir.layer(&d, LayerKind::Diff);
    let fresh = dir.path("data");
    assert!(matches!(
        d.write_layer_unsynced(&fresh, taken.map.as_ref().unwrap(), LayerKind::Diff),
        Err(LayeredError::Exists(_))
    ));
    assert!(!fresh.exists(), "a refused layer left its data file");
}
