//! The bounded ring of a background process's events.
//!
//! Every event (an output chunk, and finally the exit) gets the next sequence number,
//! starting at 1. The ring keeps the newest events within a byte bound (each costs its
//! data plus [`EVENT_OVERHEAD`]); past it the oldest are dropped, never the newest, and
//! a reader that asks for a dropped event is told so ([`Batch::gap`]), never silently
//! skipped ahead.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::protocol::{Exit, StreamKind};

/// What an event costs against the bound beyond its data: its share of the ring's own
/// bookkeeping, so that a flood of one-byte chunks is bounded too.
pub const EVENT_OVERHEAD: usize = 64;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventKind {
    Output(StreamKind, Arc<[u8]>),
    Exit(Exit),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    pub seq: u64,
    /// Output bytes of every earlier event.
    pub offset: u64,
    pub kind: EventKind,
}

impl Event {
    fn len(&self) -> usize {
        match &self.kind {
            EventKind::Output(_, d) => d.len(),
            EventKind::Exit(_) => 0,
        }
    }

    fn cost(&self) -> usize {
        self.len() + EVENT_OVERHEAD
    }

    /// Output bytes up to and including this event.
    pub fn end_offset(&self) -> u64 {
        self.offset + self.len() as u64
    }
}

/// Events `first_seq..=last_seq` are gone; `bytes` is what they held, if known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Missed {
    pub first_seq: u64,
    pub last_seq: u64,
    pub bytes: Option<u64>,
}

/// What a reader gets from [`Ring::read_after`].
#[derive(Debug, Default)]
pub struct Batch {
    pub gap: Option<Missed>,
    pub events: Vec<Event>,
}

#[derive(Debug)]
pub struct Ring {
    events: VecDeque<Event>,
    cost: usize,
    cap: usize,
    next_seq: u64,
    out_bytes: u64,
    dropped_events: u64,
    dropped_bytes: u64,
    exit: Option<Exit>,
}

impl Ring {
    /// An empty ring holding at most `cap` bytes of events (or the newest one, if that
    /// alone is larger).
    pub fn new(cap: usize) -> Self {
        Self {
            events: VecDeque::new(),
            cost: 0,
            cap,
            next_seq: 1,
            out_bytes: 0,
            dropped_events: 0,
            dropped_bytes: 0,
            exit: None,
        }
    }

    pub fn push_output(&mut self, stream: StreamKind, data: &[u8]) {
        let len = data.len() as u64;
        self.push(EventKind::Output(stream, Arc::from(data)));
        self.out_bytes += len;
    }

    /// The last event; nothing is pushed after it.
    pub fn push_exit(&mut self, exit: Exit) {
        self.exit = Some(exit.clone());
        self.push(EventKind::Exit(exit));
    }

    fn push(&mut self, kind: EventKind) {
        debug_assert!(self.exit.is_none() || matches!(kind, EventKind::Exit(_)));
        let ev = Event {
            seq: self.next_seq,
            offset: self.out_bytes,
            kind,
        };
        self.next_seq += 1;
        self.cost += ev.cost();
        self.events.push_back(ev);
        while self.cost > self.cap && self.events.len() > 1 {
            let old = self.events.pop_front().expect("more than one event");
            self.cost -= old.cost();
            self.dropped_events += 1;
            self.dropped_bytes += old.len() as u64;
        }
    }

    /// Sequence number of the oldest event kept (`next_seq` when there is none).
    pub fn first_seq(&self) -> u64 {
        self.events.front().map_or(self.next_seq, |e| e.seq)
    }

    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    pub fn exit(&self) -> Option<&Exit> {
        self.exit.as_ref()
    }

    pub fn dropped(&self) -> (u64, u64) {
        (self.dropped_events, self.dropped_bytes)
    }

    /// Bytes the kept events cost against the bound.
    #[cfg(test)]
    pub fn cost(&self) -> usize {
        self.cost
    }

