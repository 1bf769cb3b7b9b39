//! The images a sandbox can be made from: the built root images in Sprout's
//! cache (`<cache>/images/NAME.ext4`, guest/build-images.sh; `scratch` is the
//! writable-disk template, not an image), and `testguest`, Sprout's own test
//! guest (no agent: no exec), which runs on any KVM host.

use std::path::Path;

use super::registry::{Image, Runtime};

/// The image name of Sprout's test guest.
pub const TEST_GUEST_IMAGE: &str = "testguest";
/// The writable-disk template beside the images.
const TEMPLATE: &str = "scratch";

/// Every image found now, by name.
pub fn scan() -> Vec<Image> {
    let mut out = scan_dir(&crate::linux::cache_dir().join("images"));
    let tg = Path::new(testguest_build::TESTGUEST_PATH);
    if let Ok(m) = std::fs::metadata(tg) {
        out.push(Image {
            name: TEST_GUEST_IMAGE.into(),
            path: tg.to_owned(),
            size_bytes: m.len(),
            runtimes: vec![Runtime::Container],
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

fn scan_dir(dir: &Path) -> Vec<Image> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in rd.flatten() {
        let path = e.path();
        let Some(name) = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".ext4"))
        else {
            continue;
        };
        if name == TEMPLATE || name == TEST_GUEST_IMAGE || name.is_empty() {
            continue;
        }
        // Links are followed (the cache links images/NAME.ext4 to a build).
        let Ok(m) = std::fs::metadata(&path) else {
            continue;
        };
        if m.is_file() && crate::linux::check_ext4(&path).is_ok() {
            out.push(Image {
                name: name.to_owned(),
                path,
                size_bytes: m.len(),
                // Sprout's own images have no init of their own.
                runtimes: vec![Runtime::Container],
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_ext4_images_are_found_and_the_template_is_not_one() {
        let dir = tempfile::tempdir().unwrap();
        let mut ext4 = vec![0u8; 4096];
        ext4[1080..1082].copy_from_slice(&0xef53u16.to_le_bytes());
        for n in ["default.ext4", "scratch.ext4", "mine.ext4"] {
            std::fs::write(dir.path().join(n), &ext4).unwrap();
        }
        std::fs::write(dir.path().join("junk.ext4"), b"not ext4").unwrap();
        std::fs::write(dir.path().join("notes.txt"), &ext4).unwrap();
        let mut names: Vec<String> = scan_dir(dir.path()).into_iter().map(|i| i.name).collect();
        names.sort();
        assert_eq!(names, ["default", "mine"]);
        assert!(scan_dir(&dir.path().join("missing")).is_empty());
    }
}
