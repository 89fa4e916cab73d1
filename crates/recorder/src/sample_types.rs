//! The sample (value) types and how the enabled ones are laid out in a profile.
//!
//! The seed's eight types ([`SampleType::ALL`]), configured by [`SampleTypeConfig`]: with all of
//! them enabled the layout is the declared order. Otherwise `cpu-samples` and `wall-time` come
//! first (they are always on), followed by the enabled rest in declared order; disabled types
//! are parked after the enabled ones so writing them is harmless and they are never encoded.
//!
//! Types added since ([`SampleType::ADDED`]: `alloc-space`) and turning the always-on pair off
//! are opt-in through [`SampleTypeExtras`], whose default leaves the seed's layout unchanged.
//! Added types follow the seed's types, so they never move a seed type's position.

/// One of the value types a sample can carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum SampleType {
    /// `cpu-time` (nanoseconds): CPU time spent.
    CpuTime = 0,
    /// `cpu-samples` (count): sampling events (CPU or wall ticks).
    CpuSamples = 1,
    /// `wall-time` (nanoseconds): wall-clock time.
    WallTime = 2,
    /// `alloc-samples` (count): allocations, estimated from the sampled ones.
    AllocSamples = 3,
    /// `alloc-samples-unscaled` (count): sampled allocations, unweighted.
    AllocSamplesUnscaled = 4,
    /// `heap-live-samples` (count): live objects, estimated.
    HeapLiveSamples = 5,
    /// `heap-live-size` (bytes): live heap, estimated.
    HeapLiveSize = 6,
    /// `timeline` (nanoseconds): wall time of timestamped samples.
    Timeline = 7,
    /// Added after the seed: estimated bytes allocated.
    AllocSpace = 8,
}

impl SampleType {
    /// The seed's eight types in declared order (the layout of [`SampleTypeConfig::all`]).
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
    /// Types added after the seed, in declared order; off unless [`SampleTypeExtras`] asks.
    pub const ADDED: [SampleType; 1] = [SampleType::AllocSpace];
    /// Number of types, seed and added.
    pub const COUNT: usize = 9;

    /// Every type, seed then added, in declared order.
    pub fn every() -> impl Iterator<Item = SampleType> {
        SampleType::ALL.into_iter().chain(SampleType::ADDED)
    }

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
            SampleType::AllocSpace => "alloc-space",
        }
    }

    /// The pprof `unit` string.
    pub fn unit(self) -> &'static str {
        match self {
            SampleType::CpuTime | SampleType::WallTime | SampleType::Timeline => "nanoseconds",
            SampleType::HeapLiveSize | SampleType::AllocSpace => "bytes",
            _ => "count",
        }
    }

    /// Looks a type up by its pprof name.
    pub fn from_name(name: &str) -> Option<SampleType> {
        SampleType::every().find(|t| t.name() == name)
    }
}

/// Which optional seed types are recorded. `cpu-samples` and `wall-time` are always on (unless
/// [`SampleTypeExtras::cpu_and_wall`] turns them off).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleTypeConfig {
    /// `cpu-time`.
    pub cpu_time: bool,
    /// Enables both `alloc-samples` and `alloc-samples-unscaled`.
    pub alloc_samples: bool,
    /// `heap-live-samples`.
    pub heap_samples: bool,
    /// `heap-live-size`.
    pub heap_size: bool,
    /// `timeline`.
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

    fn is_enabled(&self, t: SampleType, extras: &SampleTypeExtras) -> bool {
        match t {
            SampleType::CpuSamples | SampleType::WallTime => extras.cpu_and_wall,
            SampleType::CpuTime => self.cpu_time,
            SampleType::AllocSamples | SampleType::AllocSamplesUnscaled => self.alloc_samples,
            SampleType::HeapLiveSamples => self.heap_samples,
            SampleType::HeapLiveSize => self.heap_size,
            SampleType::Timeline => self.timeline,
            SampleType::AllocSpace => extras.alloc_space,
        }
    }
}

/// What a configuration changes in the seed's layout. The default changes nothing (the seed's
/// configuration); the Rust profiler turns `alloc-space` on, and the always-on pair off in
/// profiles that have no CPU or wall data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleTypeExtras {
    /// `alloc-space` (bytes), placed after the seed's types. Off by default.
    pub alloc_space: bool,
    /// `cpu-samples` and `wall-time`, which the seed always records. On by default.
    pub cpu_and_wall: bool,
}

