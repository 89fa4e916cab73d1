//! Datadog uploads against the real Datadog test agent (PyPI `ddapm-test-agent`, installed by
//! scripts/test-deps.sh), over TCP and over its unix socket; agentless mode against a loopback
//! receiver.
//!
//! The agent is started here on 127.0.0.1 with free ports and killed when the test ends. Without
//! it the agent tests are skipped loudly, except under CI (`CI` set), where they fail.

mod export_support;

use std::path::Path;
use std::time::Duration;

use export_support::*;
use ferroprof::export::datadog::{runtime_id, DatadogConfig, DatadogTarget};
use ferroprof::export::queue::{rfc3339_nanos, QueueConfig};
use ferroprof::export::transport::Secret;
use ferroprof::export::{ExportedProfile, Exporter};

fn queue() -> QueueConfig {
    QueueConfig {
        timeout: Duration::from_secs(10),
        backoff_initial: Duration::from_millis(50),
        ..QueueConfig::default()
    }
}

/// Uploads `p` through `cfg` and waits until the exporter reports it sent.
fn upload(cfg: DatadogConfig, p: &ExportedProfile) {
    let mut exp = cfg.build().unwrap();
    exp.export(p).unwrap();
    exp.shutdown(Duration::from_secs(30));
    let s = exp.stats();
    assert_eq!(
        s.sent,
        1,
        "upload not accepted: {s:?}\nlogs: {:#?}",
        captured_logs()
    );
}

fn header<'a>(req: &'a serde_json::Value, name: &str) -> Option<&'a str> {
    req["headers"]
        .as_object()?
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .and_then(|(_, v)| v.as_str())
}

/// Checks one recorded upload: headers, multipart layout, every event field, the attachment.
fn check_upload(req: &serde_json::Value, p: &ExportedProfile) {
    assert_eq!(req["method"], "POST");
    assert_eq!(header(req, "DD-EVP-ORIGIN"), Some("ferroprof"));
    assert_eq!(
        header(req, "DD-EVP-ORIGIN-VERSION"),
        Some(env!("CARGO_PKG_VERSION"))
    );
    assert_eq!(
        header(req, "DD-API-KEY"),
        None,
        "no API key through the agent"
    );
    let content_type = header(req, "Content-Type").expect("Content-Type");
    assert!(
        content_type.starts_with("multipart/form-data; boundary="),
        "{content_type}"
    );
    let body = base64_decode(req["body"].as_str().expect("body"));
    let parts = parse_multipart(content_type, &body);

    let event = parts
        .iter()
        .find(|p| p.name == "event")
        .expect("event part");
    assert_eq!(event.filename.as_deref(), Some("event.json"));
    assert_eq!(event.content_type.as_deref(), Some("application/json"));
    let ev: serde_json::Value = serde_json::from_slice(&event.data).expect("event.json is JSON");

    assert_eq!(ev["attachments"], serde_json::json!(["profile.pprof"]));
    let tags: Vec<&str> = ev["tags_profiler"]
        .as_str()
        .expect("tags_profiler")
        .split(',')
        .collect();
    for want in [
        "service:checkout".to_owned(),
        "env:staging".to_owned(),
        "version:1.2.3".to_owned(),
        format!("runtime-id:{}", runtime_id()),
        "language:rust".to_owned(),
        format!("profiler_version:{}", env!("CARGO_PKG_VERSION")),
        "team:payments".to_owned(),
    ] {
        assert!(
            tags.contains(&want.as_str()),
            "tags_profiler lacks {want}: {tags:?}"
        );
    }
    assert!(
        tags.iter().any(|t| t.starts_with("host:") && t.len() > 5),
        "{tags:?}"
    );
    for (field, t) in [("start", p.start()), ("end", p.end())] {
        let s = ev[field]
            .as_str()
            .unwrap_or_else(|| panic!("{field} missing"));
        assert_eq!(s, rfc3339_nanos(t));
        // RFC 3339, UTC, nanoseconds: 2024-05-01T12:00:00.123456789Z
        assert_eq!(s.len(), 30, "{s}");
        assert!(
            s.ends_with('Z') && s.as_bytes()[10] == b'T' && s.as_bytes()[19] == b'.',
            "{s}"
        );
    }
    assert!(ev["family"].as_str().is_some_and(|f| !f.is_empty()), "{ev}");
    assert_eq!(ev["version"], "4");
    assert_eq!(ev["endpoint_counts"]["count"]["GET /users"], 12);
    assert_eq!(ev["endpoint_counts"]["count"]["POST /orders"], 3);
    assert!(ev["internal"].is_object(), "{ev}");
    assert_eq!(ev["internal"]["recorded_samples"], 42);

    let att = parts
        .iter()
        .find(|p| p.name == "profile.pprof")
        .expect("profile attachment");
    assert_eq!(att.filename.as_deref(), Some("profile.pprof"));
    let prof = ferroprof_pprof::decode(&att.data).expect("attachment is pprof");
    let want: Vec<(String, String)> = SAMPLE_TYPES
        .iter()
        .map(|(t, u)| (t.to_string(), u.to_string()))
        .collect();
    assert_eq!(prof.sample_types(), want);
    let names: Vec<String> = prof
        .sample
        .iter()
        .flat_map(|s| prof.stack_names(s))
        .collect();
    assert!(names.iter().any(|n| n == "hot_function"), "{names:?}");
}

