//! Uploads profiles to Pyroscope (or Grafana Cloud Profiles) through its `/ingest` API:
//! `POST /ingest?name=APP{tags}&from=&until=&format=pprof` with a multipart body holding the
//! `profile` and a `sample_type_config` that tells Pyroscope the units and aggregation of each of
//! our sample types.
//!
//! Samples taken inside a trace also get the labels Grafana's span profiles read: `span_id`
//! (the trace's local root span id, 16 hex digits) and `span_name` (its endpoint), next to the
//! numeric `local root span id` and `trace endpoint` every exporter gets.

use std::time::{Duration, SystemTime};

use ferroprof_recorder::SampleType;

use super::queue::{Backend, QueueConfig, QueuedExporter};
use super::transport::{
    self, base64, json_string, parse_tags, percent_encode, Body, Endpoint, Multipart, Secret,
};
use super::{ExportError, ExportedProfile};

/// How requests authenticate.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum PyroscopeAuth {
    /// No authentication.
    #[default]
    None,
    /// HTTP basic auth (Grafana Cloud: instance id and an access token).
    Basic {
        /// The user (Grafana Cloud: the instance id).
        user: String,
        /// The password or token.
        password: Secret,
    },
    /// `Authorization: Bearer <token>`.
    Bearer(Secret),
}

/// Pyroscope exporter settings.
#[derive(Debug, Clone)]
pub struct PyroscopeConfig {
    /// Server base URL, e.g. `http://localhost:4040`.
    pub url: String,
    /// Application name (the part of `name` before the tags).
    pub app: String,
    /// Tags added after the profile's own.
    pub tags: Vec<(String, String)>,
    /// How requests authenticate.
    pub auth: PyroscopeAuth,
    /// Sent as `X-Scope-OrgID` for multi-tenant servers.
    pub tenant: Option<String>,
    /// Queue, timeout and retries.
    pub queue: QueueConfig,
}

impl PyroscopeConfig {
    /// Settings for the server at `url` (e.g. `http://localhost:4040`) and application `app`.
    pub fn new(url: &str, app: &str) -> Self {
        PyroscopeConfig {
            url: url.trim().trim_end_matches('/').to_owned(),
            app: app.to_owned(),
            tags: Vec::new(),
            auth: PyroscopeAuth::None,
            tenant: None,
            queue: QueueConfig::default(),
        }
    }

    /// Adds a tag.
    pub fn tag(mut self, k: impl Into<String>, v: impl Into<String>) -> Self {
        self.tags.push((k.into(), v.into()));
        self
    }

    /// Authenticates with HTTP basic auth.
    pub fn basic_auth(mut self, user: impl Into<String>, password: Secret) -> Self {
        self.auth = PyroscopeAuth::Basic {
            user: user.into(),
            password,
        };
        self
    }

    /// Authenticates with `Authorization: Bearer <token>`.
    pub fn bearer_token(mut self, token: Secret) -> Self {
        self.auth = PyroscopeAuth::Bearer(token);
        self
    }

    /// Sets the `X-Scope-OrgID` tenant.
    pub fn tenant(mut self, t: impl Into<String>) -> Self {
        self.tenant = Some(t.into());
        self
    }

    /// Sets the queue, timeout and retries.
    pub fn queue(mut self, q: QueueConfig) -> Self {
        self.queue = q;
        self
    }

    /// Settings from `FERROPROF_PYROSCOPE_URL` (the exporter is off, `None`, when unset),
    /// `FERROPROF_PYROSCOPE_APP`, `FERROPROF_PYROSCOPE_TAGS` (`k=v,k2=v2`),
    /// `FERROPROF_PYROSCOPE_USER` + `FERROPROF_PYROSCOPE_PASSWORD` or `FERROPROF_PYROSCOPE_TOKEN`,
    /// `FERROPROF_PYROSCOPE_TENANT`, and the queue's `FERROPROF_EXPORT_*` variables.
    pub fn from_env() -> Result<Option<Self>, ExportError> {
        Self::from_lookup(&|k| std::env::var(k).ok())
    }

