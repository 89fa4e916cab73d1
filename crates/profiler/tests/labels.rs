//! Request labels (`ferroprof::labels`) in written profiles: CPU, wall and allocation samples
//! carry the span ids and user labels of their thread at the time, in the right proportions.

mod profiler_support;

use std::alloc::System;
use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use ferroprof::labels::{self, WithLabelsExt};
use ferroprof::{Profiler, Profiles, SamplingAllocator};
use ferroprof_pprof::{Profile, Sample};
use profiler_support::*;

#[global_allocator]
static GLOBAL: SamplingAllocator<System> = SamplingAllocator::new(System);

/// One profiler per process: the tests of this file take turns.
static LOCK: Mutex<()> = Mutex::new(());

#[inline(never)]
fn spin(units: u64) -> u64 {
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ units;
    for i in 0..units * 2_000 {
        x = std::hint::black_box(x.rotate_left(7).wrapping_mul(0x2545_F491_4F6C_DD1D) ^ i);
    }
    x
}

/// `units` of CPU and `units` KiB allocated (and freed).
#[inline(never)]
fn work(units: u64) -> u64 {
    let mut acc = spin(units);
    for i in 0..units * 4 {
        let v = std::hint::black_box(vec![i as u8; 256]);
        acc = acc.wrapping_add(v[0] as u64);
    }
    acc
}

/// Until the thread used `cpu` of its own CPU (the shares below need that many samples,
/// however loaded the machine): 3 units of work under `tenant` and span (`span`, `root`), 1
/// unlabelled, in chunks of random length so the alternation cannot alias with sampling.
fn worker(cpu: Duration, tenant: &'static str, span: u64, root: u64) -> u64 {
    let end = thread_cpu() + cpu;
    let mut r = span | 1;
    let mut acc = 0u64;
    while thread_cpu() < end {
        r ^= r << 13;
        r ^= r >> 7;
        r ^= r << 17;
        let k = 1 + r % 8;
        acc = acc.wrapping_add(labels::with(&[("tenant", tenant)], || {
            let _span = labels::set_span(span, root);
            work(3 * k)
        }));
        acc = acc.wrapping_add(work(k));
    }
    acc
}

fn thread_is(p: &Profile, s: &Sample, name: &str) -> bool {
    p.label_str(s, "thread name") == Some(name)
}

#[test]
fn cpu_wall_and_allocation_samples_carry_their_threads_labels() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let c = Collect::default();
    let guard = Profiler::builder()
        .service("labels-test")
        .cpu_hz(100)
        .alloc_interval_bytes(16 * 1024)
        .profiles(Profiles {
            cpu: true,
            wall: true,
            alloc: true,
            heap: false,
        })
        .period(Duration::from_secs(3600))
        .exporter(Box::new(c.clone()))
        .start()
        .expect("profiler starts");
    let run = Duration::from_secs(3);
    let a = std::thread::Builder::new()
        .name("worker-a".into())
        .spawn(move || worker(run, "a", 11, 10))
        .unwrap();
    let b = std::thread::Builder::new()
        .name("worker-b".into())
        .spawn(move || worker(run, "b", 21, 20))
        .unwrap();
    let sleeper = std::thread::Builder::new()
        .name("sleeper".into())
        .spawn(move || {
            labels::with(&[("phase", "sleeping")], || {
                let _span = labels::set_span(99, 98);
                std::thread::sleep(run);
            })
        })
        .unwrap();
    a.join().unwrap();
    b.join().unwrap();
    sleeper.join().unwrap();
    guard.stop().expect("stop flushes");

    let ps = c.decoded();
    assert_eq!(ps.len(), 1);
    let p = &ps[0];

    // Labels go with their own thread and span, never another's.
    // The worker sets its tenant, then its span, and clears them in the reverse order: a
    // sample may land between the two (a few instructions), so a tenant without a span, or a
    // span without a tenant, is rare but possible; a wrong value never is. Measured: 0 to 3 of
    // about 100 samples per worker (up to 2.6%), before and after the fork-safe locks, more
    // than the window's few instructions explain (see docs/architecture.md, Limits).
    for (thread, tenant, span, root) in [("worker-a", "a", 11, 10), ("worker-b", "b", 21, 20)] {
        let (mut mine, mut between) = (0usize, 0usize);
        for s in &p.sample {
            if p.label_str(s, "tenant") == Some(tenant) {
                assert!(thread_is(p, s, thread), "tenant {tenant} on another thread");
            }
            if !thread_is(p, s, thread) {
                continue;
            }
            mine += 1;
            let tenant_here = p.label_str(s, "tenant");
            assert!(tenant_here.is_none() || tenant_here == Some(tenant));
            let ids = (
                p.label_num(s, "span id"),
                p.label_num(s, "local root span id"),
            );
            assert!(
                ids == (None, None) || ids == (Some(span), Some(root)),
                "{thread}: span ids {ids:?}"
            );
            between += usize::from(tenant_here.is_some() != ids.0.is_some());
        }
        // A rate near 2.5% over 75-100 samples exceeds 4% in about one run in eight (a CI run
        // read 4 of 75): the bound is 10%, still far under what labels that lag would show.
        assert!(
            between * 10 <= mine,
            "{thread}: {between} of {mine} samples with a tenant and no span, or the reverse"
        );
    }

    // 3 units of 4 under the labels: CPU, wall and allocated bytes alike.
    for thread in ["worker-a", "worker-b"] {
        for value in ["cpu-time", "wall-time", "alloc-space"] {
            let all = sum_where(p, value, |p, s| thread_is(p, s, thread));
            let labelled = sum_where(p, value, |p, s| {
                thread_is(p, s, thread) && p.label_str(s, "tenant").is_some()
            });
            assert!(all > 0, "{thread}: no {value}");
            let share = labelled as f64 / all as f64;
            eprintln!("{thread} {value}: labelled share {share:.3} of {all}");
            assert!(
                (share - 0.75).abs() < 0.1,
                "{thread} {value}: labelled share {share:.3}, expected 0.75"
            );
        }
    }

    // A thread blocked inside `with` gets its wall time under its labels (read by the sampler
    // thread from the sleeper's slot).
    let sleeping = sum_where(p, "wall-time", |p, s| {
        thread_is(p, s, "sleeper")
            && p.label_str(s, "phase") == Some("sleeping")
            && p.label_num(s, "span id") == Some(99)
            && p.label_num(s, "local root span id") == Some(98)
    });
    let sleeper_wall = sum_where(p, "wall-time", |p, s| thread_is(p, s, "sleeper"));
    eprintln!("sleeper wall {sleeper_wall} ns, labelled {sleeping} ns");
    assert!(
        sleeping as f64 > 0.7 * run.as_nanos() as f64,
        "sleeper's labelled wall {sleeping} ns over a {run:?} run"
    );
    assert!(sleeping as f64 > 0.9 * sleeper_wall as f64);
}

