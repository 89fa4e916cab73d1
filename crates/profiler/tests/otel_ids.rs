//! Feature `opentelemetry`: spans that `tracing-opentelemetry` makes OpenTelemetry spans carry
//! their OTel span id and their local root's OTel span id in samples (and the endpoint is counted
//! under the root's OTel id), so a profile links to the trace.
#![cfg(feature = "opentelemetry")]

mod profiler_support;

use std::time::Duration;

use ferroprof::tracing::FerroprofLayer;
use ferroprof::Profiler;
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use profiler_support::*;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

/// Spins for `cpu` of the thread's own CPU time.
#[inline(never)]
fn otel_spin(cpu: Duration) -> u64 {
    let end = thread_cpu() + cpu;
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    while thread_cpu() < end {
        for i in 0..10_000u64 {
            x = std::hint::black_box(x.rotate_left(7).wrapping_mul(0x2545_F491_4F6C_DD1D) ^ i);
        }
    }
    x
}

fn otel_id(span: &tracing::Span) -> u64 {
    let cx = span.context();
    let id = cx.span().span_context().span_id();
    u64::from_be_bytes(id.to_bytes())
}

#[test]
fn samples_carry_the_opentelemetry_span_ids() {
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("ferroprof-test")))
        .with(FerroprofLayer::new());
    let c = Collect::default();
    let guard = Profiler::builder()
        .service("otel-ids-test")
        .cpu_hz(1000)
        .profiles(cpu_wall())
        .period(Duration::from_secs(3600))
        .exporter(Box::new(c.clone()))
        .start()
        .expect("profiler starts");
    let (root_id, child_id, root_tracing, child_tracing) =
        tracing::subscriber::with_default(subscriber, || {
            let root = tracing::info_span!("request", http.route = "/otel");
            let root_tracing = root.id().expect("enabled").into_u64();
            let _r = root.enter();
            let child = tracing::info_span!("handler");
            let child_tracing = child.id().expect("enabled").into_u64();
            {
                let _c = child.enter();
                otel_spin(Duration::from_millis(400));
            }
            (otel_id(&root), otel_id(&child), root_tracing, child_tracing)
        });
    guard.stop().unwrap();
    assert!(root_id != 0 && child_id != 0 && root_id != child_id);
    let ps = c.decoded();
    let cpu = |span: u64, root: u64| {
        sum_all(&ps, "cpu-time", |p, s| {
            p.label_num(s, "span id") == Some(span as i64)
                && p.label_num(s, "local root span id") == Some(root as i64)
        })
    };
    let in_child = cpu(child_id, root_id);
    let total = sum_all(&ps, "cpu-time", |p, s| has_fn(p, s, "otel_spin"));
    eprintln!(
        "otel_spin {:.3} s, under the OTel ids {:.3} s (root {root_id:x}, child {child_id:x})",
        total as f64 / 1e9,
        in_child as f64 / 1e9
    );
    assert!(total > 100_000_000, "too few samples: {total} ns");
    assert!(
        in_child as f64 >= 0.9 * total as f64,
        "{in_child} of {total} ns under the OTel ids"
    );
    // No sample under the tracing ids.
    let tracing_ids = sum_all(&ps, "cpu-time", |p, s| {
        p.label_num(s, "span id") == Some(child_tracing as i64)
            || p.label_num(s, "local root span id") == Some(root_tracing as i64)
    });
    assert_eq!(tracing_ids, 0);
    // The endpoint goes with the root's OTel id.
    let with_endpoint = sum_all(&ps, "cpu-time", |p, s| {
        p.label_str(s, "trace endpoint") == Some("/otel")
    });
    assert!(
        with_endpoint as f64 >= 0.9 * total as f64,
        "{with_endpoint}"
    );
}
