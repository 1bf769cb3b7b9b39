//! What an `image` string names: one of Sprout's built images (`default`,
//! `test`, a bare name), a registry reference (`host[:port]/name:tag`,
//! `name@sha256:…`), or a local OCI image layout (`oci:/path[:tag]`).

use std::path::PathBuf;

/// Where an OCI image comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// A registry: the parsed reference (Docker Hub when the name has no
    /// registry part, as `docker pull` reads it).
    Registry(oci_client::Reference),
    /// An OCI image layout directory, and the tag (the
    /// `org.opencontainers.image.ref.name` annotation) to take from it;
    /// `None`: the layout must hold exactly one image.
    Layout { dir: PathBuf, tag: Option<String> },
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReferenceError {
    #[error("Image reference is empty")]
    Empty,
    #[error("Image reference {0:?} is too long (at most 1024 bytes)")]
    TooLong(String),
    #[error("Image reference {0:?} has whitespace or control characters")]
    BadCharacters(String),
    #[error("{0:?} is not a valid OCI image reference: {1}")]
    Invalid(String, String),
    #[error("OCI layout reference {0:?} needs an absolute path (oci:/path[:tag])")]
    RelativeLayout(String),
}

/// Whether `image` (an `--image` or `image` value) names an OCI image rather
/// than a built image or a file: `oci:/layout[:tag]`, or a registry
/// reference. A built image's name has no `/`, `:` or `@`, and a file's path
/// starts with `/` or `.`, which no registry reference does.
pub fn is_oci(image: &str) -> bool {
    image.starts_with("oci:")
        || (image.contains(['/', ':', '@']) && !image.starts_with('/') && !image.starts_with('.'))
}

/// Parses an OCI image reference (see [`is_oci`]).
pub fn parse(image: &str) -> Result<Source, ReferenceError> {
    if image.is_empty() {
        return Err(ReferenceError::Empty);
    }
    if image.len() > 1024 {
        return Err(ReferenceError::TooLong(format!("{}…", &image[..64])));
    }
    if image.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(ReferenceError::BadCharacters(image.into()));
    }
    if let Some(rest) = image.strip_prefix("oci:") {
        if !rest.starts_with('/') {
            return Err(ReferenceError::RelativeLayout(image.into()));
        }
        // The tag is what follows the last ':' after the last '/'.
        let slash = rest.rfind('/').unwrap_or(0);
        let (dir, tag) = match rest[slash..].rfind(':') {
            Some(i) => (&rest[..slash + i], Some(&rest[slash + i + 1..])),
            None => (rest, None),
        };
        if tag == Some("") {
            return Err(ReferenceError::Invalid(image.into(), "empty tag".into()));
        }
        return Ok(Source::Layout {
            dir: PathBuf::from(dir),
            tag: tag.map(str::to_owned),
        });
    }
    let r: oci_client::Reference = image.parse().map_err(|e: oci_client::ParseError| {
        ReferenceError::Invalid(image.into(), e.to_string())
    })?;
    Ok(Source::Registry(r))
}

/// Whether a registry host is this machine (spoken to over plain HTTP; every
/// other registry over HTTPS).
pub fn is_loopback_registry(registry: &str) -> bool {
    let host = match registry.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => registry.rsplit_once(':').map_or(registry, |(h, _)| h),
    };
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|a| a.is_loopback())
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Registry(r) => write!(f, "{}", r.whole()),
            Source::Layout { dir, tag: Some(t) } => write!(f, "oci:{}:{t}", dir.display()),
            Source::Layout { dir, tag: None } => write!(f, "oci:{}", dir.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_image_names_are_not_oci_references() {
        for n in [
            "default",
            "test",
            "my-image_2",
            "/srv/img.ext4",
            "./img.ext4",
        ] {
            assert!(!is_oci(n), "{n}");
        }
        for r in [
            "127.0.0.1:5000/a:1",
            "debian:bookworm",
            "a@sha256:00",
            "oci:/x",
        ] {
            assert!(is_oci(r), "{r}");
        }
    }

    #[test]
    fn registry_references_parse_with_their_parts() {
        let Source::Registry(r) = parse("127.0.0.1:5000/team/py:3.12").unwrap() else {
            panic!()
        };
        assert_eq!(r.registry(), "127.0.0.1:5000");
        assert_eq!(r.repository(), "team/py");
        assert_eq!(r.tag(), Some("3.12"));
        let d = format!("sha256:{}", "a".repeat(64));
        let Source::Registry(r) = parse(&format!("localhost:5000/x@{d}")).unwrap() else {
            panic!()
        };
        assert_eq!(r.digest(), Some(d.as_str()));
    }

    #[test]
    fn bad_references_are_refused_with_the_reason() {
        assert_eq!(parse(""), Err(ReferenceError::Empty));
        assert!(matches!(
            parse("127.0.0.1:5000/UPPER:1"),
            Err(ReferenceError::Invalid(..))
        ));
        assert!(matches!(
            parse("127.0.0.1:5000/x@sha256:short"),
            Err(ReferenceError::Invalid(..))
        ));
        assert!(matches!(
            parse("a b:1"),
            Err(ReferenceError::BadCharacters(_))
        ));
        assert!(matches!(
            parse("oci:relative/dir"),
            Err(ReferenceError::RelativeLayout(_))
        ));
        assert!(matches!(parse("oci:/x:"), Err(ReferenceError::Invalid(..))));
        assert!(matches!(
            parse(&format!("x/{}", "a".repeat(2000))),
            Err(ReferenceError::TooLong(_))
        ));
    }

    #[test]
    fn layouts_take_a_tag_after_the_last_path_part() {
        assert_eq!(
            parse("oci:/srv/img:v1").unwrap(),
            Source::Layout {
                dir: "/srv/img".into(),
                tag: Some("v1".into())
            }
        );
        assert_eq!(
            parse("oci:/srv/a:b/img").unwrap(),
            Source::Layout {
                dir: "/srv/a:b/img".into(),
                tag: None
            }
        );
    }

    #[test]
    fn only_loopback_registries_are_loopback() {
        for r in [
            "127.0.0.1:5000",
            "localhost:80",
            "[::1]:5000",
            "localhost",
            "127.1.2.3",
        ] {
            assert!(is_loopback_registry(r), "{r}");
        }
        for r in [
            "docker.io",
            "10.0.0.1:5000",
            "example.com:443",
            "[2001:db8::1]:5000",
        ] {
            assert!(!is_loopback_registry(r), "{r}");
        }
    }
}