    /// [`Self::from_env`] with a custom variable lookup (for tests).
    pub fn from_lookup(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<Self>, ExportError> {
        let get = |k: &str| {
            env(k)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        let Some(url) = get("FERROPROF_PYROSCOPE_URL") else {
            return Ok(None);
        };
        let app = get("FERROPROF_PYROSCOPE_APP").unwrap_or_else(super::datadog::default_service);
        let mut c = PyroscopeConfig::new(&url, &app);
        c.tags = get("FERROPROF_PYROSCOPE_TAGS")
            .map(|t| parse_tags(&t, '='))
            .unwrap_or_default();
        // Only the variable names go into errors, never their values.
        c.auth = match (
            get("FERROPROF_PYROSCOPE_USER"),
            get("FERROPROF_PYROSCOPE_PASSWORD"),
            get("FERROPROF_PYROSCOPE_TOKEN"),
        ) {
            (Some(_), _, Some(_)) => {
                return Err(ExportError::Config(
                    "set either FERROPROF_PYROSCOPE_USER/PASSWORD or FERROPROF_PYROSCOPE_TOKEN, not both"
                        .into(),
                ))
            }
            (Some(user), Some(pw), None) => PyroscopeAuth::Basic {
                user,
                password: Secret::new(pw),
            },
            (Some(_), None, None) => {
                return Err(ExportError::Config(
                    "FERROPROF_PYROSCOPE_USER is set but FERROPROF_PYROSCOPE_PASSWORD is not".into(),
                ))
            }
            (None, Some(_), _) => {
                return Err(ExportError::Config(
                    "FERROPROF_PYROSCOPE_PASSWORD is set but FERROPROF_PYROSCOPE_USER is not".into(),
                ))
            }
            (None, None, Some(t)) => PyroscopeAuth::Bearer(Secret::new(t)),
            (None, None, None) => PyroscopeAuth::None,
        };
        c.tenant = get("FERROPROF_PYROSCOPE_TENANT");
        c.queue = QueueConfig::from_lookup(env)?;
        c.validate()?;
        Ok(Some(c))
    }

    fn validate(&self) -> Result<(), ExportError> {
        if !(self.url.starts_with("http://") || self.url.starts_with("https://")) {
            return Err(ExportError::Config(format!(
                "Pyroscope URL {:?} must start with http:// or https://",
                self.url
            )));
        }
        if self.app.trim().is_empty() {
            return Err(ExportError::Config(
                "Pyroscope application name is empty".into(),
            ));
        }
        Ok(())
    }

    /// Starts the exporter (its worker thread).
    pub fn build(self) -> Result<PyroscopeExporter, ExportError> {
        let queue = self.queue.clone();
        QueuedExporter::new(PyroscopeBackend::new(self)?, queue)
    }
}

/// The Pyroscope exporter: a [`PyroscopeBackend`] behind the bounded background queue.
pub type PyroscopeExporter = QueuedExporter<PyroscopeBackend>;

/// Builds and sends one ingest request per profile.
pub struct PyroscopeBackend {
    config: PyroscopeConfig,
}

impl PyroscopeBackend {
    /// A backend for `config`; fails on a bad URL or name, or an `https` URL in a build without the
    /// `tls` feature.
    pub fn new(config: PyroscopeConfig) -> Result<Self, ExportError> {
        config.validate()?;
        transport::check_tls_available(&config.url)?;
        Ok(PyroscopeBackend { config })
    }

    /// `APP{k=v,...}`: the profile's tags, then the configured ones (later keys win).
    pub fn series_name(&self, profile: &ExportedProfile) -> String {
        let mut tags: Vec<(String, String)> = Vec::new();
        for (k, v) in profile.tags.iter().chain(&self.config.tags) {
            let k = label_name(k);
            let v = label_value(v);
            if k.is_empty() || k == "__name__" {
                continue;
            }
            match tags.iter_mut().find(|(ek, _)| *ek == k) {
                Some(e) => e.1 = v,
                None => tags.push((k, v)),
            }
        }
        let tags = tags
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",");
        format!("{}{{{tags}}}", self.config.app)
    }

    /// The full ingest URL for `profile`.
    pub fn url(&self, profile: &ExportedProfile) -> String {
        let from = unix_secs(profile.start());
        // `until` must not be before `from`; a sub-second profile still covers one second.
        let until = unix_secs(profile.end()).max(from);
        format!(
            "{}/ingest?name={}&from={from}&until={until}&format=pprof&spyName=ferroprof",
            self.config.url,
            percent_encode(&self.series_name(profile)),
        )
    }

    /// The `sample_type_config` document for the profile's sample types.
    pub fn sample_type_config(profile: &ExportedProfile) -> String {
        let entries = profile
            .sample_types
            .iter()
            .map(|name| {
                let (units, aggregation, display) = match SampleType::from_name(name) {
                    Some(SampleType::CpuTime) => ("nanoseconds", "sum", "cpu_time"),
                    Some(SampleType::CpuSamples) => ("samples", "sum", "cpu_samples"),
                    Some(SampleType::WallTime) => ("nanoseconds", "sum", "wall_time"),
                    Some(SampleType::AllocSamples) => ("objects", "sum", "alloc_objects"),
                    Some(SampleType::AllocSamplesUnscaled) => {
                        ("objects", "sum", "alloc_objects_unscaled")
                    }
                    // Live heap is a level, not a flow: average it over time, like Go's inuse_*.
                    Some(SampleType::HeapLiveSamples) => ("objects", "average", "inuse_objects"),
                    Some(SampleType::HeapLiveSize) => ("bytes", "average", "inuse_space"),
                    Some(SampleType::Timeline) => ("nanoseconds", "sum", "timeline"),
                    Some(SampleType::AllocSpace) => ("bytes", "sum", "alloc_space"),
                    None => ("samples", "sum", name.as_str()),
                };
                format!(
                    "{}:{{\"units\":{},\"aggregation\":{},\"display-name\":{}}}",
                    json_string(name),
                    json_string(units),
                    json_string(aggregation),
                    json_string(&display.replace('-', "_")),
                )
            })
            .collect::<Vec<_>>()
            .join(",");
        format!("{{{entries}}}")
    }

    /// Headers and body of the ingest request for `profile`.
    pub fn request(&self, profile: &ExportedProfile) -> (Vec<(String, String)>, Body) {
        // Grafana's span profiles: `span_id` in hex and `span_name` (see the module docs).
        let bytes = super::span_labels::add(&profile.encoded.bytes, profile.encoded.compression)
            .unwrap_or_else(|| profile.encoded.bytes.clone());
        let body = Multipart::new()
            .file(
                "profile",
                "profile.pprof",
                "application/octet-stream",
                bytes,
            )
            .file(
                "sample_type_config",
                "sample_type_config.json",
                "application/json",
                Self::sample_type_config(profile).into_bytes(),
            )
            .finish();
        let mut headers = Vec::new();
        match &self.config.auth {
            PyroscopeAuth::None => {}
            PyroscopeAuth::Basic { user, password } => headers.push((
                "Authorization".to_owned(),
                format!(
                    "Basic {}",
                    base64(format!("{user}:{}", password.expose()).as_bytes())
                ),
            )),
            PyroscopeAuth::Bearer(token) => headers.push((
                "Authorization".to_owned(),
                format!("Bearer {}", token.expose()),
            )),
        }
        if let Some(t) = &self.config.tenant {
            headers.push(("X-Scope-OrgID".to_owned(), t.clone()));
        }
        (headers, body)
    }
}

impl Backend for PyroscopeBackend {
    fn name(&self) -> &str {
        "pyroscope"
    }

