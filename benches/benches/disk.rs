//! Layered disk costs on every restore, fork child and snapshot of a VM with
//! a writable disk, for a 16 GiB disk (a 512 KiB cluster map per layer):
//! * `disk_open_over_layer`: a new private top over one layer written
//!   before (`LayeredDisk::create`: open the layer, read and check its map);
//!   a fork child does this for every disk layer of its chain;
//! * `disk_write_diff_layer`: freeze 16 written clusters into a diff layer
//!   (data and map, unsynced, as a fork layer is written).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use devices::virtio::block::{DiskBackend, LayerFiles, LayerKind, LayeredDisk};

const DISK: u64 = 16 << 30;

/// A disk over no layers with `clusters` clusters written, spread out.
fn written_disk(dir: &Path, name: &str, clusters: u64) -> Arc<LayeredDisk> {
    let mut d = Arc::new(LayeredDisk::create(Vec::new(), &dir.join(name), DISK).unwrap());
    for i in 0..clusters {
        d.write_at(&[0x5a; 4096], i * (DISK / clusters)).unwrap();
    }
    d
}

fn disk_open_over_layer(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let d = written_disk(dir.path(), "top0", 1024);
    let (data, map) = (dir.path().join("layer.data"), dir.path().join("layer.map"));
    d.write_layer(&data, &map, LayerKind::Full).unwrap();
    let top = dir.path().join("top");
    c.bench_function("disk_open_over_layer", |b| {
        b.iter(|| {
            // The top is unlinked as soon as it is made: the path is free again.
            let layers = vec![LayerFiles::mapped(&data, &map)];
            LayeredDisk::create(layers, &top, DISK).unwrap()
        })
    });
}

fn disk_write_diff_layer(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let mut d = written_disk(dir.path(), "top0", 16);
    let (data, map) = (dir.path().join("diff.data"), dir.path().join("diff.map"));
    c.bench_function("disk_write_diff_layer", |b| {
        b.iter(|| {
            for i in 0..16 {
                d.write_at(&[0xa5; 4096], i * (DISK / 16)).unwrap();
            }
            let s = d
                .write_layer_unsynced(&data, &map, LayerKind::Diff)
                .unwrap();
            assert_eq!(s.clusters, 16);
            d.mark_clean();
            std::fs::remove_file(&data).unwrap();
            std::fs::remove_file(&map).unwrap();
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(50).measurement_time(Duration::from_secs(5));
    targets = disk_open_over_layer, disk_write_diff_layer
}
criterion_main!(benches);