#[test]
fn agent_over_tcp_accepts_the_upload() {
    let _ = captured_logs();
    let Some(agent) = TestAgent::start("tcp") else {
        return;
    };
    let p = exported_profile();
    upload(DatadogConfig::agent(&agent.url()).queue(queue()), &p);
    let reqs = agent.profiling_requests();
    assert_eq!(reqs.len(), 1, "agent log:\n{}", agent.log());
    check_upload(&reqs[0], &p);
}

#[test]
fn agent_over_unix_socket_accepts_the_upload() {
    let _ = captured_logs();
    let Some(agent) = TestAgent::start("uds") else {
        return;
    };
    let p = exported_profile();
    // Configured the way users do it: DD_TRACE_AGENT_URL=unix:///path.
    let url = format!("unix://{}", agent.socket.display());
    let cfg =
        DatadogConfig::from_lookup(&|k| (k == "DD_TRACE_AGENT_URL").then(|| url.clone())).unwrap();
    assert_eq!(cfg.target, DatadogTarget::AgentUnix(agent.socket.clone()));
    upload(cfg.queue(queue()), &p);
    let reqs = agent.profiling_requests();
    assert_eq!(reqs.len(), 1, "agent log:\n{}", agent.log());
    check_upload(&reqs[0], &p);
}

#[test]
fn unix_socket_errors_are_reported_not_hung() {
    let _ = captured_logs();
    let missing = Path::new("/nonexistent-dir/apm.sock");
    let mut q = queue();
    q.max_attempts = 1;
    let mut exp = DatadogConfig::agent_unix(missing).queue(q).build().unwrap();
    exp.export(&exported_profile()).unwrap();
    exp.shutdown(Duration::from_secs(10));
    assert_eq!(exp.stats().failed, 1, "{:?}", exp.stats());
    assert!(captured_logs()
        .iter()
        .any(|l| l.contains("cannot reach backend datadog at unix:///nonexistent-dir/apm.sock")));
}

#[test]
fn agentless_sends_the_api_key_header_and_never_logs_it() {
    const KEY: &str = "0123456789abcdef-very-secret-key";
    let _ = captured_logs();
    // First answer 500 and then 403 so that error paths log too.
    let rx = Receiver::start(Behavior::Sequence(vec![500, 403]));
    let mut cfg = DatadogConfig::from_lookup(&|k| match k {
        "DD_PROFILING_AGENTLESS" => Some("true".into()),
        "DD_API_KEY" => Some(KEY.into()),
        _ => None,
    })
    .unwrap()
    .service("checkout")
    .queue(QueueConfig {
        backoff_initial: Duration::from_millis(10),
        ..queue()
    });
    // Same request, sent to the loopback receiver instead of the real intake.
    let DatadogTarget::Agentless { api_key, .. } = cfg.target.clone() else {
        panic!("not agentless: {:?}", cfg.target)
    };
    assert!(!format!("{cfg:?}").contains(KEY));
    cfg.target = DatadogTarget::Agentless {
        url: format!("{}/api/v2/profile", rx.url()),
        api_key,
    };
    let mut exp = cfg.build().unwrap();
    exp.export(&exported_profile()).unwrap();
    exp.shutdown(Duration::from_secs(20));
    assert_eq!(exp.stats().failed, 1, "{:?}", exp.stats());

    let reqs = rx.requests();
    assert_eq!(reqs.len(), 2, "500 is retried, 403 is not");
    for r in &reqs {
        assert_eq!(r.path(), "/api/v2/profile");
        assert_eq!(r.header("DD-API-KEY"), Some(KEY));
        assert_eq!(r.header("DD-EVP-ORIGIN"), Some("ferroprof"));
    }
    let logs = captured_logs();
    assert!(logs.iter().any(|l| l.contains("HTTP 403")), "{logs:#?}");
    assert!(
        logs.iter().all(|l| !l.contains(KEY)),
        "API key leaked into the logs"
    );
    let _ = Secret::new("unused");
}
