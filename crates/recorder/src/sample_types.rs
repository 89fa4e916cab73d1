//! The eight sample (value) types and how the enabled ones are laid out in a profile.
//!
//! With everything enabled the layout is the declared order. Otherwise `cpu-samples` and
//! `wall-time` come first (they are always on), followed by the enabled rest in declared order;
//! disabled types are parked after the enabled ones so writing them is harmless and they are
//! never encoded.

/// One of the value types a sample can carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum SampleType {
    CpuTime = 0,
    CpuSamples = 1,
    WallTime = 2,
    AllocSamples = 3,
    AllocSamplesUnscaled = 4,
    HeapLiveSamples = 5,
    HeapLiveSize = 6,
    Timeline = 7,
}

impl SampleType {
    /// All types in declared order.
    pub const ALL: [SampleType; 8] = [
        SampleType::CpuTime,
        SampleType::CpuSamples,
        SampleType::WallTime,
        SampleType::AllocSamples,
        SampleType::AllocSamplesUnscaled,
        SampleType::HeapLiveSamples,
        SampleType::HeapLiveSize,
        SampleType::Timeline,
    ];
    pub const COUNT: usize = 8;

    /// The pprof `type` string.
    pub fn name(self) -> &'static str {
        match self {
            SampleType::CpuTime => "cpu-time",
            SampleType::CpuSamples => "cpu-samples",
            SampleType::WallTime => "wall-time",
            SampleType::AllocSamples => "alloc-samples",
            SampleType::AllocSamplesUnscaled => "alloc-samples-unscaled",
            SampleType::HeapLiveSamples => "heap-live-samples",
            SampleType::HeapLiveSize => "heap-live-size",
            SampleType::Timeline => "timeline",
        }
    }

    /// The pprof `unit` string.
    pub fn unit(self) -> &'static str {
        match self {
            SampleType::CpuTime | SampleType::WallTime | SampleType::Timeline => "nanoseconds",
            SampleType::HeapLiveSize => "bytes",
            _ => "count",
        }
    }

    /// Looks a type up by its pprof name.
    pub fn from_name(name: &str) -> Option<SampleType> {
        SampleType::ALL.into_iter().find(|t| t.name() == name)
    }
}

/// Which optional sample types are recorded. `cpu-samples` and `wall-time` are always on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleTypeConfig {
    pub cpu_time: bool,
    /// Enables both `alloc-samples` and `alloc-samples-unscaled`.
    pub alloc_samples: bool,
    pub heap_samples: bool,
    pub heap_size: bool,
    pub timeline: bool,
}

impl Default for SampleTypeConfig {
    fn default() -> Self {
        SampleTypeConfig {
            cpu_time: true,
            alloc_samples: true,
            heap_samples: true,
            heap_size: true,
            timeline: true,
        }
    }
}

impl SampleTypeConfig {
    /// Every type enabled.
    pub fn all() -> Self {
        Self::default()
    }

    /// Only the always-on pair (`cpu-samples`, `wall-time`).
    pub fn minimal() -> Self {
        SampleTypeConfig {
            cpu_time: false,
            alloc_samples: false,
            heap_samples: false,
            heap_size: false,
            timeline: false,
        }
    }

    /// True when either heap type is on, i.e. a heap recorder is needed.
    pub fn heap_enabled(&self) -> bool {
        self.heap_samples || self.heap_size
    }

    fn is_enabled(&self, t: SampleType) -> bool {
        match t {
            SampleType::CpuSamples | SampleType::WallTime => true,
            SampleType::CpuTime => self.cpu_time,
            SampleType::AllocSamples | SampleType::AllocSamplesUnscaled => self.alloc_samples,
            SampleType::HeapLiveSamples => self.heap_samples,
            SampleType::HeapLiveSize => self.heap_size,
            SampleType::Timeline => self.timeline,
        }
    }
}

/// Where each sample type sits in a profile's value array.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SampleLayout {
    enabled: Vec<SampleType>,
    position_for: [u8; SampleType::COUNT],
}

impl SampleLayout {
    pub fn new(config: &SampleTypeConfig) -> Self {
        let all_on = SampleType::ALL.iter().all(|t| config.is_enabled(*t));
        let order: Vec<SampleType> = if all_on {
            SampleType::ALL.to_vec()
        } else {
            let mut v = vec![SampleType::CpuSamples, SampleType::WallTime];
            v.extend(
                SampleType::ALL
                    .iter()
                    .copied()
                    .filter(|t| !matches!(t, SampleType::CpuSamples | SampleType::WallTime)),
            );
            v
        };
        let enabled: Vec<SampleType> = order
            .iter()
            .copied()
            .filter(|t| config.is_enabled(*t))
            .collect();
        let mut position_for = [0u8; SampleType::COUNT];
        let mut next_disabled = enabled.len();
        for (pos, t) in enabled.iter().enumerate() {
            position_for[*t as usize] = pos as u8;
        }
        for t in order.iter().filter(|t| !config.is_enabled(**t)) {
            position_for[*t as usize] = next_disabled as u8;
            next_disabled += 1;
        }
        SampleLayout {
            enabled,
            position_for,
        }
    }

