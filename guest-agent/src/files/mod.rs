//! File operations confined beneath a root directory (`/workspace` in a VM).
//!
//! A request path is either relative to the root or absolute under it. It is refused if
//! it holds a NUL byte, is longer than [`MAX_PATH`](crate::protocol::MAX_PATH) bytes, is
//! absolute outside the root, or `..` climbs above the root. That lexical check only
//! gives an early, clear error: the real confinement is the kernel's. Every path is
//! resolved from a descriptor of the root with `openat2(RESOLVE_BENEATH |
//! RESOLVE_NO_MAGICLINKS)`, so `..` and symlinks are followed only while they stay
//! beneath the root (absolute symlinks are refused), and a symlink swapped in after any
//! check is caught by the same resolution that opens the file. Where `openat2` is missing
//! (Linux before 5.6) the same rules are applied by a component-by-component walk that
//! opens each component with `O_NOFOLLOW` relative to the previous one ([`resolve`]).
//!
//! Operations that act on a name (stat, mkdir, remove, rename) resolve its parent that
//! way and then use the `*at` system call on the last component, which never follows a
//! symlink there. A recursive remove walks with `O_NOFOLLOW` descriptors and unlinks
//! symlinks without following them.
//!
//! Hard links: `RESOLVE_BENEATH` confines names, not inodes, and a hard link inside the
//! root may name an inode whose other name is outside it (in a VM `/workspace` is a
//! mount of its own, which `link(2)` cannot cross, but an agent run as a host process
//! on a plain directory has no such wall). So reads and writes refuse a regular file
//! with more than one link ([`FsError::HardLinked`], `PermissionDenied` on the wire),
//! checked on the opened descriptor before a byte is read, written or truncated.

mod ops;
mod resolve;

use std::io;

use rustix::io::Errno;

pub use ops::{file_info, list, mkdir, open_read, open_write, remove, rename, stat};
pub use resolve::{parse_path, Resolver, Root};

use crate::protocol::ErrorCode;

#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("Path {path:?} is invalid: {why}")]
    InvalidPath { path: String, why: &'static str },
    #[error("Path {0:?} escapes the files root")]
    Escape(String),
    #[error("Path {0:?} does not exist")]
    NotFound(String),
    #[error("Path {0:?} already exists")]
    AlreadyExists(String),
    #[error("A component of {0:?} is not a directory")]
    NotADirectory(String),
    #[error("Path {0:?} is a directory")]
    IsADirectory(String),
    #[error("Path {0:?} is not a regular file")]
    NotAFile(String),
    #[error("Directory {0:?} is not empty")]
    NotEmpty(String),
    #[error("Permission denied on {0:?}")]
    PermissionDenied(String),
    #[error("Too many levels of symbolic links in {0:?}")]
    Loop(String),
    #[error("Path {0:?} has {1} hard links: refused, another may be outside the files root")]
    HardLinked(String, u64),
    #[error("Directory tree under {0:?} is too deep to remove")]
    TooDeep(String),
    #[error("Files root {0:?} cannot be opened")]
    Root(String, #[source] io::Error),
    #[error("Cannot {op} {path:?}")]
    Io {
        op: &'static str,
        path: String,
        #[source]
        source: io::Error,
    },
}

impl FsError {
    /// The protocol error code for this failure.
    pub fn code(&self) -> ErrorCode {
        match self {
            FsError::InvalidPath { .. } => ErrorCode::InvalidPath,
            FsError::Escape(_) => ErrorCode::PathEscape,
            FsError::NotFound(_) => ErrorCode::NotFound,
            FsError::AlreadyExists(_) => ErrorCode::AlreadyExists,
            FsError::NotADirectory(_) => ErrorCode::NotADirectory,
            FsError::IsADirectory(_) => ErrorCode::IsADirectory,
            FsError::NotAFile(_) => ErrorCode::BadRequest,
            FsError::NotEmpty(_) => ErrorCode::NotEmpty,
            FsError::PermissionDenied(_) | FsError::HardLinked(..) => ErrorCode::PermissionDenied,
            FsError::Loop(_) => ErrorCode::InvalidPath,
            FsError::TooDeep(_) => ErrorCode::TooLarge,
            FsError::Root(..) | FsError::Io { .. } => ErrorCode::Io,
        }
    }

    /// Classifies `errno` from operation `op` on `path`. `EXDEV` from a path resolution
    /// means the path left the root.
    pub(crate) fn from_errno(op: &'static str, path: &str, errno: Errno) -> FsError {
        let p = path.to_owned();
        match errno {
            Errno::NOENT => FsError::NotFound(p),
            Errno::EXIST => FsError::AlreadyExists(p),
            Errno::NOTDIR => FsError::NotADirectory(p),
            Errno::ISDIR => FsError::IsADirectory(p),
            Errno::NOTEMPTY => FsError::NotEmpty(p),
            Errno::ACCESS | Errno::PERM => FsError::PermissionDenied(p),
            Errno::XDEV if op == "resolve" => FsError::Escape(p),
            Errno::LOOP => FsError::Loop(p),
            e => FsError::Io {
                op,
                path: p,
                source: e.into(),
            },
        }
    }
}