    /// Events with a number over `after`, oldest first, up to about `max_bytes` of data
    /// (at least one event if there is any). `known_offset` is the output offset of
    /// event `after + 1` if the reader knows it (0 for a reader from the start), which
    /// lets a gap say how many bytes it lost.
    pub fn read_after(&self, after: u64, known_offset: Option<u64>, max_bytes: usize) -> Batch {
        let first = self.first_seq();
        let gap = (after + 1 < first).then(|| {
            let first_offset = self.events.front().map_or(self.out_bytes, |e| e.offset);
            Missed {
                first_seq: after + 1,
                last_seq: first - 1,
                bytes: known_offset.map(|k| first_offset.saturating_sub(k)),
            }
        });
        // Events are numbered without holes: the one after `after` is at a known index.
        let skip = (after + 1).saturating_sub(first) as usize;
        let mut events = Vec::new();
        let mut bytes = 0;
        for ev in self.events.iter().skip(skip) {
            if !events.is_empty() && bytes + ev.len() > max_bytes {
                break;
            }
            bytes += ev.len();
            events.push(ev.clone());
        }
        Batch { gap, events }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(b: &Batch) -> Vec<u8> {
        b.events
            .iter()
            .filter_map(|e| match &e.kind {
                EventKind::Output(_, d) => Some(d.to_vec()),
                EventKind::Exit(_) => None,
            })
            .flatten()
            .collect()
    }

    #[test]
    fn numbers_from_one_and_replays_after_any_point() {
        let mut r = Ring::new(1 << 20);
        assert_eq!((r.first_seq(), r.next_seq()), (1, 1));
        r.push_output(StreamKind::Stdout, b"ab");
        r.push_output(StreamKind::Stderr, b"c");
        r.push_exit(Exit {
            code: Some(0),
            ..Exit::default()
        });
        let all = r.read_after(0, Some(0), usize::MAX);
        assert!(all.gap.is_none());
        let seqs: Vec<u64> = all.events.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, [1, 2, 3]);
        assert_eq!(data(&all), b"abc");
        assert_eq!(all.events[2].offset, 3);
        let tail = r.read_after(2, None, usize::MAX);
        assert_eq!(tail.events.len(), 1);
        assert!(matches!(tail.events[0].kind, EventKind::Exit(_)));
        assert!(r.read_after(3, None, usize::MAX).events.is_empty());
        assert_eq!(r.exit().unwrap().code, Some(0));
    }

    #[test]
    fn overflow_drops_the_oldest_and_reports_the_gap() {
        let cap = 10 * (100 + EVENT_OVERHEAD);
        let mut r = Ring::new(cap);
        for i in 0..25u8 {
            r.push_output(StreamKind::Stdout, &[i; 100]);
        }
        assert!(r.cost() <= cap);
        assert_eq!(r.first_seq(), 16);
        assert_eq!(r.dropped(), (15, 1500));
        let b = r.read_after(0, Some(0), usize::MAX);
        assert_eq!(
            b.gap,
            Some(Missed {
                first_seq: 1,
                last_seq: 15,
                bytes: Some(1500)
            })
        );
        assert_eq!(b.events.first().unwrap().seq, 16);
        // A reader that resumes from a dropped event: the count, not the bytes.
        let b = r.read_after(9, None, usize::MAX);
        assert_eq!(
            b.gap,
            Some(Missed {
                first_seq: 10,
                last_seq: 15,
                bytes: None
            })
        );
        // One that knows where it was: both.
        let b = r.read_after(9, Some(900), usize::MAX);
        assert_eq!(b.gap.unwrap().bytes, Some(600));
        // Right before the oldest kept: no gap.
        assert!(r.read_after(15, None, usize::MAX).gap.is_none());
    }

    #[test]
    fn the_newest_event_stays_even_when_larger_than_the_bound() {
        let mut r = Ring::new(10);
        r.push_output(StreamKind::Stdout, &[1; 50]);
        r.push_output(StreamKind::Stdout, &[2; 50]);
        assert_eq!(r.first_seq(), 2);
        r.push_exit(Exit::default());
        // The exit is never dropped in favour of older output.
        assert_eq!(r.first_seq(), 3);
        let b = r.read_after(0, Some(0), usize::MAX);
        assert_eq!(b.gap.unwrap().bytes, Some(100));
        assert!(matches!(b.events[0].kind, EventKind::Exit(_)));
    }

    #[test]
    fn batches_are_bounded_but_never_empty() {
        let mut r = Ring::new(1 << 20);
        for _ in 0..10 {
            r.push_output(StreamKind::Stdout, &[0; 1000]);
        }
        assert_eq!(r.read_after(0, None, 2500).events.len(), 2);
        assert_eq!(r.read_after(0, None, 10).events.len(), 1);
    }
}
