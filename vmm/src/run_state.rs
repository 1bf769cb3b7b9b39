//! The VM-level run state and its transitions, and the group operations on
//! vCPUs that move a VM between them.
//!
//! ```text
//!   Created --resume--> Running --pause--> Paused --resume--> Running
//!      any state --guest or host ends it--> Exited(reason)
//!      any state --the VMM cannot bring the vCPUs into one state--> Failed(reason)
//! ```
//!
//! `Created` is a VM whose vCPU threads are parked before their first
//! instruction (after [`crate::Vm::create`] or a paused restore). `Exited` and
//! `Failed` are final: only stopping (or dropping) the VM is left.
//!
//! A pause is all-or-nothing: every vCPU is asked to park before any answer is
//! awaited, and if one does not park, the ones that did run again and the VM
//! stays `Running`.

use crate::vcpu::{ExitReason, VcpuError};

/// Where a VM is in its life.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VmRunState {
    /// Built, vCPUs parked before their first instruction.
    Created,
    Running,
    /// Every vCPU parked by [`crate::Vm::pause`].
    Paused,
    /// The guest or the host ended the VM.
    Exited(ExitReason),
    /// The VMM could not bring every vCPU into one state (a vCPU did not answer
    /// a resume, or a failed pause could not be undone); the reason describes it.
    Failed(String),
}

impl VmRunState {
    /// Whether the state is final.
    pub fn is_final(&self) -> bool {
        matches!(self, Self::Exited(_) | Self::Failed(_))
    }

    /// Where `op` takes a VM in this state, or why it cannot run.
    pub(crate) fn after(&self, op: VmOp) -> Result<VmRunState, InvalidState> {
        use VmRunState::*;
        let next = match (op, self) {
            (VmOp::Resume, Created | Paused) => Running,
            (VmOp::Pause, Running) => Paused,
            (VmOp::Snapshot | VmOp::Fork, Created | Running | Paused) => self.clone(),
            _ => {
                return Err(InvalidState {
                    op: op.name(),
                    state: self.clone(),
                })
            }
        };
        Ok(next)
    }
}

impl std::fmt::Display for VmRunState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Created => write!(f, "the VM has not started"),
            Self::Running => write!(f, "the VM is running"),
            Self::Paused => write!(f, "the VM is paused"),
            Self::Exited(r) => write!(f, "the VM has exited ({r})"),
            Self::Failed(why) => write!(f, "the VM has failed ({why})"),
        }
    }
}

/// The operations the run state checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum VmOp {
    Resume,
    Pause,
    Snapshot,
    Fork,
}

impl VmOp {
    fn name(self) -> &'static str {
        match self {
            Self::Resume => "resume",
            Self::Pause => "pause",
            Self::Snapshot => "snapshot",
            Self::Fork => "fork",
        }
    }
}

/// An operation asked of a VM in a state that does not allow it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("Cannot {op}: {state}")]
pub struct InvalidState {
    pub op: &'static str,
    pub state: VmRunState,
}

/// What a vCPU is asked to do by a group operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Want {
    Run,
    Park,
}

/// What the group operations need of a vCPU: send a request, then wait for its
/// answer. A trait, so that the all-or-nothing rules are tested without KVM.
pub(crate) trait VcpuControl {
    /// Sends the request and kicks the vCPU; returns the request's number.
    fn request(&mut self, want: Want) -> Result<u64, VcpuError>;
    /// Waits for the answer to request `seq`.
    fn wait(&mut self, seq: u64) -> Result<(), VcpuError>;
}

/// A pause that did not take.
#[derive(Debug)]
pub(crate) struct PauseFailed {
    /// Why the first vCPU that failed did.
    pub error: VcpuError,
    /// Every vCPU that parked runs again: the VM is still running.
    pub undone: bool,
}

