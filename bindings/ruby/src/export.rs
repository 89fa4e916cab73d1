//! `Ferroprof::Native::Exporters`: the Rust profiler's network exporters (Datadog agent or
//! intake, Pyroscope) for the Ruby profiler, configured from the same variables
//! (`DD_PROFILING_ENABLED`, `DD_TRACE_AGENT_URL`..., `FERROPROF_PYROSCOPE_URL`...). Each queues
//! profiles on a thread of its own, so handing one over never waits for the network; `shutdown`
//! flushes them within a deadline.

use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use ferroprof_export::datadog::DatadogConfig;
use ferroprof_export::pyroscope::PyroscopeConfig;
use ferroprof_export::{ExportedProfile, Exporter};
use ferroprof_recorder::{SerializedProfile, StackRecorder};
use magnus::{function, method, prelude::*, Error, RArray, RClass, RModule, Ruby};

use crate::recorder::RbRecorder;
use crate::{guard, lock};

/// The exporters of one profiler run, and what every profile is tagged with.
#[magnus::wrap(class = "Ferroprof::Native::Exporters", free_immediately, size)]
pub struct Exporters {
    exporters: Mutex<Vec<Box<dyn Exporter>>>,
    service: String,
    tags: Vec<(String, String)>,
    process_start: SystemTime,
    /// Names, for `Ferroprof.stats` and messages.
    names: Vec<String>,
}

impl Exporters {
    /// `_native_exporters_from_env(service, [[tag, value], ...])`: the exporters the
    /// environment asks for, or nil when it asks for none. Raises `Ferroprof::Error` naming the
    /// bad variable.
    fn from_env(
        ruby: &Ruby,
        service: String,
        tags: Vec<(String, String)>,
    ) -> Result<Option<Exporters>, Error> {
        guard(ruby, || {
            let env = |k: &str| std::env::var(k).ok();
            let mut list: Vec<Box<dyn Exporter>> = Vec::new();
            let bad = |e: ferroprof_export::ExportError| crate::error(ruby, e.to_string());
            if DatadogConfig::enabled_in(&env).map_err(bad)? {
                let mut dd = DatadogConfig::from_lookup(&env).map_err(bad)?;
                dd.family = "ruby".to_owned();
                dd.language = "ruby".to_owned();
                list.push(Box::new(dd.build().map_err(bad)?));
            }
            if let Some(mut py) = PyroscopeConfig::from_lookup(&env).map_err(bad)? {
                if env("FERROPROF_PYROSCOPE_APP").is_none() {
                    // The executable is `ruby`: the service names the application.
                    py.app = service.clone();
                }
                list.push(Box::new(py.build().map_err(bad)?));
            }
            if list.is_empty() {
                return Ok(None);
            }
            let names = list.iter().map(|e| e.name().to_owned()).collect();
            Ok(Some(Exporters {
                exporters: Mutex::new(list),
                service,
                tags,
                process_start: process_start(),
                names,
            }))
        })
    }

    /// Hands a serialized profile to every exporter (each queues it and returns at once).
    /// Returns how many refused it (their queue full, or the backend's error).
    fn export(&self, p: &SerializedProfile, recorder: &StackRecorder) -> usize {
        let sample_types = recorder.layout().types().iter();
        let sample_types = sample_types.map(|t| t.name().to_owned()).collect();
        let profile = ExportedProfile {
            encoded: p.encoded.clone(),
            stats: p.stats,
            service: self.service.clone(),
            tags: self.tags.clone(),
            sample_types,
            process_start: self.process_start,
        };
        let mut list = lock(&self.exporters);
        let mut refused = 0;
        for e in list.iter_mut() {
            if e.export(&profile).is_err() {
                refused += 1;
            }
        }
        refused
    }

    /// `shutdown(seconds)`: flushes what the queues hold, within the deadline (split between
    /// the exporters).
    fn shutdown(ruby: &Ruby, rb: &Exporters, seconds: f64) -> Result<(), Error> {
        guard(ruby, || {
            let mut list = lock(&rb.exporters);
            let each = Duration::from_secs_f64(seconds.max(0.0) / list.len().max(1) as f64);
            for e in list.iter_mut() {
                e.shutdown(each);
            }
            list.clear();
            Ok(())
        })
    }

    /// `StackRecorder._native_serialize_export(recorder, exporters)`: as `_native_serialize`,
    /// and the profile goes to `exporters` too (queued; the stats' `export_refused` says how
    /// many refused it).
    fn serialize_export(
        ruby: &Ruby,
        rb: &RbRecorder,
        exporters: &Exporters,
    ) -> Result<RArray, Error> {
        RbRecorder::serialize_to(ruby, rb, Some(&|p, rec| exporters.export(p, rec)))
    }

    fn names(ruby: &Ruby, rb: &Exporters) -> Result<RArray, Error> {
        guard(ruby, || {
            let out = ruby.ary_new();
            for n in &rb.names {
                out.push(n.as_str())?;
            }
            Ok(out)
        })
    }
}

/// When this process started (for backends that want it), from `/proc/self/stat`.
fn process_start() -> SystemTime {
    let now = SystemTime::now();
    let uptime = std::fs::read_to_string("/proc/uptime")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<f64>().ok());
    let started = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            // Field 22 (start time in clock ticks since boot), counted after the command's ")".
            let rest = &s[s.rfind(')')? + 2..];
            rest.split_whitespace().nth(19)?.parse::<f64>().ok()
        });
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    match (uptime, started) {
        (Some(up), Some(ticks)) if hz > 0.0 && up >= ticks / hz => {
            now - Duration::from_secs_f64(up - ticks / hz)
        }
        _ => now,
    }
}

pub fn init(_ruby: &Ruby, module: RModule) -> Result<(), Error> {
    let native = module.define_module("Native")?;
    let class = native.define_class("Exporters", magnus::class::object())?;
    class.define_singleton_method(
        "_native_exporters_from_env",
        function!(Exporters::from_env, 2),
    )?;
    class.define_method("shutdown", method!(Exporters::shutdown, 1))?;
    class.define_method("names", method!(Exporters::names, 0))?;
    // With the recorder's own entry points, where the Ruby side looks for it.
    let recorder: RClass = module.const_get("StackRecorder")?;
    recorder.define_singleton_method(
        "_native_serialize_export",
        function!(Exporters::serialize_export, 2),
    )?;
    Ok(())
}
