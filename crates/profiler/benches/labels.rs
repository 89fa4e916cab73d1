//! What request labels cost the code that sets them: a span's enter + exit through
//! `FerroprofLayer` against the same subscriber without it (target: at most 20 ns added per
//! pair), and `labels::with` / `with_set` / `set_span` around an empty closure.
//!
//! `cargo bench -p ferroprof --features tracing --bench labels`
//!
//! No profiler runs: the layer and the label slot do the same work with or without one (the
//! slot is published either way; only a root span's close records its endpoint into a running
//! profiler).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use ferroprof::labels::{self, LabelSet};
use ferroprof::tracing::FerroprofLayer;
use tracing_subscriber::layer::SubscriberExt;

/// Enter + exit of a root span, and of a child inside its (entered) root, under `subscriber`.
fn spans(c: &mut Criterion, name: &str, subscriber: impl tracing::Subscriber + Send + Sync) {
    tracing::subscriber::with_default(subscriber, || {
        let root = tracing::info_span!("request", http.route = "/users/{id}");
        let child = root.in_scope(|| tracing::info_span!("handler"));
        let mut g = c.benchmark_group("span_enter_exit");
        g.bench_function(format!("{name}/root"), |b| {
            b.iter(|| {
                let _e = black_box(&root).enter();
            })
        });
        let _r = root.enter();
        g.bench_function(format!("{name}/child_in_root"), |b| {
            b.iter(|| {
                let _e = black_box(&child).enter();
            })
        });
        g.finish();
    });
}

fn span_enter_exit(c: &mut Criterion) {
    spans(c, "registry", tracing_subscriber::registry());
    spans(
        c,
        "registry+ferroprof",
        tracing_subscriber::registry().with(FerroprofLayer::new()),
    );
}

fn labels_scopes(c: &mut Criterion) {
    let mut g = c.benchmark_group("labels");
    g.bench_function("with/1_label", |b| {
        b.iter(|| labels::with(&[("tenant", black_box("acme"))], || black_box(1)))
    });
    let set = LabelSet::new(&[("tenant", "acme")]);
    g.bench_function("with_set/1_label", |b| {
        b.iter(|| labels::with_set(black_box(&set), || black_box(1)))
    });
    g.bench_function("set_span", |b| {
        b.iter(|| {
            let _g = labels::set_span(black_box(7), black_box(3));
        })
    });
    g.bench_function("park_unpark", |b| {
        b.iter(|| {
            labels::on_thread_park();
            labels::on_thread_unpark();
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = span_enter_exit, labels_scopes
}
criterion_main!(benches);
