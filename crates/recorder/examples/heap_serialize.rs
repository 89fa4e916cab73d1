//! Deterministic driver for instruction counts of the heap bench's serialize comparison:
//! `valgrind --tool=callgrind target/release/examples/heap_serialize [serialize|encode] [runs]`.

use std::hint::black_box;
use std::time::{Instant, SystemTime};

use ferroprof_recorder::pprof::EncodeOptions;

#[path = "../benches/support/heap_workload.rs"]
mod heap_workload;
use heap_workload::{aggregated_profile, loaded_recorder};

fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "serialize".into());
    let runs: usize = args.next().map_or(3, |s| s.parse().unwrap());
    let r = loaded_recorder();
    let opts = EncodeOptions::default();
    let built = || aggregated_profile(&r);
    match mode.as_str() {
        "serialize" => {
            for _ in 0..runs {
                black_box(r.serialize(None).unwrap());
            }
        }
        "sizes" => {
            let p = built();
            let s = r.serialize(None).unwrap().encoded.bytes;
            let e = p.encode(SystemTime::now(), &opts, None).unwrap().bytes;
            let raw = EncodeOptions {
                compression: ferroprof_recorder::Compression::None,
            };
            let er = p.encode(SystemTime::now(), &raw, None).unwrap().bytes;
            println!(
                "serialize {} B, encode {} B, encode uncompressed {} B",
                s.len(),
                e.len(),
                er.len()
            );
            std::fs::write("/tmp/ser.pb.gz", &s).unwrap();
            std::fs::write("/tmp/enc.pb.gz", &e).unwrap();
        }
        "encode" => {
            let p = built();
            for _ in 0..runs {
                black_box(p.encode(SystemTime::now(), &opts, None).unwrap());
            }
        }
        // Alternating runs, as the bench's paired report: medians and minimums of wall-clock
        // and of this thread's CPU time (less disturbed by other processes on a shared box).
        "paired" => {
            let p = built();
            let mut v: [Vec<f64>; 7] = Default::default();
            for _ in 0..runs {
                let (t, c) = (Instant::now(), cpu_ms());
                let s = black_box(r.serialize(None).unwrap());
                v[0].push(t.elapsed().as_secs_f64() * 1e3);
                v[1].push(cpu_ms() - c);
                v[4].push(s.stats.heap_profile_build_time_ns as f64 / 1e6);
                v[5].push(s.stats.heap_iteration_prep_time_ns as f64 / 1e6);
                v[6].push(
                    (s.stats.serialization_time_ns - s.stats.heap_profile_build_time_ns) as f64
                        / 1e6,
                );
                let (t, c) = (Instant::now(), cpu_ms());
                black_box(p.encode(SystemTime::now(), &opts, None).unwrap());
                v[2].push(t.elapsed().as_secs_f64() * 1e3);
                v[3].push(cpu_ms() - c);
            }
            for x in &mut v {
                x.sort_by(f64::total_cmp);
            }
            let med = |x: &Vec<f64>| x[x.len() / 2];
            println!(
                "median: serialize {:.1} ms (prep {:.1}, build {:.1}, rest {:.1}), encode {:.1} ms, \
                 ratio {:.2}; \
                 cpu {:.1} / {:.1} = {:.2}; min cpu {:.1} / {:.1} = {:.2}",
                med(&v[0]),
                med(&v[5]),
                med(&v[4]),
                med(&v[6]),
                med(&v[2]),
                med(&v[0]) / med(&v[2]),
                med(&v[1]),
                med(&v[3]),
                med(&v[1]) / med(&v[3]),
                v[1][0],
                v[3][0],
                v[1][0] / v[3][0]
            );
        }
        other => panic!("unknown mode {other}"),
    }
}

/// This thread's CPU time so far, in ms (Linux).
fn cpu_ms() -> f64 {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    let ns: f64 = stat
        .split_whitespace()
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0.0);
    ns / 1e6
}