    fn target(&self) -> String {
        format!("{}/ingest", self.config.url)
    }

    fn send(&mut self, profile: &ExportedProfile, timeout: Duration) -> Result<(), ExportError> {
        let (headers, body) = self.request(profile);
        let endpoint = Endpoint::Url(self.url(profile));
        transport::post("pyroscope", &endpoint, &headers, &body, timeout).map(|_| ())
    }
}

fn unix_secs(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Pyroscope label names are `[a-zA-Z_][a-zA-Z0-9_.]*`; anything else becomes `_`.
fn label_name(k: &str) -> String {
    let mut out: String = k
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if out.starts_with(|c: char| c.is_ascii_digit() || c == '.') {
        out.insert(0, '_');
    }
    out
}

/// Characters that would break the `{k=v,...}` syntax are replaced.
fn label_value(v: &str) -> String {
    v.trim()
        .chars()
        .map(|c| {
            if matches!(c, ',' | '{' | '}' | '=' | '"') {
                '_'
            } else {
                c
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::test_lookup as lookup;

    #[test]
    fn off_without_url() {
        assert!(PyroscopeConfig::from_lookup(&lookup(&[]))
            .unwrap()
            .is_none());
    }

    #[test]
    fn env_settings() {
        let c = PyroscopeConfig::from_lookup(&lookup(&[
            ("FERROPROF_PYROSCOPE_URL", "http://127.0.0.1:4040/"),
            ("FERROPROF_PYROSCOPE_APP", "shop"),
            ("FERROPROF_PYROSCOPE_TAGS", "region=eu,pod=a-1"),
            ("FERROPROF_PYROSCOPE_TOKEN", "tok"),
            ("FERROPROF_PYROSCOPE_TENANT", "team-a"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(c.url, "http://127.0.0.1:4040");
        assert_eq!(c.app, "shop");
        assert_eq!(
            c.tags,
            vec![("region".into(), "eu".into()), ("pod".into(), "a-1".into())]
        );
        assert_eq!(c.auth, PyroscopeAuth::Bearer(Secret::new("tok")));
        assert_eq!(c.tenant.as_deref(), Some("team-a"));
        assert!(!format!("{c:?}").contains("tok\""));
    }

    #[test]
    fn bad_env_is_named() {
        let e =
            PyroscopeConfig::from_lookup(&lookup(&[("FERROPROF_PYROSCOPE_URL", "localhost:4040")]))
                .unwrap_err()
                .to_string();
        assert!(e.contains("localhost:4040"), "{e}");
        let e = PyroscopeConfig::from_lookup(&lookup(&[
            ("FERROPROF_PYROSCOPE_URL", "http://x"),
            ("FERROPROF_PYROSCOPE_USER", "u"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(e.contains("FERROPROF_PYROSCOPE_PASSWORD"), "{e}");
    }

    #[test]
    fn https_needs_the_tls_feature() {
        let r = PyroscopeBackend::new(PyroscopeConfig::new("https://profiles.example", "a"));
        if cfg!(feature = "tls") {
            assert!(r.is_ok());
        } else {
            let e = r.err().unwrap().to_string();
            assert!(
                e.contains("https://profiles.example") && e.contains("`tls` feature"),
                "{e}"
            );
        }
    }

    #[test]
    fn label_sanitizing() {
        assert_eq!(label_name("k8s-pod name"), "k8s_pod_name");
        assert_eq!(label_name("1x"), "_1x");
        assert_eq!(label_value("a,b{c}=d"), "a_b_c__d");
    }
}
