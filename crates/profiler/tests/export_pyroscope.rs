//! Pyroscope requests, checked at a loopback receiver: query, auth, tenant and body.

mod export_support;

use std::time::{Duration, UNIX_EPOCH};

use export_support::*;
use ferroprof::export::pyroscope::PyroscopeConfig;
use ferroprof::export::transport::Secret;
use ferroprof::export::Exporter;

/// Uploads one profile with the config `cfg` builds for the receiver's URL; returns the request.
fn run(
    cfg: impl FnOnce(&str) -> PyroscopeConfig,
) -> (Recorded, ferroprof::export::ExportedProfile) {
    let rx = Receiver::start(Behavior::Status(200));
    let p = exported_profile();
    let mut exp = cfg(&rx.url()).build().unwrap();
    exp.export(&p).unwrap();
    exp.shutdown(Duration::from_secs(20));
    assert_eq!(exp.stats().sent, 1, "{:?}", exp.stats());
    let reqs = rx.requests();
    assert_eq!(reqs.len(), 1);
    (reqs[0].clone(), p)
}

#[test]
fn query_body_and_basic_auth() {
    let (req, p) = run(|url| {
        PyroscopeConfig::new(url, "shop.checkout")
            .tag("region", "eu-west")
            .tag("k8s-pod", "web-1")
            .basic_auth("12345", Secret::new("glc_token"))
            .tenant("team-a")
    });
    assert_eq!(req.method, "POST");
    assert_eq!(req.path(), "/ingest");
    assert_eq!(
        req.param("name").as_deref(),
        Some("shop.checkout{env=staging,version=1.2.3,team=payments,region=eu-west,k8s_pod=web-1}")
    );
    let secs =
        |t: std::time::SystemTime| t.duration_since(UNIX_EPOCH).unwrap().as_secs().to_string();
    assert_eq!(req.param("from"), Some(secs(p.start())));
    assert_eq!(req.param("until"), Some(secs(p.end())));
    assert_eq!(req.param("format").as_deref(), Some("pprof"));
    // "12345:glc_token" in base64.
    assert_eq!(
        req.header("Authorization"),
        Some("Basic MTIzNDU6Z2xjX3Rva2Vu")
    );
    assert_eq!(req.header("X-Scope-OrgID"), Some("team-a"));

    let parts = parse_multipart(req.header("Content-Type").unwrap(), &req.body);
    let names: Vec<&str> = parts.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["profile", "sample_type_config"]);
    let profile = ferroprof_pprof::decode(&parts[0].data).expect("profile part is pprof");
    let types: Vec<(String, String)> = profile.sample_types();
    let want: Vec<(String, String)> = SAMPLE_TYPES
        .iter()
        .map(|(t, u)| (t.to_string(), u.to_string()))
        .collect();
    assert_eq!(types, want);
    assert_eq!(parts[0].data, p.encoded.bytes);

    let cfg: serde_json::Value = serde_json::from_slice(&parts[1].data).unwrap();
    for (t, _) in SAMPLE_TYPES {
        assert!(cfg.get(*t).is_some(), "sample_type_config lacks {t}: {cfg}");
    }
    assert_eq!(cfg["cpu-time"]["units"], "nanoseconds");
    assert_eq!(cfg["alloc-samples"]["units"], "objects");
    assert_eq!(cfg["heap-live-size"]["units"], "bytes");
    assert_eq!(cfg["heap-live-size"]["aggregation"], "average");
    assert_eq!(cfg["cpu-samples"]["aggregation"], "sum");
}

#[test]
fn bearer_token_and_no_tenant() {
    let (req, _) = run(|url| PyroscopeConfig::new(url, "app").bearer_token(Secret::new("t0k3n")));
    assert_eq!(req.header("Authorization"), Some("Bearer t0k3n"));
    assert_eq!(req.header("X-Scope-OrgID"), None);
    assert!(req.param("name").unwrap().starts_with("app{env=staging"));
}

#[test]
fn no_auth_sends_no_authorization_header() {
    let (req, _) = run(|url| PyroscopeConfig::new(url, "plain"));
    assert_eq!(req.header("Authorization"), None);
}
