//! The additions to the seed: the `alloc-space` type, turning the always-on pair off, and the
//! profile's own metadata (`default_sample_type`, `period_type`, `period`). Read back with the
//! independent decoder of `ferroprof-pprof`; the seed's configuration must encode as before.

use std::time::SystemTime;

use ferroprof_recorder::heap::HeapConfig;
use ferroprof_recorder::{
    ExtraValues, Frame, Profile, ProfileError, ProfileMetadata, RecorderConfig, RecorderError,
    RecorderExtras, Sample, SampleType, SampleTypeConfig, SampleTypeExtras, SampleValues,
    StackRecorder,
};

fn alloc_only() -> (RecorderConfig, RecorderExtras) {
    let config = RecorderConfig {
        sample_types: SampleTypeConfig {
            alloc_samples: true,
            ..SampleTypeConfig::minimal()
        },
        ..RecorderConfig::default()
    };
    let extras = RecorderExtras {
        sample_types: SampleTypeExtras {
            alloc_space: true,
            cpu_and_wall: false,
        },
        metadata: ProfileMetadata {
            default_sample_type: Some(SampleType::AllocSpace),
            period: Some((SampleType::AllocSpace, 65_536)),
        },
    };
    (config, extras)
}

fn types(p: &ferroprof_pprof::Profile) -> Vec<(String, String)> {
    p.sample_types()
}

fn period_type(p: &ferroprof_pprof::Profile) -> Option<(String, String)> {
    p.period_type
        .as_ref()
        .map(|v| (p.str(v.r#type).to_owned(), p.str(v.unit).to_owned()))
}

#[test]
fn the_seed_configuration_writes_no_metadata_and_no_added_type() {
    let r = StackRecorder::new(RecorderConfig {
        sample_types: SampleTypeConfig::all(),
        heap: HeapConfig::native(),
        ..RecorderConfig::default()
    })
    .unwrap();
    let v = SampleValues {
        cpu_or_wall_samples: 1,
        alloc_samples: 7,
        ..Default::default()
    };
    // Extra values go nowhere when their type is off.
    r.record_sample_with(
        &[Frame::sym("f", "f.rs", 1)],
        &v,
        &ExtraValues { alloc_space: 123 },
        &[],
        0,
    )
    .unwrap();
    let d = ferroprof_pprof::decode(&r.serialize(None).unwrap().encoded.bytes).unwrap();
    let names: Vec<String> = types(&d).into_iter().map(|(t, _)| t).collect();
    let seed: Vec<String> = SampleType::ALL
        .iter()
        .map(|t| t.name().to_owned())
        .collect();
    assert_eq!(names, seed);
    assert_eq!(d.default_sample_type, 0);
    assert_eq!(d.period_type, None);
    assert_eq!(d.period, 0);
    assert_eq!(d.sample[0].value.len(), 8);
    assert_eq!(d.total("alloc-samples"), Some(7));
}

#[test]
fn allocation_only_layout_with_metadata() {
    let (config, extras) = alloc_only();
    let r = StackRecorder::with_extras(config, extras).unwrap();
    assert_eq!(r.extras(), &extras);
    let v = SampleValues {
        cpu_or_wall_samples: 1,
        wall_time_ns: 1000,
        alloc_samples: 4,
        alloc_samples_unscaled: 1,
        ..Default::default()
    };
    let frames = [Frame::sym("make_vec", "v.rs", 3)];
    for _ in 0..2 {
        r.record_sample_with(&frames, &v, &ExtraValues { alloc_space: 4096 }, &[], 0)
            .unwrap();
    }
    // Two serializations: the metadata survives the slot reset.
    for round in 0..2 {
        let d = ferroprof_pprof::decode(&r.serialize(None).unwrap().encoded.bytes).unwrap();
        assert_eq!(
            types(&d),
            vec![
                ("alloc-samples".to_owned(), "count".to_owned()),
                ("alloc-samples-unscaled".to_owned(), "count".to_owned()),
                ("alloc-space".to_owned(), "bytes".to_owned()),
            ]
        );
        assert_eq!(d.str(d.default_sample_type), "alloc-space", "round {round}");
        assert_eq!(
            period_type(&d),
            Some(("alloc-space".to_owned(), "bytes".to_owned()))
        );
        assert_eq!(d.period, 65_536);
        if round == 0 {
            assert_eq!(d.total("alloc-space"), Some(8192));
            assert_eq!(d.total("alloc-samples"), Some(8));
            assert_eq!(d.value_index("cpu-samples"), None);
            assert_eq!(d.value_index("wall-time"), None);
        } else {
            assert!(d.sample.is_empty());
        }
    }
    // And a fork's reset.
    r.reset_after_fork();
    let d = ferroprof_pprof::decode(&r.serialize(None).unwrap().encoded.bytes).unwrap();
    assert_eq!(d.str(d.default_sample_type), "alloc-space");
    assert_eq!(d.period, 65_536);
}

#[test]
fn a_period_type_outside_the_profile_is_still_named() {
    let types = [SampleType::HeapLiveSamples, SampleType::HeapLiveSize];
    let mut p = Profile::new(&types, None, SystemTime::UNIX_EPOCH);
    p.set_metadata(ProfileMetadata {
        default_sample_type: Some(SampleType::HeapLiveSize),
        period: Some((SampleType::CpuTime, 10_000_000)),
    })
    .unwrap();
    p.add(&Sample {
        frames: &[Frame::sym("keep", "k.rs", 1)],
        values: &[2, 2048],
        labels: &[],
        end_timestamp_ns: 0,
    })
    .unwrap();
    let bytes = p
        .encode(SystemTime::now(), &Default::default(), None)
        .unwrap()
        .bytes;
    let d = ferroprof_pprof::decode(&bytes).unwrap();
    d.validate().unwrap();
    assert_eq!(d.str(d.default_sample_type), "heap-live-size");
    assert_eq!(
        period_type(&d),
        Some(("cpu-time".to_owned(), "nanoseconds".to_owned()))
    );
    assert_eq!(d.period, 10_000_000);
    assert_eq!(d.total("heap-live-size"), Some(2048));
}

#[test]
fn bad_metadata_is_a_typed_error() {
    let types = [SampleType::CpuSamples, SampleType::WallTime];
    let mut p = Profile::new(&types, None, SystemTime::UNIX_EPOCH);
    assert_eq!(
        p.set_metadata(ProfileMetadata {
            default_sample_type: Some(SampleType::AllocSpace),
            period: None,
        }),
        Err(ProfileError::DefaultTypeNotInProfile("alloc-space"))
    );
    assert_eq!(
        p.set_metadata(ProfileMetadata {
            default_sample_type: None,
            period: Some((SampleType::WallTime, -1)),
        }),
        Err(ProfileError::NegativePeriod(-1))
    );
    assert_eq!(p.metadata(), ProfileMetadata::default());

    // The recorder refuses a default type its layout lacks.
    let (config, mut extras) = alloc_only();
    extras.sample_types.alloc_space = false;
    match StackRecorder::with_extras(config, extras) {
        Err(RecorderError::Config(m)) => assert!(m.contains("alloc-space"), "{m}"),
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("a default type outside the layout was accepted"),
    }
}
