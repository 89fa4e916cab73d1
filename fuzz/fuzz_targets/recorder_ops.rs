#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = ferroprof_fuzz::recorder_ops::run(data);
});
