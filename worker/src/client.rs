//! A blocking client of a worker's control socket.

use std::io::{BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::protocol::{
    encode, read_frame, Description, ErrorCode, ForkLayerInfo, FrameError, Metrics, Request,
    Response, RestoreSpec, WorkerError,
};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("Cannot connect to worker socket {0}")]
    Connect(PathBuf, #[source] std::io::Error),
    #[error("No worker answered on {0} within {1:?}")]
    NotListening(PathBuf, Duration),
    #[error("Worker connection")]
    Frame(#[from] FrameError),
    #[error("The worker closed the connection without answering")]
    Closed,
    #[error(transparent)]
    Worker(#[from] WorkerError),
    #[error("The worker answered {0} with an unexpected {1}")]
    Unexpected(&'static str, &'static str),
}

impl ClientError {
    /// The worker's error code, if the worker answered with one.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Self::Worker(e) => Some(e.code),
            _ => None,
        }
    }
}

pub struct Client {
    path: PathBuf,
    r: BufReader<UnixStream>,
    w: UnixStream,
}

fn kind(r: &Response) -> &'static str {
    match r {
        Response::Ok => "ok",
        Response::Description(_) => "description",
        Response::ForkLayer(_) => "fork layer",
        Response::Metrics(_) => "metrics",
        Response::Mailbox { .. } => "mailbox reply",
        Response::Error(_) => "error",
        Response::Vcpus(_) => "vcpu reports",
    }
}

impl Client {
    pub fn connect(path: &Path) -> Result<Client, ClientError> {
        let s = UnixStream::connect(path).map_err(|e| ClientError::Connect(path.to_owned(), e))?;
        let w = s
            .try_clone()
            .map_err(|e| ClientError::Connect(path.to_owned(), e))?;
        Ok(Client {
            path: path.to_owned(),
            r: BufReader::new(s),
            w,
        })
    }

    /// Connects once the worker listens: a worker just spawned binds its
    /// socket within milliseconds. Gives up after `timeout`. Tries again
    /// every 2 ms at most: a failed connect costs microseconds, and a
    /// longer wait is latency added to every cold boot (20 ms steps cost a
    /// lab boot 10 ms on average).
    pub fn connect_wait(path: &Path, timeout: Duration) -> Result<Client, ClientError> {
        let t = Instant::now();
        let mut pause = Duration::from_micros(200);
        loop {
            match Self::connect(path) {
                Ok(c) => return Ok(c),
                Err(_) if t.elapsed() < timeout => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(2));
                }
                Err(_) => return Err(ClientError::NotListening(path.to_owned(), timeout)),
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Sends `req` and waits for its answer; a worker error is `Err`.
    pub fn call(&mut self, req: &Request) -> Result<Response, ClientError> {
        self.w.write_all(&encode(req)?).map_err(FrameError::Io)?;
        match read_frame::<Response>(&mut self.r)? {
            None => Err(ClientError::Closed),
            Some(Response::Error(e)) => Err(e.into()),
            Some(r) => Ok(r),
        }
    }

    fn expect_ok(&mut self, req: &Request) -> Result<(), ClientError> {
        match self.call(req)? {
            Response::Ok => Ok(()),
            other => Err(ClientError::Unexpected(req.name(), kind(&other))),
        }
    }

    pub fn describe(&mut self) -> Result<Description, ClientError> {
        match self.call(&Request::Describe)? {
            Response::Description(d) => Ok(*d),
            other => Err(ClientError::Unexpected("describe", kind(&other))),
        }
    }

    pub fn pause(&mut self) -> Result<(), ClientError> {
        self.expect_ok(&Request::Pause)
    }

    pub fn resume(&mut self) -> Result<(), ClientError> {
        self.expect_ok(&Request::Resume)
    }

    pub fn stop(&mut self) -> Result<(), ClientError> {
        self.expect_ok(&Request::Stop)
    }

    pub fn snapshot(&mut self, dir: &Path, diff: bool) -> Result<(), ClientError> {
        self.expect_ok(&Request::Snapshot {
            dir: dir.to_owned(),
            diff,
        })
    }

    pub fn restore(&mut self, spec: RestoreSpec) -> Result<(), ClientError> {
        self.expect_ok(&Request::Restore(spec))
    }

    pub fn write_fork_layer(&mut self, scratch_dir: &Path) -> Result<ForkLayerInfo, ClientError> {
        match self.call(&Request::WriteForkLayer {
            scratch_dir: scratch_dir.to_owned(),
        })? {
            Response::ForkLayer(l) => Ok(l),
            other => Err(ClientError::Unexpected("write_fork_layer", kind(&other))),
        }
    }

    pub fn restore_fork_layer(&mut self, spec: RestoreSpec) -> Result<(), ClientError> {
        self.expect_ok(&Request::RestoreForkLayer(spec))
    }

    pub fn metrics(&mut self) -> Result<Metrics, ClientError> {
        match self.call(&Request::Metrics)? {
            Response::Metrics(m) => Ok(m),
            other => Err(ClientError::Unexpected("metrics", kind(&other))),
        }
    }

    /// Every vCPU's counters and registers (see [`vmm::inspect`]).
    pub fn vcpus(&mut self) -> Result<Vec<vmm::VcpuReport>, ClientError> {
        match self.call(&Request::Vcpus)? {
            Response::Vcpus(v) => Ok(v),
            other => Err(ClientError::Unexpected("vcpus", kind(&other))),
        }
    }

    /// One test-guest mailbox call: `(status, rets)`.
    pub fn mailbox(
        &mut self,
        cpu: u8,
        cmd: u32,
        args: [u64; 4],
        timeout: Duration,
    ) -> Result<(u32, [u64; 4]), ClientError> {
        let timeout_ms = timeout.as_millis().min(u128::from(u32::MAX)) as u32;
        match self.call(&Request::Mailbox {
            cpu,
            cmd,
            args,
            timeout_ms,
        })? {
            Response::Mailbox { status, rets } => Ok((status, rets)),
            other => Err(ClientError::Unexpected("mailbox", kind(&other))),
        }
    }
}
