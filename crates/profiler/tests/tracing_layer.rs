//! `ferroprof::tracing::FerroprofLayer` (feature `tracing`): samples taken inside tracing spans
//! carry the span's ids, root spans name the `trace endpoint` of their samples, and the exported
//! profile counts one request per root span.
#![cfg(feature = "tracing")]

mod profiler_support;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use ferroprof::labels;
use ferroprof::tracing::FerroprofLayer;
use ferroprof::{Profiler, ProfilerGuard};
use ferroprof_pprof::Profile;
use profiler_support::*;
use tracing::Instrument;
use tracing_subscriber::layer::SubscriberExt;

/// One profiler per process: the tests of this file take turns.
static LOCK: Mutex<()> = Mutex::new(());

/// The layer as every thread's subscriber (threads and tokio workers alike).
fn install() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let subscriber = tracing_subscriber::registry().with(FerroprofLayer::new());
        tracing::subscriber::set_global_default(subscriber).expect("first subscriber");
    });
}

#[inline(never)]
fn spin(units: u64) -> u64 {
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ units;
    for i in 0..units * 2_000 {
        x = std::hint::black_box(x.rotate_left(7).wrapping_mul(0x2545_F491_4F6C_DD1D) ^ i);
    }
    x
}

fn start(service: &str, c: &Collect) -> ProfilerGuard {
    Profiler::builder()
        .service(service)
        .cpu_hz(1000)
        .profiles(cpu_wall())
        .period(Duration::from_secs(3600))
        .exporter(Box::new(c.clone()))
        .start()
        .expect("profiler starts")
}

/// What the workload did.
#[derive(Default)]
struct Truth {
    /// Route -> spin units done inside its requests' spans.
    cpu: HashMap<&'static str, u64>,
    /// Route -> requests (root spans) closed.
    requests: HashMap<&'static str, i64>,
    /// Root span id -> route; child span id -> root span id.
    roots: HashMap<u64, &'static str>,
    children: HashMap<u64, u64>,
}

fn xorshift(r: &mut u64) -> u64 {
    *r ^= *r << 13;
    *r ^= *r >> 7;
    *r ^= *r << 17;
    *r
}

/// Until the thread used `cpu` of its own CPU (the split needs that many samples, however
/// loaded the machine): requests on "/a" (cost k) and "/b" (cost 3k), each a root span with a
/// `handler` child doing most of the work, with unlabelled work in between.
fn requests(cpu: Duration, seed: u64, truth: &Mutex<Truth>) {
    // Kept here and merged at the end: a lock per request would stop the thread in the kernel
    // between requests, where pending CPU signals are delivered (not an even sampling). For the
    // same reason the CPU clock (a system call) is read once every 16 requests only.
    let end = thread_cpu() + cpu;
    let mut t = Truth::default();
    let mut r = seed | 1;
    let mut n = 0u64;
    while n % 16 != 0 || thread_cpu() < end {
        n += 1;
        let k = 1 + xorshift(&mut r) % 6;
        let (route, units) = if xorshift(&mut r) % 2 == 0 {
            ("/a", k)
        } else {
            ("/b", 3 * k)
        };
        let root = tracing::info_span!("request", http.route = route);
        let root_id = root.id().expect("enabled").into_u64();
        let child_id;
        {
            let _r = root.enter();
            spin(units / 2 + 1);
            let child = tracing::info_span!("handler");
            child_id = child.id().expect("enabled").into_u64();
            let _c = child.enter();
            spin(units * 4);
        }
        // Spin units as the truth (no clock read per request: CLOCK_THREAD_CPUTIME_ID is a
        // system call, and pending CPU signals are delivered on its return).
        let spent = units / 2 + 1 + units * 4;
        drop(root); // closes: records the endpoint
        spin(k);
        *t.cpu.entry(route).or_default() += spent;
        *t.requests.entry(route).or_default() += 1;
        t.roots.insert(root_id, route);
        t.children.insert(child_id, root_id);
    }
    let mut all = truth.lock().unwrap();
    for (route, cpu) in t.cpu {
        *all.cpu.entry(route).or_default() += cpu;
    }
    for (route, n) in t.requests {
        *all.requests.entry(route).or_default() += n;
    }
    all.roots.extend(t.roots);
    all.children.extend(t.children);
}

/// Share of `route` in the cpu-time of all samples with a `trace endpoint`.
fn endpoint_share(p: &Profile, route: &str) -> f64 {
    let of_route = sum_where(p, "cpu-time", |p, s| {
        p.label_str(s, "trace endpoint") == Some(route)
    });
    let all = sum_where(p, "cpu-time", |p, s| {
        p.label_str(s, "trace endpoint").is_some()
    });
    of_route as f64 / all.max(1) as f64
}

