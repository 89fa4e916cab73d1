//! Instructions a span's enter + exit costs with and without `FerroprofLayer`, for callgrind
//! (timings on a shared machine are too noisy for a difference of nanoseconds):
//!
//! ```text
//! cargo build --release -p ferroprof --features tracing --example span_cost
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null target/release/examples/span_cost layer 1000000
//! ```
//!
//! Run with N and with 0 and divide the difference by N; `plain` is the registry alone.

use tracing_subscriber::layer::SubscriberExt;

fn run(n: u64) {
    let root = tracing::info_span!("request", http.route = "/users/{id}");
    let child = root.in_scope(|| tracing::info_span!("handler"));
    let _r = root.enter();
    for _ in 0..n {
        let _e = std::hint::black_box(&child).enter();
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (Some(mode), Some(n)) = (args.next(), args.next().and_then(|n| n.parse().ok())) else {
        eprintln!("usage: span_cost layer|plain N");
        std::process::exit(2);
    };
    match mode.as_str() {
        "layer" => tracing::subscriber::with_default(
            tracing_subscriber::registry().with(ferroprof::tracing::FerroprofLayer::new()),
            || run(n),
        ),
        "plain" => tracing::subscriber::with_default(tracing_subscriber::registry(), || run(n)),
        m => {
            eprintln!("span_cost: mode is layer or plain, not {m:?}");
            std::process::exit(2);
        }
    }
}
