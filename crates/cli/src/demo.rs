//! `ferroprof demo` (placeholder until the profiler's builder lands).

/// Options of `ferroprof demo`.
#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// How long to run the workload, in seconds.
    #[arg(long, default_value_t = 5)]
    pub seconds: u64,
    /// Where to write the profiles (default: ./profiles).
    #[arg(long = "out", short = 'o')]
    pub out: Option<std::path::PathBuf>,
}

pub fn run(_args: DemoArgs) -> anyhow::Result<()> {
    Err(crate::report::CliError("demo needs the profiler, which is not built yet".into()).into())
}