fn endpoint_counts(c: &Collect) -> HashMap<String, i64> {
    let ps = c.0.lock().unwrap();
    let mut out = HashMap::new();
    for p in ps.iter() {
        for (e, n) in &p.encoded.endpoint_counts {
            *out.entry(e.clone()).or_default() += n;
        }
    }
    out
}

#[test]
fn cpu_splits_by_endpoint_and_samples_carry_span_ids() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    install();
    let c = Collect::default();
    let guard = start("tracing-layer-test", &c);
    let truth = Arc::new(Mutex::new(Truth::default()));
    let cpu = Duration::from_secs(4);
    let workers: Vec<_> = (0..2u64)
        .map(|i| {
            let truth = truth.clone();
            std::thread::Builder::new()
                .name(format!("req-{i}"))
                .spawn(move || requests(cpu, 0x1234_5678 + i * 77, &truth))
                .unwrap()
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    guard.stop().expect("stop flushes");

    let ps = c.decoded();
    assert_eq!(ps.len(), 1);
    let p = &ps[0];
    let truth = truth.lock().unwrap();

    // Every sample of a request carries its ids and the endpoint of its root span.
    let mut labelled = 0;
    for s in &p.sample {
        let Some(span) = p.label_num(s, "span id") else {
            assert_eq!(p.label_str(s, "trace endpoint"), None);
            continue;
        };
        labelled += 1;
        let root = p
            .label_num(s, "local root span id")
            .expect("root with span") as u64;
        let route = truth.roots.get(&root).copied();
        assert!(route.is_some(), "local root span id {root} is no root span");
        let span = span as u64;
        assert!(
            span == root || truth.children.get(&span) == Some(&root),
            "span {span} is not in the trace rooted at {root}"
        );
        assert_eq!(
            p.label_str(s, "trace endpoint"),
            route,
            "endpoint of {root}"
        );
    }
    eprintln!("{labelled} samples inside spans of {}", p.sample.len());
    assert!(labelled > 50, "{labelled} samples inside spans");

    // CPU split by endpoint as done (spin units cost the same on either route).
    let (a, b) = (truth.cpu["/a"] as f64, truth.cpu["/b"] as f64);
    let expected = a / (a + b);
    let share = endpoint_share(p, "/a");
    eprintln!(
        "/a share of endpoint cpu-time: {share:.3}, measured {expected:.3} ({:?} requests)",
        truth.requests
    );
    assert!(
        (share - expected).abs() < 0.05,
        "/a share {share:.3}, measured {expected:.3}"
    );

    // One request counted per root span.
    let counts = endpoint_counts(&c);
    for route in ["/a", "/b"] {
        assert_eq!(
            counts.get(route).copied(),
            truth.requests.get(route).copied(),
            "endpoint count of {route}: {counts:?}"
        );
    }
}

/// A future that burns `units` per poll for `polls` polls, adding them to `cpu`; between
/// polls it is woken from another thread (`wake`), so it goes through the runtime's shared
/// queue and any worker may poll it next.
struct Burn {
    units: u64,
    polls: u32,
    cpu: Arc<Mutex<u64>>,
    wake: std::sync::mpsc::Sender<std::task::Waker>,
}

impl Future for Burn {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        spin(self.units);
        *self.cpu.lock().unwrap() += self.units;
        self.polls -= 1;
        if self.polls == 0 {
            return Poll::Ready(());
        }
        self.wake.send(cx.waker().clone()).unwrap();
        Poll::Pending
    }
}