impl Default for SampleTypeExtras {
    fn default() -> Self {
        SampleTypeExtras {
            alloc_space: false,
            cpu_and_wall: true,
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
    /// The seed's layout of `config`.
    pub fn new(config: &SampleTypeConfig) -> Self {
        Self::with_extras(config, &SampleTypeExtras::default())
    }

    /// The layout of `config` changed by `extras` (seed types by the seed's rules, then the
    /// enabled added types).
    pub fn with_extras(config: &SampleTypeConfig, extras: &SampleTypeExtras) -> Self {
        let on = |t: SampleType| config.is_enabled(t, extras);
        let all_on = SampleType::ALL.iter().all(|t| on(*t));
        let mut order: Vec<SampleType> = if all_on {
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
        order.extend(SampleType::ADDED);
        let enabled: Vec<SampleType> = order.iter().copied().filter(|t| on(*t)).collect();
        let mut position_for = [0u8; SampleType::COUNT];
        let mut next_disabled = enabled.len();
        for (pos, t) in enabled.iter().enumerate() {
            position_for[*t as usize] = pos as u8;
        }
        for t in order.iter().filter(|t| !on(**t)) {
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

    /// Whether no type is enabled.
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
        self.place_with(values, &ExtraValues::default())
    }

    /// [`Self::place`] with the values of the added types.
    pub fn place_with(
        &self,
        values: &SampleValues,
        extra: &ExtraValues,
    ) -> [i64; SampleType::COUNT] {
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
        out[p[SampleType::AllocSpace as usize] as usize] = extra.alloc_space;
        out
    }
}

/// The values of the types added after the seed ([`SampleType::ADDED`]), next to a sample's
/// [`SampleValues`] (which keeps the seed's fields only).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExtraValues {
    /// `alloc-space`: estimated bytes allocated (the sample's size times its weight).
    pub alloc_space: i64,
}

/// The values a sampler reports for one sample, by meaning rather than position.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SampleValues {
    /// `cpu-time`, nanoseconds.
    pub cpu_time_ns: i64,
    /// `cpu-samples`: sampling events.
    pub cpu_or_wall_samples: i64,
    /// `wall-time`, nanoseconds.
    pub wall_time_ns: i64,
    /// `alloc-samples`: allocations this sample stands for.
    pub alloc_samples: i64,
    /// `alloc-samples-unscaled`: 1 per sampled allocation.
    pub alloc_samples_unscaled: i64,
    /// Normally filled by the heap recorder at serialization, not by samplers.
    pub heap_live_samples: i64,
    /// Normally filled by the heap recorder at serialization, not by samplers.
    pub heap_live_size: i64,
    /// `timeline`, nanoseconds.
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
    fn default_extras_keep_the_seed_layout() {
        let cfgs = [
            SampleTypeConfig::all(),
            SampleTypeConfig::minimal(),
            SampleTypeConfig {
                alloc_samples: false,
                ..SampleTypeConfig::all()
            },
        ];
        for cfg in cfgs {
            let seed = SampleLayout::new(&cfg);
            assert_eq!(
                SampleLayout::with_extras(&cfg, &SampleTypeExtras::default()),
                seed
            );
            assert_eq!(seed.position(SampleType::AllocSpace), None);
        }
    }

    #[test]
    fn alloc_space_follows_the_seed_types() {
        let extras = SampleTypeExtras {
            alloc_space: true,
            ..SampleTypeExtras::default()
        };
        let l = SampleLayout::with_extras(&SampleTypeConfig::all(), &extras);
        assert_eq!(&l.types()[..8], &SampleType::ALL);
        assert_eq!(l.types()[8], SampleType::AllocSpace);
        let placed = l.place_with(
            &SampleValues {
                alloc_samples: 3,
                ..Default::default()
            },
            &ExtraValues { alloc_space: 4096 },
        );
        assert_eq!(placed[3], 3);
        assert_eq!(placed[8], 4096);
    }

    #[test]
    fn the_always_on_pair_can_be_turned_off() {
        let cfg = SampleTypeConfig {
            alloc_samples: true,
            ..SampleTypeConfig::minimal()
        };
        let extras = SampleTypeExtras {
            alloc_space: true,
            cpu_and_wall: false,
        };
        let l = SampleLayout::with_extras(&cfg, &extras);
        assert_eq!(
            l.types(),
            &[
                SampleType::AllocSamples,
                SampleType::AllocSamplesUnscaled,
                SampleType::AllocSpace
            ]
        );
        assert_eq!(l.position(SampleType::CpuSamples), None);
        let placed = l.place_with(
            &SampleValues {
                cpu_or_wall_samples: 9,
                wall_time_ns: 9,
                alloc_samples: 2,
                alloc_samples_unscaled: 1,
                ..Default::default()
            },
            &ExtraValues { alloc_space: 64 },
        );
        assert_eq!(&placed[..l.len()], &[2, 1, 64]);
        // Everything off is an empty layout, not an out-of-bounds write.
        let none = SampleLayout::with_extras(
            &SampleTypeConfig::minimal(),
            &SampleTypeExtras {
                alloc_space: false,
                cpu_and_wall: false,
            },
        );
        assert!(none.is_empty());
        let _ = none.place(&SampleValues::default());
    }

    #[test]
    fn added_types_are_named() {
        assert_eq!(SampleType::AllocSpace.name(), "alloc-space");
        assert_eq!(SampleType::AllocSpace.unit(), "bytes");
        assert_eq!(
            SampleType::from_name("alloc-space"),
            Some(SampleType::AllocSpace)
        );
        assert_eq!(SampleType::every().count(), SampleType::COUNT);
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