/// Parks every vCPU or none: requests go out to all before any answer is
/// awaited; if one vCPU fails, the others are resumed.
pub(crate) fn pause_all<V: VcpuControl>(vcpus: &mut [V]) -> Result<(), PauseFailed> {
    let mut first: Option<VcpuError> = None;
    let sent: Vec<Option<u64>> = vcpus
        .iter_mut()
        .map(|v| {
            v.request(Want::Park)
                .map_err(|e| first.get_or_insert(e))
                .ok()
        })
        .collect();
    let mut parked = vec![false; vcpus.len()];
    for (i, v) in vcpus.iter_mut().enumerate() {
        if let Some(seq) = sent[i] {
            match v.wait(seq) {
                Ok(()) => parked[i] = true,
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
    }
    let Some(error) = first else {
        return Ok(());
    };
    // Undo. A vCPU that got the pause but did not answer may still park:
    // a run request queued behind it brings it back too.
    let mut undone = true;
    for (i, v) in vcpus.iter_mut().enumerate() {
        if sent[i].is_none() {
            continue;
        }
        match v.request(Want::Run) {
            Ok(seq) if parked[i] => undone &= v.wait(seq).is_ok(),
            Ok(_) => {}
            Err(_) => undone &= !parked[i],
        }
    }
    Err(PauseFailed { error, undone })
}

/// Runs every vCPU; the first failure is returned (after every vCPU was asked).
pub(crate) fn resume_all<V: VcpuControl>(vcpus: &mut [V]) -> Result<(), VcpuError> {
    let mut first: Option<VcpuError> = None;
    let sent: Vec<Option<u64>> = vcpus
        .iter_mut()
        .map(|v| {
            v.request(Want::Run)
                .map_err(|e| first.get_or_insert(e))
                .ok()
        })
        .collect();
    for (v, seq) in vcpus.iter_mut().zip(sent) {
        if let Some(seq) = seq {
            if let Err(e) = v.wait(seq) {
                first.get_or_insert(e);
            }
        }
    }
    first.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use VmRunState::*;

    #[test]
    fn transition_table() {
        let exited = Exited(ExitReason::Reset);
        let failed = Failed("vCPU 0 thread is gone".into());
        let all = [Created, Running, Paused, exited.clone(), failed.clone()];
        let expect = |op, from: &VmRunState| -> Option<VmRunState> {
            match (op, from) {
                (VmOp::Resume, Created | Paused) => Some(Running),
                (VmOp::Pause, Running) => Some(Paused),
                (VmOp::Snapshot | VmOp::Fork, Created | Running | Paused) => Some(from.clone()),
                _ => None,
            }
        };
        for op in [VmOp::Resume, VmOp::Pause, VmOp::Snapshot, VmOp::Fork] {
            for from in &all {
                match (from.after(op), expect(op, from)) {
                    (Ok(got), Some(want)) => assert_eq!(got, want, "{op:?} from {from:?}"),
                    (Err(e), None) => {
                        assert_eq!(e.state, *from);
                        assert_eq!(e.op, op.name());
                    }
                    (got, want) => panic!("{op:?} from {from:?}: got {got:?}, want {want:?}"),
                }
            }
        }
        assert!(exited.is_final() && failed.is_final());
        assert!(!Created.is_final() && !Running.is_final() && !Paused.is_final());
    }

    #[test]
    fn invalid_state_messages() {
        let e = Paused.after(VmOp::Pause).unwrap_err();
        assert_eq!(e.to_string(), "Cannot pause: the VM is paused");
        let e = Running.after(VmOp::Resume).unwrap_err();
        assert_eq!(e.to_string(), "Cannot resume: the VM is running");
        let e = Exited(ExitReason::PowerOff)
            .after(VmOp::Snapshot)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "Cannot snapshot: the VM has exited (guest powered off)"
        );
        let e = Created.after(VmOp::Pause).unwrap_err();
        assert_eq!(e.to_string(), "Cannot pause: the VM has not started");
    }

    /// A vCPU that answers (or fails) as told, and remembers what it was asked.
    #[derive(Default)]
    struct Fake {
        index: u8,
        /// Requests fail: the thread is gone.
        gone: bool,
        /// Park requests are never answered.
        stuck: bool,
        log: Vec<Want>,
        pending: Vec<(u64, Want)>,
        running: bool,
    }

    impl VcpuControl for Fake {
        fn request(&mut self, want: Want) -> Result<u64, VcpuError> {
            if self.gone {
                return Err(VcpuError::Gone(self.index));
            }
            self.log.push(want);
            let seq = self.log.len() as u64;
            self.pending.push((seq, want));
            Ok(seq)
        }

        fn wait(&mut self, seq: u64) -> Result<(), VcpuError> {
            let (_, want) = *self.pending.iter().find(|(n, _)| *n == seq).unwrap();
            if self.stuck && want == Want::Park {
                return Err(VcpuError::Timeout(self.index, Duration::from_secs(5)));
            }
            self.running = want == Want::Run;
            Ok(())
        }
    }

    fn fakes(n: u8) -> Vec<Fake> {
        (0..n)
            .map(|index| Fake {
                index,
                running: true,
                ..Fake::default()
            })
            .collect()
    }

    #[test]
    fn pause_parks_every_vcpu() {
        let mut v = fakes(3);
        pause_all(&mut v).unwrap();
        for f in &v {
            assert_eq!(f.log, [Want::Park]);
            assert!(!f.running);
        }
        resume_all(&mut v).unwrap();
        assert!(v.iter().all(|f| f.running));
    }

    #[test]
    fn a_stuck_vcpu_undoes_the_pause_of_the_others() {
        let mut v = fakes(3);
        v[1].stuck = true;
        let e = pause_all(&mut v).unwrap_err();
        assert!(matches!(e.error, VcpuError::Timeout(1, _)), "{:?}", e.error);
        assert!(e.undone);
        for f in &v {
            // Every vCPU was asked to park, then to run again (the stuck one
            // too, in case it parks late), and the others run.
            assert_eq!(f.log, [Want::Park, Want::Run], "vCPU {}", f.index);
            assert!(f.running, "vCPU {}", f.index);
        }
    }

    #[test]
    fn a_gone_vcpu_fails_the_pause_and_the_rest_run_on() {
        let mut v = fakes(2);
        v[0].gone = true;
        let e = pause_all(&mut v).unwrap_err();
        assert!(matches!(e.error, VcpuError::Gone(0)));
        assert!(e.undone);
        assert!(v[0].log.is_empty());
        assert_eq!(v[1].log, [Want::Park, Want::Run]);
        assert!(v[1].running);
    }

    #[test]
    fn resume_asks_every_vcpu_even_after_a_failure() {
        let mut v = fakes(3);
        pause_all(&mut v).unwrap();
        v[0].gone = true;
        assert!(matches!(resume_all(&mut v), Err(VcpuError::Gone(0))));
        assert!(v[1].running && v[2].running);
    }
}
