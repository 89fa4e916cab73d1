//! Uploads profiles to Datadog: through the agent (`/profiling/v1/input`, over TCP or the agent's
//! unix socket) or, in agentless mode, straight to the intake with an API key.
//!
//! One upload is a multipart/form-data body with an `event` part (`event.json`: attachments, tags,
//! start/end, family, format version "4", endpoint counts, internal metadata) and the
//! `profile.pprof` attachment, sent with the `DD-EVP-ORIGIN` headers the agent expects.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use super::queue::{rfc3339_nanos, Backend, QueueConfig, QueuedExporter, Rng};
use super::transport::{
    self, json_string, parse_bool, parse_tags, Body, Endpoint, Multipart, Secret,
};
use super::{ExportError, ExportedProfile};

/// Value of the `DD-EVP-ORIGIN` header.
pub const ORIGIN: &str = "ferroprof";
/// Agent intake path.
pub const AGENT_PATH: &str = "/profiling/v1/input";
/// The agent's default unix socket, used when it exists and nothing else is configured.
pub const DEFAULT_AGENT_SOCKET: &str = "/var/run/datadog/apm.socket";
/// The profile's attachment name.
pub const PROFILE_ATTACHMENT: &str = "profile.pprof";

/// Where uploads go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DatadogTarget {
    /// The agent over HTTP, by base URL (`http://localhost:8126`).
    Agent(String),
    /// The agent over its unix socket.
    AgentUnix(PathBuf),
    /// The intake directly (`https://intake.profile.datadoghq.com/api/v2/profile`), with an API
    /// key. Needs the `tls` feature for an `https` URL.
    Agentless {
        /// The intake's URL.
        url: String,
        /// The API key (`DD_API_KEY`).
        api_key: Secret,
    },
}

impl DatadogTarget {
    /// Parses an agent URL as in `DD_TRACE_AGENT_URL`: `http://host:port`, `https://...` or
    /// `unix:///path/to/apm.socket`.
    pub fn from_agent_url(url: &str) -> Result<Self, ExportError> {
        let url = url.trim();
        if let Some(path) = url.strip_prefix("unix://") {
            if !path.starts_with('/') {
                return Err(ExportError::Config(format!(
                    "agent URL {url:?}: a unix socket URL needs an absolute path (unix:///path)"
                )));
            }
            return Ok(DatadogTarget::AgentUnix(PathBuf::from(path)));
        }
        let rest = url
            .strip_prefix("http://")
            .or_else(|| url.strip_prefix("https://"))
            .ok_or_else(|| {
                ExportError::Config(format!(
                    "agent URL {url:?} must start with http://, https:// or unix://"
                ))
            })?;
        if rest.trim_end_matches('/').is_empty() {
            return Err(ExportError::Config(format!(
                "agent URL {url:?} has no host"
            )));
        }
        Ok(DatadogTarget::Agent(url.trim_end_matches('/').to_owned()))
    }

    /// The agentless intake URL for a Datadog site (`datadoghq.com`, `datadoghq.eu`, ...).
    pub fn agentless(site: &str, api_key: Secret) -> Self {
        DatadogTarget::Agentless {
            url: format!("https://intake.profile.{}/api/v2/profile", site.trim()),
            api_key,
        }
    }

    fn endpoint(&self) -> Endpoint {
        match self {
            DatadogTarget::Agent(base) => Endpoint::Url(format!("{base}{AGENT_PATH}")),
            DatadogTarget::AgentUnix(socket) => Endpoint::Unix {
                socket: socket.clone(),
                path: AGENT_PATH.to_owned(),
            },
            DatadogTarget::Agentless { url, .. } => Endpoint::Url(url.clone()),
        }
    }
}

/// Datadog exporter settings.
#[derive(Debug, Clone)]
pub struct DatadogConfig {
    /// Where uploads go.
    pub target: DatadogTarget,
    /// `service` tag; falls back to the profile's service.
    pub service: Option<String>,
    /// `env` tag; falls back to the profile's `env` tag.
    pub env: Option<String>,
    /// `version` tag; falls back to the profile's `version` tag.
    pub version: Option<String>,
    /// `host` tag; defaults to the machine's hostname.
    pub hostname: Option<String>,
    /// More tags, added after the profile's own.
    pub tags: Vec<(String, String)>,
    /// The event's `family`.
    pub family: String,
    /// The `language` tag.
    pub language: String,
    /// Queue, timeout and retries.
    pub queue: QueueConfig,
}

