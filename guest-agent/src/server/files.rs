//! File requests: each runs its blocking system calls on tokio's blocking threads and
//! moves data in chunks of at most [`MAX_CHUNK`] bytes.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncWrite, WriteHalf};
use tokio::sync::mpsc;

use super::{Config, Reader};
use crate::files::{self, FsError, Root};
use crate::protocol::{
    self, Bytes, Done, Entries, ErrorCode, ErrorMsg, List, Message, Mkdir, ReadData, ReadEnd,
    Remove, Rename, Stat, StatResult, Write, Written, MAX_CHUNK,
};
use crate::wire::{write_frame, WireError};

/// Entries per `Entries` frame: even with 255-byte non-UTF-8 names, far below the
/// payload limit.
pub const LIST_BATCH: usize = 256;
const DEFAULT_FILE_PERM: u32 = 0o644;
const DEFAULT_DIR_PERM: u32 = 0o755;

fn error(e: &FsError) -> Message {
    ErrorMsg::new(e.code(), e.to_string()).into()
}

/// Opens the root and checks `path`; the relative path to resolve beneath it.
fn open(cfg: &Config, path: &str) -> Result<(Root, PathBuf), FsError> {
    let rel = files::parse_path(&cfg.root, path)?;
    Ok((Root::open(&cfg.root, cfg.resolver)?, rel))
}

/// Runs `f` on a blocking thread.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, FsError> + Send + 'static,
) -> Result<T, FsError> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| {
        Err(FsError::Io {
            op: "run",
            path: String::new(),
            source: std::io::Error::other(e.to_string()),
        })
    })
}

/// Answers `Done`, or the error.
async fn answer_done<W: AsyncWrite + Unpin>(
    w: &mut W,
    id: u64,
    r: Result<(), FsError>,
) -> Result<(), WireError> {
    let msg = match r {
        Ok(()) => Done {}.into(),
        Err(e) => error(&e),
    };
    write_frame(w, id, &msg).await
}

pub(super) async fn stat<W: AsyncWrite + Unpin>(
    cfg: &Config,
    w: &mut W,
    id: u64,
    req: Stat,
) -> Result<(), WireError> {
    let cfg = cfg.clone();
    let r = blocking(move || {
        let (root, rel) = open(&cfg, &req.path)?;
        files::stat(&root, &rel, &req.path)
    })
    .await;
    let msg = match r {
        Ok(info) => StatResult { info }.into(),
        Err(e) => error(&e),
    };
    write_frame(w, id, &msg).await
}

pub(super) async fn list<W: AsyncWrite + Unpin>(
    cfg: &Config,
    w: &mut W,
    id: u64,
    req: List,
) -> Result<(), WireError> {
    let cfg = cfg.clone();
    let (tx, mut rx) = mpsc::channel(2);
    let lister = tokio::task::spawn_blocking(move || {
        let (root, rel) = open(&cfg, &req.path)?;
        files::list(&root, &rel, &req.path, LIST_BATCH, |batch| {
            tx.blocking_send(batch).is_ok()
        })
    });
    while let Some(entries) = rx.recv().await {
        if entries.is_empty() {
            continue;
        }
        let msg = Entries {
            entries,
            more: true,
        };
        write_frame(w, id, &msg.into()).await?;
    }
    let msg = match lister.await {
        Ok(Ok(())) => Entries::default().into(),
        Ok(Err(e)) => error(&e),
        Err(e) => ErrorMsg::new(ErrorCode::Internal, e.to_string()).into(),
    };
    write_frame(w, id, &msg).await
}

pub(super) async fn read<W: AsyncWrite + Unpin>(
    cfg: &Config,
    w: &mut W,
    id: u64,
    req: protocol::Read,
) -> Result<(), WireError> {
    let c = cfg.clone();
    let path = req.path.clone();
    let file = match blocking(move || {
        let (root, rel) = open(&c, &path)?;
        files::open_read(&root, &rel, &path)
    })
    .await
    {
        Ok((f, _size)) => Arc::new(f),
        Err(e) => return write_frame(w, id, &error(&e)).await,
    };
    let mut offset = req.offset;
    let mut left = req.len.unwrap_or(u64::MAX);
    let mut sent = 0u64;
    let mut eof = false;
    while left > 0 {
        let want = left.min(MAX_CHUNK as u64) as usize;
        let f = file.clone();
        let at = offset;
        let chunk = blocking(move || {
            let mut buf = vec![0u8; want];
            let n = f.read_at(&mut buf, at).map_err(|source| FsError::Io {
                op: "read",
                path: String::new(),
                source,
            })?;
            buf.truncate(n);
            Ok(buf)
        })
        .await;
        let data = match chunk {
            Ok(d) => d,
            Err(e) => {
                let msg = ErrorMsg::new(e.code(), format!("Cannot read {:?}: {e}", req.path));
                return write_frame(w, id, &msg.into()).await;
            }
        };
        if data.is_empty() {
            eof = true;
            break;
        }
        let n = data.len() as u64;
        write_frame(
            w,
            id,
            &ReadData {
                data: Bytes::from(data),
            }
            .into(),
        )
        .await?;
        offset += n;
        sent += n;
        left -= n;
    }
    write_frame(w, id, &ReadEnd { bytes: sent, eof }.into()).await
}

