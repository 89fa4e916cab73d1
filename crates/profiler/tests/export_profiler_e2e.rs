//! End to end: the real profiler's export loop hands its profiles to the Datadog exporter (real
//! test agent) and the Pyroscope exporter (loopback receiver), both configured through
//! `from_lookup` (the `from_env` parsers); both receive pprof with the profiler's sample types
//! and stacks.
//!
//! One test in its own binary: the profiler is process-wide.

mod export_support;
mod profiler_support;

use std::hint::black_box;
use std::time::Duration;

use export_support::*;
use ferroprof::export::datadog::DatadogConfig;
use ferroprof::export::pyroscope::PyroscopeConfig;
use ferroprof::{Profiler, SamplingAllocator};
use profiler_support::thread_cpu;

#[global_allocator]
static GLOBAL: SamplingAllocator<std::alloc::System> = SamplingAllocator::new(std::alloc::System);

/// `cpu` of the thread's own CPU: the profile must hold some of it.
#[inline(never)]
fn e2e_busy_work(cpu: Duration) -> u64 {
    let end = thread_cpu() + cpu;
    let mut x = black_box(1u64);
    while thread_cpu() < end {
        let mut i = 0;
        while i < 10_000 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            i += 1;
        }
    }
    black_box(x)
}

#[test]
fn profiler_uploads_to_datadog_and_pyroscope() {
    let _ = captured_logs();
    let Some(agent) = TestAgent::start("e2e") else {
        return;
    };
    let pyro = Receiver::start(Behavior::Status(200));

    let agent_url = agent.url();
    let pyro_url = pyro.url();
    let env = move |k: &str| -> Option<String> {
        match k {
            "DD_TRACE_AGENT_URL" => Some(agent_url.clone()),
            "DD_VERSION" => Some("9.9.9".into()),
            "FERROPROF_PYROSCOPE_URL" => Some(pyro_url.clone()),
            "FERROPROF_PYROSCOPE_APP" => Some("e2e-app".into()),
            _ => None,
        }
    };
    let dd = DatadogConfig::from_lookup(&env).unwrap().build().unwrap();
    let py = PyroscopeConfig::from_lookup(&env)
        .unwrap()
        .unwrap()
        .build()
        .unwrap();
    let (dd_stats, py_stats) = (dd.stats_handle(), py.stats_handle());

    let guard = Profiler::builder()
        .service("e2e-service")
        .env("e2e")
        .period(Duration::from_secs(3600))
        .exporter(Box::new(dd))
        .exporter(Box::new(py))
        .start()
        .expect("start the profiler");
    black_box(e2e_busy_work(Duration::from_millis(500)));
    // stop() exports the last profile and shuts the exporters down, flushing their queues.
    guard.stop().expect("stop the profiler");

    let (d, p) = (dd_stats.get(), py_stats.get());
    assert!(
        d.sent >= 1 && d.failed == 0,
        "datadog: {d:?}\nlogs: {:#?}",
        captured_logs()
    );
    assert!(
        p.sent >= 1 && p.failed == 0,
        "pyroscope: {p:?}\nlogs: {:#?}",
        captured_logs()
    );

    // Datadog: the event names the profiler's service and env, and the attachment is the
    // profiler's pprof with its stacks.
    let reqs = agent.profiling_requests();
    assert!(!reqs.is_empty(), "agent log:\n{}", agent.log());
    let req = &reqs[0];
    let ct = req["headers"]["Content-Type"]
        .as_str()
        .expect("content type");
    let parts = parse_multipart(ct, &base64_decode(req["body"].as_str().unwrap()));
    let event: serde_json::Value =
        serde_json::from_slice(&parts.iter().find(|p| p.name == "event").unwrap().data).unwrap();
    let tags = event["tags_profiler"].as_str().unwrap();
    for t in [
        "service:e2e-service",
        "env:e2e",
        "version:9.9.9",
        "language:rust",
    ] {
        assert!(tags.split(',').any(|x| x == t), "{t} not in {tags}");
    }
    let att = parts.iter().find(|p| p.name == "profile.pprof").unwrap();
    let prof = ferroprof_pprof::decode(&att.data).expect("attachment decodes");
    let types: Vec<String> = prof.sample_types().into_iter().map(|(t, _)| t).collect();
    for t in ["cpu-time", "wall-time", "alloc-samples", "heap-live-size"] {
        assert!(types.iter().any(|x| x == t), "{t} not in {types:?}");
    }
    let cpu = prof.value_index("cpu-time").unwrap();
    let busy: i64 = prof
        .sample
        .iter()
        .filter(|s| {
            prof.stack_names(s)
                .iter()
                .any(|n| n.ends_with("e2e_busy_work"))
        })
        .map(|s| s.value[cpu])
        .sum();
    assert!(busy > 0, "no cpu-time in e2e_busy_work");

    // Pyroscope: same profile, named after the configured app with the profiler's tags.
    let preq = &pyro.requests()[0];
    let name = preq.param("name").unwrap();
    assert!(
        name.starts_with("e2e-app{") && name.contains("env=e2e"),
        "{name}"
    );
    let pparts = parse_multipart(preq.header("Content-Type").unwrap(), &preq.body);
    let pprof = ferroprof_pprof::decode(&pparts[0].data).expect("pyroscope profile decodes");
    assert_eq!(pprof.sample_types(), prof.sample_types());
    let cfg: serde_json::Value = serde_json::from_slice(&pparts[1].data).unwrap();
    for t in &types {
        assert!(cfg.get(t).is_some(), "sample_type_config lacks {t}");
    }
}