    /// The enabled types, in the order the profile carries them.
    pub fn types(&self) -> &[SampleType] {
        &self.enabled
    }

    /// Number of enabled types (the length of every encoded sample's value array).
    pub fn len(&self) -> usize {
        self.enabled.len()
    }

    pub fn is_empty(&self) -> bool {
        self.enabled.is_empty()
    }

    /// Index of `t` in the value array, or `None` when `t` is disabled.
    pub fn position(&self, t: SampleType) -> Option<usize> {
        let p = self.position_for[t as usize] as usize;
        (p < self.enabled.len()).then_some(p)
    }

    /// Lays `values` out into a full-width array; the first [`Self::len`] entries are the enabled
    /// ones, values of disabled types land past them and are dropped by the caller.
    pub fn place(&self, values: &SampleValues) -> [i64; SampleType::COUNT] {
        let mut out = [0i64; SampleType::COUNT];
        let p = &self.position_for;
        out[p[SampleType::CpuTime as usize] as usize] = values.cpu_time_ns;
        out[p[SampleType::CpuSamples as usize] as usize] = values.cpu_or_wall_samples;
        out[p[SampleType::WallTime as usize] as usize] = values.wall_time_ns;
        out[p[SampleType::AllocSamples as usize] as usize] = values.alloc_samples;
        out[p[SampleType::AllocSamplesUnscaled as usize] as usize] = values.alloc_samples_unscaled;
        out[p[SampleType::HeapLiveSamples as usize] as usize] = values.heap_live_samples;
        out[p[SampleType::HeapLiveSize as usize] as usize] = values.heap_live_size;
        out[p[SampleType::Timeline as usize] as usize] = values.timeline_wall_time_ns;
        out
    }
}

/// The values a sampler reports for one sample, by meaning rather than position.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SampleValues {
    pub cpu_time_ns: i64,
    pub cpu_or_wall_samples: i64,
    pub wall_time_ns: i64,
    pub alloc_samples: i64,
    pub alloc_samples_unscaled: i64,
    /// Normally filled by the heap recorder at serialization, not by samplers.
    pub heap_live_samples: i64,
    /// Normally filled by the heap recorder at serialization, not by samplers.
    pub heap_live_size: i64,
    pub timeline_wall_time_ns: i64,
    /// Managed-heap model: this allocation sample ends the heap recording begun by
    /// `StackRecorder::track_object`, committing it with this sample's frames.
    pub heap_sample: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_enabled_uses_declared_order() {
        let l = SampleLayout::new(&SampleTypeConfig::all());
        assert_eq!(l.types(), &SampleType::ALL);
        for (i, t) in SampleType::ALL.iter().enumerate() {
            assert_eq!(l.position(*t), Some(i));
        }
    }

    #[test]
    fn partial_config_puts_samples_and_wall_first() {
        let cfg = SampleTypeConfig {
            cpu_time: true,
            alloc_samples: false,
            heap_samples: true,
            heap_size: false,
            timeline: true,
        };
        let l = SampleLayout::new(&cfg);
        assert_eq!(
            l.types(),
            &[
                SampleType::CpuSamples,
                SampleType::WallTime,
                SampleType::CpuTime,
                SampleType::HeapLiveSamples,
                SampleType::Timeline
            ]
        );
        assert_eq!(l.position(SampleType::AllocSamples), None);
        assert_eq!(l.position(SampleType::HeapLiveSize), None);
    }

    #[test]
    fn disabled_values_are_dropped() {
        let l = SampleLayout::new(&SampleTypeConfig::minimal());
        assert_eq!(l.types(), &[SampleType::CpuSamples, SampleType::WallTime]);
        let placed = l.place(&SampleValues {
            cpu_time_ns: 99,
            cpu_or_wall_samples: 1,
            wall_time_ns: 7,
            alloc_samples: 5,
            ..Default::default()
        });
        assert_eq!(&placed[..l.len()], &[1, 7]);
    }

    #[test]
    fn names_and_units_match_the_seed() {
        let got: Vec<(&str, &str)> = SampleType::ALL
            .iter()
            .map(|t| (t.name(), t.unit()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("cpu-time", "nanoseconds"),
                ("cpu-samples", "count"),
                ("wall-time", "nanoseconds"),
                ("alloc-samples", "count"),
                ("alloc-samples-unscaled", "count"),
                ("heap-live-samples", "count"),
                ("heap-live-size", "bytes"),
                ("timeline", "nanoseconds"),
            ]
        );
    }
}