#[test]
fn bounds_are_counted_not_fatal() {
    let before = labels::stats();
    let many: Vec<(String, String)> = (0..labels::MAX_LABELS + 3)
        .map(|i| (format!("k{i}"), format!("v{i}")))
        .collect();
    let many: Vec<(&str, &str)> = many.iter().map(|(k, v)| (&**k, &**v)).collect();
    let long = "x".repeat(labels::MAX_STR_LEN * 4);
    labels::with(&many, || {
        let now = labels::__current();
        assert_eq!(now.len(), labels::MAX_LABELS, "{now:?}");
        // Nested, with the set full: a new key is dropped, a key already set is replaced.
        labels::with(&[("k0", "again"), ("new", "x")], || {
            let now = labels::__current();
            assert!(now.contains(&("k0".into(), "again".into())));
            assert!(!now.iter().any(|(k, _)| k == "new"));
        });
    });
    labels::with(&[("long", &long)], || {
        let now = labels::__current();
        assert_eq!(now[0].1.len(), labels::MAX_STR_LEN);
    });
    let after = labels::stats();
    assert_eq!(after.labels_dropped - before.labels_dropped, 3 + 1);
    assert!(after.strings_truncated > before.strings_truncated);
    assert!(labels::__current().is_empty());
}

/// A future that is pending `n` times before it finishes, checking the labels at each poll.
struct Yields {
    left: u32,
    polls: u32,
}

impl Future for Yields {
    type Output = u32;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<u32> {
        let now = labels::__current();
        assert!(now.contains(&("route".into(), "/users".into())), "{now:?}");
        assert!(now.contains(&("span id".into(), "5".into())), "{now:?}");
        self.polls += 1;
        if self.left == 0 {
            return Poll::Ready(self.polls);
        }
        self.left -= 1;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

struct Noop;

impl Wake for Noop {
    fn wake(self: std::sync::Arc<Self>) {}
}

#[test]
fn futures_carry_their_labels_across_polls_and_threads() {
    let mut fut = Box::pin(
        Yields { left: 5, polls: 0 }
            .with_labels(&[("route", "/users")])
            .with_span(5, 4),
    );
    let waker = Waker::from(std::sync::Arc::new(Noop));
    let mut cx = Context::from_waker(&waker);
    // The poller's own labels are kept during the poll and come back after it.
    labels::with(&[("worker", "0")], || {
        assert!(fut.as_mut().poll(&mut cx).is_pending());
        assert_eq!(
            labels::__current(),
            vec![("worker".to_string(), "0".to_string())]
        );
    });
    assert!(labels::__current().is_empty());
    // Polled to the end on another thread.
    let polls = std::thread::spawn(move || {
        let waker = Waker::from(std::sync::Arc::new(Noop));
        let mut cx = Context::from_waker(&waker);
        loop {
            if let Poll::Ready(n) = fut.as_mut().poll(&mut cx) {
                assert!(labels::__current().is_empty());
                return n;
            }
        }
    })
    .join()
    .unwrap();
    assert_eq!(polls, 6);
}
