//! Process metrics from /proc: memory of the whole worker, CPU time of its
//! vCPU threads.

use crate::protocol::Metrics;

/// RSS, PSS and private dirty memory of this process, and its vCPU threads'
/// CPU time. Fields that cannot be read stay 0.
pub fn process() -> Metrics {
    let mut m = Metrics::default();
    if let Ok(s) = std::fs::read_to_string("/proc/self/smaps_rollup") {
        for line in s.lines() {
            let mut w = line.split_whitespace();
            let (Some(k), Some(v)) = (w.next(), w.next()) else {
                continue;
            };
            let v: u64 = v.parse().unwrap_or(0);
            match k {
                "Rss:" => m.rss_kib = v,
                "Pss:" => m.pss_kib = v,
                "Private_Dirty:" => m.private_dirty_kib = v,
                _ => {}
            }
        }
    }
    m.vcpu_time_us = vcpu_time_us();
    m
}

fn vcpu_time_us() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    let hz = match rustix::param::clock_ticks_per_second() {
        0 => 100,
        n => n,
    };
    let mut ticks = 0u64;
    for t in tasks.flatten() {
        let p = t.path();
        let Ok(comm) = std::fs::read_to_string(p.join("comm")) else {
            continue;
        };
        if !comm.starts_with("sprout-vcpu") {
            continue;
        }
        if let Ok(stat) = std::fs::read_to_string(p.join("stat")) {
            ticks += stat_cpu_ticks(&stat);
        }
    }
    ticks * 1_000_000 / hz
}

/// utime + stime from a /proc stat line (fields 14 and 15, after the
/// parenthesised command name, which may hold spaces).
fn stat_cpu_ticks(stat: &str) -> u64 {
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
        return 0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After ")": state is field 3, so utime (14) is index 11, stime index 12.
    let num = |i: usize| f.get(i).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
    num(11) + num(12)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_times_are_read_past_a_command_with_spaces() {
        let s = "42 (sprout vcpu) S 1 2 3 4 5 6 7 8 9 10 100 23 0 0";
        assert_eq!(stat_cpu_ticks(s), 123);
        assert_eq!(stat_cpu_ticks("garbage"), 0);
    }

    #[test]
    fn this_process_has_memory() {
        let m = process();
        assert!(m.rss_kib > 0 && m.pss_kib > 0, "{m:?}");
    }
}
