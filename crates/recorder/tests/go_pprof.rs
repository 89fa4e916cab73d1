//! `go tool pprof` (the reference reader) must accept the default (gzip) output: sample types,
//! stacks, labels and timestamped samples.

use ferroprof_recorder::heap::HeapConfig;
use ferroprof_recorder::profile::{END_TIMESTAMP_LABEL, LOCAL_ROOT_SPAN_ID_LABEL};
use ferroprof_recorder::{
    Frame, Label, RecorderConfig, ResolvedFrame, SampleTypeConfig, SampleValues, StackRecorder,
    Symbolizer,
};

struct Inlining;
impl Symbolizer for Inlining {
    fn symbolize(&mut self, address: u64, out: &mut Vec<ResolvedFrame>) {
        if address == 0xabc0 {
            for (name, line) in [("inlined_helper", 7), ("physical_caller", 70)] {
                out.push(ResolvedFrame {
                    name: name.into(),
                    filename: "lib.rs".into(),
                    line,
                    ..Default::default()
                });
            }
        }
    }
}

#[test]
fn go_tool_pprof_reads_the_default_output() {
    let Some(go) = ferroprof_pprof::go_tool::go_for_tests() else {
        return;
    };
    let r = StackRecorder::new(RecorderConfig {
        sample_types: SampleTypeConfig::all(),
        heap: HeapConfig::native(),
        ..RecorderConfig::default()
    })
    .unwrap();
    let frames = [
        Frame::Address(0xabc0),
        Frame::sym("go_visible_worker", "worker.rs", 12),
        Frame::sym("main", "main.rs", 3),
    ];
    let v = SampleValues {
        cpu_time_ns: 5_000_000,
        cpu_or_wall_samples: 1,
        wall_time_ns: 10_000_000,
        ..Default::default()
    };
    let labels = [
        Label::str("thread name", "worker-1"),
        Label::num(LOCAL_ROOT_SPAN_ID_LABEL, 77),
    ];
    r.record_sample(&frames, &v, &labels, 0).unwrap();
    r.record_sample(&frames, &v, &labels, 1_700_000_000_000_000_000)
        .unwrap();
    r.record_endpoint(77, "GET /things").unwrap();
    r.track_allocation(1, 2, 4096, Some("Vec<u8>"), &frames[1..])
        .unwrap();
    let p = r.serialize(Some(&mut Inlining)).unwrap();

    let dir =
        std::env::temp_dir().join(format!("ferroprof-recorder-gopprof-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("profile.pb.gz");
    std::fs::write(&file, &p.encoded.bytes).unwrap();
    let file = file.to_str().unwrap();

    let raw = ferroprof_pprof::go_tool::pprof_for_tests(&go, &["-raw", file]);
    for want in [
        "cpu-time/nanoseconds",
        "heap-live-size/bytes",
        "timeline/nanoseconds",
        "go_visible_worker",
        "inlined_helper",
        "physical_caller",
        "worker-1",
        "GET /things",
        END_TIMESTAMP_LABEL,
    ] {
        assert!(
            raw.contains(want),
            "{want:?} missing from go tool pprof -raw:\n{raw}"
        );
    }
    let top =
        ferroprof_pprof::go_tool::pprof_for_tests(&go, &["-top", "-sample_index=cpu-time", file]);
    assert!(top.contains("inlined_helper"), "{top}");
    let heap = ferroprof_pprof::go_tool::pprof_for_tests(
        &go,
        &["-top", "-sample_index=heap-live-size", file],
    );
    assert!(
        heap.contains("go_visible_worker") && heap.contains("8kB"),
        "{heap}"
    );
    if std::env::var_os("FERROPROF_SHOW_GO_PPROF").is_some() {
        eprintln!("{raw}\n{top}\n{heap}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