#[test]
fn instrumented_futures_carry_their_span_on_every_worker() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    install();
    let c = Collect::default();
    let guard = start("tracing-layer-tokio", &c);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("rt-worker")
        .build()
        .unwrap();
    let (x_cpu, y_cpu) = (Arc::new(Mutex::new(0)), Arc::new(Mutex::new(0)));
    let mut spans: HashMap<u64, &'static str> = HashMap::new();
    // The workers' CPU, about 3 s each, read from the process's clock (they are the runtime's
    // threads): the checks need that many samples, however loaded the machine.
    let cpu_until = process_cpu() + Duration::from_secs(6);
    let mut requests: HashMap<&str, i64> = HashMap::new();
    let (wake, wakes) = std::sync::mpsc::channel::<std::task::Waker>();
    let waker_thread = std::thread::spawn(move || {
        for w in wakes {
            w.wake();
        }
    });
    rt.block_on(async {
        while process_cpu() < cpu_until {
            let mut tasks = Vec::new();
            for (route, units, cpu) in [("/x", 40, &x_cpu), ("/y", 80, &y_cpu)] {
                for _ in 0..2 {
                    let span = tracing::info_span!("request", http.route = route);
                    spans.insert(span.id().expect("enabled").into_u64(), route);
                    *requests.entry(route).or_default() += 1;
                    let burn = Burn {
                        units,
                        polls: 6,
                        cpu: cpu.clone(),
                        wake: wake.clone(),
                    };
                    tasks.push(tokio::spawn(burn.instrument(span)));
                }
            }
            for t in tasks {
                t.await.unwrap();
            }
        }
    });
    drop(rt);
    drop(wake);
    waker_thread.join().unwrap();
    guard.stop().expect("stop flushes");

    let ps = c.decoded();
    let p = &ps[0];
    let mut threads_of: HashMap<i64, HashSet<i64>> = HashMap::new();
    for s in &p.sample {
        let Some(span) = p.label_num(s, "span id") else {
            continue;
        };
        let thread = p.label_str(s, "thread name").unwrap_or("").to_owned();
        assert!(
            thread.starts_with("rt-worker"),
            "span {span} on thread {thread}"
        );
        let route = spans.get(&(span as u64)).copied();
        assert!(route.is_some(), "span id {span} is no task's span");
        assert_eq!(p.label_num(s, "local root span id"), Some(span));
        assert_eq!(p.label_str(s, "trace endpoint"), route);
        let tid = p.label_num(s, "thread id").expect("thread id");
        threads_of.entry(span).or_default().insert(tid);
    }
    assert!(threads_of.len() > 10, "{} spans sampled", threads_of.len());
    // The spans did move between workers and stayed labelled (two workers, yielding tasks).
    let moved = threads_of.values().filter(|t| t.len() > 1).count();
    eprintln!(
        "{moved} of {} sampled spans on both workers",
        threads_of.len()
    );
    assert!(moved > 0, "no span sampled on two workers");

    let (x, y) = (*x_cpu.lock().unwrap() as f64, *y_cpu.lock().unwrap() as f64);
    let expected = x / (x + y);
    let share = endpoint_share(p, "/x");
    eprintln!("/x share of endpoint cpu-time: {share:.3}, measured {expected:.3}");
    assert!(
        (share - expected).abs() < 0.05,
        "/x share {share:.3}, measured {expected:.3}"
    );
    let counts = endpoint_counts(&c);
    for route in ["/x", "/y"] {
        assert_eq!(
            counts.get(route).copied(),
            requests.get(route).copied(),
            "{counts:?}"
        );
    }
    // The workers' own context is back once no task runs.
    assert!(labels::__current().is_empty());
}

#[test]
fn enter_and_exit_restore_the_previous_context_in_any_order() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    install();
    // Numeric labels are i64: the id's 64 bits (the registry's ids carry a generation on top).
    let ids = |s: &tracing::Span| (s.id().unwrap().into_u64() as i64).to_string();
    let get = |k: &str| {
        labels::__current()
            .into_iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v)
    };
    let a = tracing::info_span!("a");
    let b = a.in_scope(|| tracing::info_span!("b"));
    let c = b.in_scope(|| tracing::info_span!("c"));
    assert_eq!(get("span id"), None);
    let ga = a.enter();
    assert_eq!(get("span id"), Some(ids(&a)));
    assert_eq!(get("local root span id"), Some(ids(&a)));
    let gb = b.enter();
    assert_eq!(get("span id"), Some(ids(&b)));
    assert_eq!(get("local root span id"), Some(ids(&a)));
    // Out of order: `a` exits while `b` is active; `b` stays, and its exit restores none.
    drop(ga);
    assert_eq!(get("span id"), Some(ids(&b)));
    drop(gb);
    assert_eq!(get("span id"), None);
    assert_eq!(get("local root span id"), None);

    // A grandchild entered on a thread where none of its ancestors is entered still finds its
    // root; user labels set around it are kept.
    let (c2, a2) = (c.clone(), ids(&a));
    std::thread::spawn(move || {
        labels::with(&[("tenant", "t")], || {
            let _g = c2.enter();
            let cur = labels::__current();
            assert!(cur.contains(&("span id".into(), ids(&c2))));
            assert!(cur.contains(&("local root span id".into(), a2)));
            assert!(cur.contains(&("tenant".into(), "t".into())));
        });
        assert!(labels::__current().is_empty());
    })
    .join()
    .unwrap();

    // Recursion: the same span entered twice on a thread.
    {
        let _g1 = a.enter();
        let _g2 = a.enter();
        assert_eq!(get("span id"), Some(ids(&a)));
    }
    assert_eq!(get("span id"), None);
    // Without a profiler, closing a root span records nothing and does no harm.
    drop((a, b, c));
}