pub(super) async fn write<S>(
    cfg: &Config,
    reader: &Reader<S>,
    w: &mut WriteHalf<S>,
    id: u64,
    req: Write,
) -> Result<(), WireError>
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let c = cfg.clone();
    let path = req.path.clone();
    let opened = blocking(move || {
        let (root, rel) = open(&c, &path)?;
        let perm = req.perm.unwrap_or(DEFAULT_FILE_PERM);
        files::open_write(&root, &rel, &path, req.mode, perm)
    })
    .await;
    let file: Arc<File> = match opened {
        Ok(f) => Arc::new(f),
        Err(e) => return write_frame(w, id, &error(&e)).await,
    };
    write_frame(w, id, &Done {}.into()).await?;

    // Take the data; after a failure, keep reading (and dropping) it up to WriteEnd so
    // that the connection stays in step, then report the failure.
    let mut reader = reader.lock().await;
    let mut written = 0u64;
    let mut failed: Option<FsError> = None;
    loop {
        let frame = reader.next().await?.ok_or(WireError::Truncated)?;
        match frame.msg {
            Message::WriteData(d) if frame.request_id == id => {
                if failed.is_some() {
                    continue;
                }
                let f = file.clone();
                let at = written;
                let len = d.data.len() as u64;
                let r = blocking(move || {
                    // O_APPEND ignores the offset; otherwise the data follows on.
                    f.write_all_at(&d.data, at).map_err(|source| FsError::Io {
                        op: "write",
                        path: String::new(),
                        source,
                    })
                })
                .await;
                match r {
                    Ok(()) => written += len,
                    Err(e) => failed = Some(e),
                }
            }
            Message::WriteEnd(_) if frame.request_id == id => break,
            other => {
                let why = format!("{} arrived during a write", other.name());
                let _ = write_frame(w, id, &ErrorMsg::new(ErrorCode::BadRequest, why).into()).await;
                return Err(WireError::Io(std::io::ErrorKind::InvalidData.into()));
            }
        }
    }
    drop(reader);
    let msg = match failed {
        None => Written { bytes: written }.into(),
        Some(e) => ErrorMsg::new(e.code(), format!("Cannot write {:?}: {e}", req.path)).into(),
    };
    write_frame(w, id, &msg).await
}

pub(super) async fn mkdir<W: AsyncWrite + Unpin>(
    cfg: &Config,
    w: &mut W,
    id: u64,
    req: Mkdir,
) -> Result<(), WireError> {
    let cfg = cfg.clone();
    let r = blocking(move || {
        let (root, rel) = open(&cfg, &req.path)?;
        let perm = req.perm.unwrap_or(DEFAULT_DIR_PERM);
        files::mkdir(&root, &rel, &req.path, req.parents, perm)
    })
    .await;
    answer_done(w, id, r).await
}

pub(super) async fn remove<W: AsyncWrite + Unpin>(
    cfg: &Config,
    w: &mut W,
    id: u64,
    req: Remove,
) -> Result<(), WireError> {
    let cfg = cfg.clone();
    let r = blocking(move || {
        let (root, rel) = open(&cfg, &req.path)?;
        files::remove(&root, &rel, &req.path, req.recursive)
    })
    .await;
    answer_done(w, id, r).await
}

pub(super) async fn rename<W: AsyncWrite + Unpin>(
    cfg: &Config,
    w: &mut W,
    id: u64,
    req: Rename,
) -> Result<(), WireError> {
    let cfg = cfg.clone();
    let r = blocking(move || {
        let (root, from) = open(&cfg, &req.from)?;
        let to = files::parse_path(&cfg.root, &req.to)?;
        files::rename(&root, (&from, &req.from), (&to, &req.to))
    })
    .await;
    answer_done(w, id, r).await
}
