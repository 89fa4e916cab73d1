use criterion::{criterion_group, criterion_main, Criterion};
use libdd_profiling::api;
use std::hint::black_box;

fn frames_owned() -> Vec<(String, String, i64)> {
    (0..18)
        .map(|i| {
            (
                format!("my_crate::module_{i}::SomeType::some_function_{i}"),
                format!("/src/my_crate/src/module_{i}.rs"),
                10 + i as i64,
            )
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let fr = frames_owned();
    let types: Vec<api::ValueType> = ["a", "b", "c", "d", "e", "f", "g", "h"]
        .iter()
        .map(|t| api::ValueType::new(t, "count"))
        .collect();
    let mut p = libdd_profiling::internal::Profile::try_new(&types, None).unwrap();
    let values = [1i64, 2, 3, 4, 5, 6, 7, 8];
    c.bench_function("libdd add 18 frames", |b| {
        b.iter(|| {
            let locations = fr
                .iter()
                .map(|(n, f, l)| api::Location {
                    function: api::Function { name: n, system_name: "", filename: f },
                    line: *l,
                    ..Default::default()
                })
                .collect();
            let s = api::Sample {
                locations,
                values: &values,
                labels: vec![
                    api::Label { key: "thread id", num: 7, ..Default::default() },
                    api::Label { key: "thread name", str: "main", ..Default::default() },
                ],
            };
            p.try_add_sample(black_box(s), None).unwrap();
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(2)).warm_up_time(std::time::Duration::from_millis(500));
    targets = bench
}
criterion_main!(benches);