impl Default for DatadogConfig {
    fn default() -> Self {
        DatadogConfig::agent("http://localhost:8126")
    }
}

impl DatadogConfig {
    /// Through the agent at `base_url` (`http://host:8126`).
    pub fn agent(base_url: &str) -> Self {
        DatadogConfig {
            target: DatadogTarget::Agent(base_url.trim_end_matches('/').to_owned()),
            service: None,
            env: None,
            version: None,
            hostname: None,
            tags: Vec::new(),
            family: "native".to_owned(),
            language: "rust".to_owned(),
            queue: QueueConfig::default(),
        }
    }

    /// Through the agent's unix socket.
    pub fn agent_unix(socket: impl Into<PathBuf>) -> Self {
        DatadogConfig {
            target: DatadogTarget::AgentUnix(socket.into()),
            ..DatadogConfig::default()
        }
    }

    /// Agentless, to `site`'s intake.
    pub fn agentless(site: &str, api_key: Secret) -> Self {
        DatadogConfig {
            target: DatadogTarget::agentless(site, api_key),
            ..DatadogConfig::default()
        }
    }

    /// Sets the `service` tag.
    pub fn service(mut self, s: impl Into<String>) -> Self {
        self.service = Some(s.into());
        self
    }

    /// Sets the `env` tag.
    pub fn env(mut self, s: impl Into<String>) -> Self {
        self.env = Some(s.into());
        self
    }

    /// Sets the `version` tag.
    pub fn version(mut self, s: impl Into<String>) -> Self {
        self.version = Some(s.into());
        self
    }

    /// Sets the `host` tag.
    pub fn hostname(mut self, s: impl Into<String>) -> Self {
        self.hostname = Some(s.into());
        self
    }

    /// Adds a tag.
    pub fn tag(mut self, k: impl Into<String>, v: impl Into<String>) -> Self {
        self.tags.push((k.into(), v.into()));
        self
    }

    /// Sets the queue, timeout and retries.
    pub fn queue(mut self, q: QueueConfig) -> Self {
        self.queue = q;
        self
    }

    /// Whether the environment turns the Datadog exporter on (`DD_PROFILING_ENABLED` or
    /// `FERROPROF_DATADOG` set to true).
    pub fn enabled_in_env() -> Result<bool, ExportError> {
        Self::enabled_in(&|k| std::env::var(k).ok())
    }

