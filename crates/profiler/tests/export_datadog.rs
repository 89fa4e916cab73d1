//! Datadog uploads against the real Datadog test agent (PyPI `ddapm-test-agent`, installed by
//! scripts/test-deps.sh), over TCP and over its unix socket; agentless mode against a loopback
//! receiver.
//!
//! The agent is started here on 127.0.0.1 with free ports and killed when the test ends. Without
//! it the agent tests are skipped loudly, except under CI (`CI` set), where they fail.

mod export_support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use export_support::*;
use ferroprof::export::datadog::{runtime_id, DatadogConfig, DatadogTarget};
use ferroprof::export::queue::{rfc3339_nanos, QueueConfig};
use ferroprof::export::transport::Secret;
use ferroprof::export::{ExportedProfile, Exporter};

/// A running test agent; killed on drop.
struct TestAgent {
    child: Child,
    port: u16,
    socket: PathBuf,
    dir: PathBuf,
}

fn agent_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("FERROPROF_DDAPM_TEST_AGENT") {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Some(p);
        }
    }
    let home = std::env::var_os("HOME").map(PathBuf::from)?;
    let venv = home.join(".cache/ferroprof-test-tools/venv/bin/ddapm-test-agent");
    if venv.is_file() {
        return Some(venv);
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("ddapm-test-agent"))
            .find(|p| p.is_file())
    })
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl TestAgent {
    /// Starts the agent, or returns `None` (after a loud message) when it is not installed and
    /// this is not CI.
    fn start(tag: &str) -> Option<TestAgent> {
        let Some(bin) = agent_binary() else {
            if std::env::var_os("CI").is_some() {
                panic!("ddapm-test-agent is not installed (CI must run scripts/test-deps.sh)");
            }
            eprintln!(
                "\n*** SKIPPING Datadog agent test: ddapm-test-agent not installed; \
                 run `. scripts/test-deps.sh` to install it ***\n"
            );
            return None;
        };
        let dir =
            std::env::temp_dir().join(format!("ferroprof-ddagent-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("apm.sock");
        let port = free_port();
        let log = std::fs::File::create(dir.join("agent.log")).unwrap();
        let mut cmd = Command::new(&bin);
        cmd.current_dir(&dir)
            .arg("--host")
            .arg("127.0.0.1")
            .arg("--port")
            .arg(port.to_string())
            .arg("--otlp-http-port")
            .arg(free_port().to_string())
            .arg("--otlp-grpc-port")
            .arg(free_port().to_string())
            .arg("--trace-uds-socket")
            .arg(&socket)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        // The agent reads these to forward data elsewhere; this test keeps everything local.
        for var in [
            "DD_TRACE_AGENT_URL",
            "DD_AGENT_URL",
            "DD_API_KEY",
            "DD_SITE",
            "PORT",
            "HOST",
        ] {
            cmd.env_remove(var);
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        let mut agent = TestAgent {
            child,
            port,
            socket,
            dir,
        };
        let ready = wait_for(Duration::from_secs(90), || {
            if let Ok(Some(status)) = agent.child.try_wait() {
                panic!("test agent exited early ({status}):\n{}", agent.log());
            }
            let info = agent.get("/info").ok()?;
            (info.contains("endpoints") && agent.socket.exists()).then_some(())
        });
        if ready.is_none() {
            panic!("test agent not ready within 90 s:\n{}", agent.log());
        }
        Some(agent)
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn get(&self, path: &str) -> Result<String, ureq::Error> {
        ureq::get(format!("{}{path}", self.url()))
            .call()?
            .body_mut()
            .read_to_string()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default()
    }

    /// The profiling requests the agent recorded.
    fn profiling_requests(&self) -> Vec<serde_json::Value> {
        let body = self
            .get("/test/session/requests")
            .expect("GET /test/session/requests");
        let all: Vec<serde_json::Value> = serde_json::from_str(&body).expect("requests JSON");
        all.into_iter()
            .filter(|r| {
                r["url"]
                    .as_str()
                    .is_some_and(|u| u.ends_with("/profiling/v1/input"))
            })
            .collect()
    }
}

impl Drop for TestAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

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
