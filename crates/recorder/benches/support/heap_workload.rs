//! The heap serialize comparison's workload, shared by the heap bench and the
//! `heap_serialize` driver so both measure exactly the same thing: 100k live objects whose
//! stacks share their callers and differ in the innermost frame, and the profile that holds
//! the same 100k samples already aggregated.

use std::time::SystemTime;

use ferroprof_recorder::stack_recorder::GC_GEN_AGE_LABEL;
use ferroprof_recorder::{
    Frame, HeapConfig, Label, Profile, RecorderConfig, Sample, SampleValues, StackRecorder,
};

pub const LIVE: u64 = 100_000;
pub const DEPTH: u64 = 16;

/// Object `i`'s stack: shared callers, a distinct innermost frame, so the heap profile has as
/// many samples as live objects.
pub fn distinct_stack(i: u64, out: &mut Vec<Frame<'static>>) {
    out.clear();
    out.push(Frame::Address(0x7f00_0000_0000 + i * 16));
    out.extend((1..DEPTH).map(|d| Frame::Address(0x5555_0000_0000 + d * 0x40)));
}

/// A recorder (native heap) tracking the [`LIVE`] objects.
pub fn loaded_recorder() -> StackRecorder {
    let r = StackRecorder::new(RecorderConfig {
        heap: HeapConfig::native(),
        ..RecorderConfig::default()
    })
    .unwrap();
    let mut frames = Vec::new();
    for i in 0..LIVE {
        distinct_stack(i, &mut frames);
        r.track_allocation(0x1000_0000 + i * 64, 1, 64, None, &frames)
            .unwrap();
    }
    r
}

/// A profile with `r`'s sample types holding the heap samples of [`loaded_recorder`], added
/// one by one.
pub fn aggregated_profile(r: &StackRecorder) -> Profile {
    let layout = r.layout();
    let placed = layout.place(&SampleValues {
        heap_live_samples: 1,
        heap_live_size: 64,
        ..SampleValues::default()
    });
    let mut p = Profile::new(layout.types(), None, SystemTime::now());
    let labels = [Label::num(GC_GEN_AGE_LABEL, 1)];
    let mut frames = Vec::new();
    for i in 0..LIVE {
        distinct_stack(i, &mut frames);
        p.add(&Sample {
            frames: &frames,
            values: &placed[..layout.len()],
            labels: &labels,
            end_timestamp_ns: 0,
        })
        .unwrap();
    }
    p
}