    /// [`Self::enabled_in_env`] with a custom variable lookup (for tests).
    pub fn enabled_in(env: &dyn Fn(&str) -> Option<String>) -> Result<bool, ExportError> {
        for key in ["FERROPROF_DATADOG", "DD_PROFILING_ENABLED"] {
            if let Some(v) = env(key) {
                if parse_bool(key, &v)? {
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    /// Settings from the conventional Datadog variables: `DD_AGENT_HOST`, `DD_TRACE_AGENT_PORT`,
    /// `DD_TRACE_AGENT_URL`, `DD_SERVICE`, `DD_ENV`, `DD_VERSION`, `DD_TAGS`, `DD_HOSTNAME`, and
    /// for agentless mode `DD_PROFILING_AGENTLESS`, `DD_API_KEY`, `DD_SITE`; plus the queue's
    /// `FERROPROF_EXPORT_*` variables.
    pub fn from_env() -> Result<Self, ExportError> {
        Self::from_lookup(&|k| std::env::var(k).ok())
    }

    /// [`Self::from_env`] with a custom variable lookup (for tests).
    pub fn from_lookup(env: &dyn Fn(&str) -> Option<String>) -> Result<Self, ExportError> {
        let get = |k: &str| {
            env(k)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        let agentless = match env("DD_PROFILING_AGENTLESS") {
            Some(v) => parse_bool("DD_PROFILING_AGENTLESS", &v)?,
            None => false,
        };
        let target = if agentless {
            // Never put the key's value into an error: only say whether it is there.
            let key = get("DD_API_KEY").ok_or_else(|| {
                ExportError::Config(
                    "DD_PROFILING_AGENTLESS is true but DD_API_KEY is unset or empty".into(),
                )
            })?;
            let site = get("DD_SITE").unwrap_or_else(|| "datadoghq.com".to_owned());
            DatadogTarget::agentless(&site, Secret::new(key))
        } else if let Some(url) = get("DD_TRACE_AGENT_URL") {
            DatadogTarget::from_agent_url(&url)?
        } else {
            let host = get("DD_AGENT_HOST");
            let port = get("DD_TRACE_AGENT_PORT");
            if host.is_none()
                && port.is_none()
                && std::path::Path::new(DEFAULT_AGENT_SOCKET).exists()
            {
                DatadogTarget::AgentUnix(PathBuf::from(DEFAULT_AGENT_SOCKET))
            } else {
                let host = host.unwrap_or_else(|| "localhost".to_owned());
                let port = match port {
                    None => 8126,
                    Some(p) => p.parse::<u16>().ok().filter(|p| *p != 0).ok_or_else(|| {
                        ExportError::Config(format!(
                            "DD_TRACE_AGENT_PORT={p:?} is not a port number (1-65535)"
                        ))
                    })?,
                };
                // An IPv6 literal needs brackets in a URL.
                let host = if host.contains(':') && !host.starts_with('[') {
                    format!("[{host}]")
                } else {
                    host
                };
                DatadogTarget::Agent(format!("http://{host}:{port}"))
            }
        };
        Ok(DatadogConfig {
            target,
            service: get("DD_SERVICE"),
            env: get("DD_ENV"),
            version: get("DD_VERSION"),
            hostname: get("DD_HOSTNAME"),
            tags: get("DD_TAGS")
                .map(|t| parse_tags(&t, ':'))
                .unwrap_or_default(),
            queue: QueueConfig::from_lookup(env)?,
            ..DatadogConfig::agent("http://localhost:8126")
        })
    }

    /// [`Self::from_env`] when [`Self::enabled_in_env`], else `None`.
    pub fn from_env_if_enabled() -> Result<Option<Self>, ExportError> {
        if Self::enabled_in_env()? {
            Self::from_env().map(Some)
        } else {
            Ok(None)
        }
    }

    /// Starts the exporter (its worker thread).
    pub fn build(self) -> Result<DatadogExporter, ExportError> {
        let queue = self.queue.clone();
        QueuedExporter::new(DatadogBackend::new(self)?, queue)
    }
}

/// The Datadog exporter: a [`DatadogBackend`] behind the bounded background queue.
pub type DatadogExporter = QueuedExporter<DatadogBackend>;

/// Builds and sends one upload per profile.
pub struct DatadogBackend {
    config: DatadogConfig,
    endpoint: Endpoint,
    hostname: String,
}

impl DatadogBackend {
    /// A backend for `config`; fails on an agentless target without an API key, or an `https` URL
    /// in a build without the `tls` feature.
    pub fn new(config: DatadogConfig) -> Result<Self, ExportError> {
        if let DatadogTarget::Agentless { api_key, .. } = &config.target {
            if api_key.is_empty() {
                return Err(ExportError::Config(
                    "agentless mode needs a non-empty API key".into(),
                ));
            }
        }
        if let DatadogTarget::Agent(base) = &config.target {
            // `DatadogConfig::agent` takes any string: a URL without a scheme (`localhost:8126`)
            // would otherwise fail on every upload instead of here.
            DatadogTarget::from_agent_url(base)?;
        }
        let endpoint = config.target.endpoint();
        if let Endpoint::Url(url) = &endpoint {
            transport::check_tls_available(url)?;
        }
        let hostname = config.hostname.clone().unwrap_or_else(hostname);
        Ok(DatadogBackend {
            config,
            endpoint,
            hostname,
        })
    }

    /// The `tags_profiler` list, as (key, value) pairs in upload order.
    pub fn tags(&self, profile: &ExportedProfile) -> Vec<(String, String)> {
        let from_profile = |key: &str| {
            profile
                .tags
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.clone())
        };
        let service = self
            .config
            .service
            .clone()
            .or_else(|| Some(profile.service.clone()).filter(|s| !s.is_empty()))
            .unwrap_or_else(default_service);
        let mut tags: Vec<(String, String)> = vec![("service".into(), service)];
        if let Some(env) = self.config.env.clone().or_else(|| from_profile("env")) {
            tags.push(("env".into(), env));
        }
        if let Some(v) = self
            .config
            .version
            .clone()
            .or_else(|| from_profile("version"))
        {
            tags.push(("version".into(), v));
        }
        tags.push(("host".into(), self.hostname.clone()));
        tags.push(("runtime-id".into(), runtime_id().to_owned()));
        tags.push(("language".into(), self.config.language.clone()));
        tags.push(("profiler_version".into(), env!("CARGO_PKG_VERSION").into()));
        tags.push(("process_id".into(), std::process::id().to_string()));
        let reserved = [
            "service",
            "env",
            "version",
            "host",
            "runtime-id",
            "language",
            "profiler_version",
        ];
        for (k, v) in profile.tags.iter().chain(&self.config.tags) {
            if !reserved.contains(&k.as_str()) {
                tags.push((k.clone(), v.clone()));
            }
        }
        tags
    }

    /// The `event.json` document.
    pub fn event_json(&self, profile: &ExportedProfile) -> String {
        let tags = self
            .tags(profile)
            .iter()
            .map(|(k, v)| {
                // A comma would split the tag in two on the intake side.
                let (k, v) = (k.replace(',', "_"), v.replace(',', "_"));
                if v.is_empty() {
                    k
                } else {
                    format!("{k}:{v}")
                }
            })
            .collect::<Vec<_>>()
            .join(",");
        let endpoint_counts = if profile.encoded.endpoint_counts.is_empty() {
            "null".to_owned()
        } else {
            let counts = profile
                .encoded
                .endpoint_counts
                .iter()
                .map(|(name, n)| format!("{}:{n}", json_string(name)))
                .collect::<Vec<_>>()
                .join(",");
            format!("{{\"count\":{{{counts}}}}}")
        };
        let s = &profile.stats;
        let internal = format!(
            "{{\"ferroprof_version\":{},\"recorded_samples\":{},\"serialization_time_ns\":{},\
             \"heap_iteration_prep_time_ns\":{},\"heap_profile_build_time_ns\":{}}}",
            json_string(env!("CARGO_PKG_VERSION")),
            s.recorded_samples,
            s.serialization_time_ns,
            s.heap_iteration_prep_time_ns,
            s.heap_profile_build_time_ns
        );
        let sample_types = profile
            .sample_types
            .iter()
            .map(|t| json_string(t))
            .collect::<Vec<_>>()
            .join(",");
        let info = format!(
            "{{\"application\":{{\"start_time\":{}}},\"platform\":{{\"hostname\":{},\"os\":{},\"arch\":{}}},\
             \"runtime\":{{\"engine\":\"rust\"}},\"profiler\":{{\"version\":{},\"sample_types\":[{sample_types}]}}}}",
            json_string(&rfc3339_nanos(profile.process_start)),
            json_string(&self.hostname),
            json_string(std::env::consts::OS),
            json_string(std::env::consts::ARCH),
            json_string(env!("CARGO_PKG_VERSION")),
        );
        format!(
            "{{\"attachments\":[{}],\"tags_profiler\":{},\"start\":{},\"end\":{},\"family\":{},\
             \"version\":\"4\",\"endpoint_counts\":{endpoint_counts},\"internal\":{internal},\"info\":{info}}}",
            json_string(PROFILE_ATTACHMENT),
            json_string(&tags),
            json_string(&rfc3339_nanos(profile.start())),
            json_string(&rfc3339_nanos(profile.end())),
            json_string(&self.config.family),
        )
    }

    /// Headers and body of the upload for `profile`.
    pub fn request(&self, profile: &ExportedProfile) -> (Vec<(String, String)>, Body) {
        let body = Multipart::new()
            .file(
                "event",
                "event.json",
                "application/json",
                self.event_json(profile).into_bytes(),
            )
            .file(
                PROFILE_ATTACHMENT,
                PROFILE_ATTACHMENT,
                "application/octet-stream",
                profile.encoded.bytes.clone(),
            )
            .finish();
        let mut headers = vec![
            ("DD-EVP-ORIGIN".to_owned(), ORIGIN.to_owned()),
            (
                "DD-EVP-ORIGIN-VERSION".to_owned(),
                env!("CARGO_PKG_VERSION").to_owned(),
            ),
        ];
        if let DatadogTarget::Agentless { api_key, .. } = &self.config.target {
            headers.push(("DD-API-KEY".to_owned(), api_key.expose().to_owned()));
        }
        (headers, body)
    }
}

impl Backend for DatadogBackend {
    fn name(&self) -> &str {
        "datadog"
    }

    fn target(&self) -> String {
        // The endpoint never carries the API key (that travels in a header).
        self.endpoint.to_string()
    }

    fn send(&mut self, profile: &ExportedProfile, timeout: Duration) -> Result<(), ExportError> {
        let (headers, body) = self.request(profile);
        transport::post("datadog", &self.endpoint, &headers, &body, timeout).map(|_| ())
    }
}

/// This process's `runtime-id`: a random UUID (v4), the same for every upload of the process.
pub fn runtime_id() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| {
        let mut rng = Rng::new();
        let (a, b) = (rng.next_u64(), rng.next_u64());
        // Version 4 and the RFC 4122 variant bits.
        let a = (a & !0xf000) | 0x4000;
        let b = (b & !(0b11 << 62)) | (0b10 << 62);
        format!(
            "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
            a >> 32,
            (a >> 16) & 0xffff,
            a & 0xffff,
            b >> 48,
            b & 0xffff_ffff_ffff
        )
    })
}

/// The executable's file name, the service name of last resort.
pub(crate) fn default_service() -> String {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "rust-app".to_owned())
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the pointer and length describe `buf`, which outlives the call; gethostname writes
    // at most `len` bytes into it.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown".to_owned();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::test_lookup as lookup;

    #[test]
    fn agent_host_and_port() {
        let c = DatadogConfig::from_lookup(&lookup(&[
            ("DD_AGENT_HOST", "10.1.2.3"),
            ("DD_TRACE_AGENT_PORT", "9126"),
            ("DD_SERVICE", "svc"),
            ("DD_ENV", "prod"),
            ("DD_VERSION", "1.2"),
            ("DD_TAGS", "team:core, region:eu,bare"),
        ]))
        .unwrap();
        assert_eq!(
            c.target,
            DatadogTarget::Agent("http://10.1.2.3:9126".into())
        );
        assert_eq!(c.service.as_deref(), Some("svc"));
        assert_eq!(c.env.as_deref(), Some("prod"));
        assert_eq!(c.version.as_deref(), Some("1.2"));
        assert_eq!(
            c.tags,
            vec![
                ("team".into(), "core".into()),
                ("region".into(), "eu".into()),
                ("bare".into(), "".into())
            ]
        );
    }

    #[test]
    fn agent_url_wins_and_unix_is_understood() {
        let c = DatadogConfig::from_lookup(&lookup(&[
            ("DD_AGENT_HOST", "ignored"),
            ("DD_TRACE_AGENT_URL", "unix:///tmp/apm.sock"),
        ]))
        .unwrap();
        assert_eq!(c.target, DatadogTarget::AgentUnix("/tmp/apm.sock".into()));
        let e = DatadogConfig::from_lookup(&lookup(&[("DD_TRACE_AGENT_URL", "ftp://x")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("ftp://x"), "{e}");
        let e = DatadogConfig::from_lookup(&lookup(&[("DD_TRACE_AGENT_PORT", "99999")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("99999"), "{e}");
    }

    #[test]
    fn agentless_needs_a_key_and_never_shows_it() {
        let e = DatadogConfig::from_lookup(&lookup(&[("DD_PROFILING_AGENTLESS", "true")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("DD_API_KEY"), "{e}");
        let c = DatadogConfig::from_lookup(&lookup(&[
            ("DD_PROFILING_AGENTLESS", "1"),
            ("DD_API_KEY", "sekrit-key-123"),
            ("DD_SITE", "datadoghq.eu"),
        ]))
        .unwrap();
        match &c.target {
            DatadogTarget::Agentless { url, api_key } => {
                assert_eq!(url, "https://intake.profile.datadoghq.eu/api/v2/profile");
                assert_eq!(api_key.expose(), "sekrit-key-123");
            }
            t => panic!("{t:?}"),
        }
        assert!(!format!("{c:?}").contains("sekrit"));
    }

    #[test]
    fn runtime_id_is_a_stable_uuid_v4() {
        let id = runtime_id();
        assert_eq!(id, runtime_id());
        let parts: Vec<&str> = id.split('-').collect();
        assert_eq!(
            parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
            vec![8, 4, 4, 4, 12]
        );
        assert!(parts[2].starts_with('4'));
        assert!(matches!(parts[3].as_bytes()[0], b'8' | b'9' | b'a' | b'b'));
    }

    #[test]
    fn enabled_flags() {
        assert!(!DatadogConfig::enabled_in(&lookup(&[])).unwrap());
        assert!(DatadogConfig::enabled_in(&lookup(&[("DD_PROFILING_ENABLED", "true")])).unwrap());
        assert!(DatadogConfig::enabled_in(&lookup(&[("FERROPROF_DATADOG", "maybe")])).is_err());
    }
}
