//! `ferroprof`: record any program (`record`), read and compare pprof files (top, flamegraph,
//! diff), run the demo.

mod attach;
mod demo;
mod embedded;
mod filter;
mod gzip_files;
mod record;
mod report;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use filter::FilterArgs;
use report::{CliError, FunctionTable};

/// The demo profiles this very process: allocations go through the sampling allocator, which
/// costs one relaxed load per allocation while no profiler runs (top, flamegraph, diff).
#[global_allocator]
static GLOBAL: ferroprof::SamplingAllocator<std::alloc::System> =
    ferroprof::SamplingAllocator::new(std::alloc::System);

#[derive(Parser)]
#[command(
    name = "ferroprof",
    version,
    about = "Profile any program (record: CPU, wall, allocations, live heap), read and compare \
             pprof profiles (top, flamegraph, diff), run the demo"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Refuse pprof files that are, or decompress to, more than SIZE (bytes, or with a K, M or
    /// G suffix in binary units). Bounds what a hostile or corrupt file can cost in memory.
    #[arg(
        long,
        global = true,
        value_name = "SIZE",
        default_value = "256M",
        value_parser = report::parse_size
    )]
    max_decompressed_size: u64,
}

#[derive(Subcommand)]
enum Command {
    /// Profile a built-in workload with a known CPU split and live heap, then report what was found.
    Demo(demo::DemoArgs),
    /// Run a program with ferroprof injected (LD_PRELOAD), without changing its code:
    /// `ferroprof record [OPTIONS] -- CMD [ARGS...]`. Exits with the program's status.
    Record(record::RecordArgs),
    /// Print the functions with the largest values for one sample type.
    Top {
        /// A pprof file (gzip-compressed or not).
        file: PathBuf,
        /// Sample type to show, e.g. cpu-time, wall-time, heap-live-size [default: the file's
        /// default_sample_type; without one, cpu-time or the first type with data].
        #[arg(short = 't', long = "type")]
        sample_type: Option<String>,
        /// Number of functions to show.
        #[arg(short = 'n', default_value_t = 20)]
        n: usize,
        /// Sort by cumulative instead of flat value.
        #[arg(long)]
        cum: bool,
        /// For allocation and heap types, charge flat values to leaf frames (inside the
        /// allocator) instead of the allocation site.
        #[arg(long)]
        raw: bool,
        #[command(flatten)]
        filter: FilterArgs,
    },
    /// Write an SVG flame graph of one sample type, as wide as the browser window.
    Flamegraph {
        file: PathBuf,
        /// Output SVG file.
        #[arg(short = 'o', long = "output", default_value = "flamegraph.svg")]
        output: PathBuf,
        /// Sample type to draw [default: the file's default_sample_type; without one,
        /// cpu-time or the first type with data].
        #[arg(short = 't', long = "type")]
        sample_type: Option<String>,
        #[command(flatten)]
        filter: FilterArgs,
    },
    /// Show per-function changes from profile A to profile B.
    Diff {
        a: PathBuf,
        b: PathBuf,
        /// Sample type to compare [default: B's default_sample_type; without one, cpu-time or
        /// the first type with data].
        #[arg(short = 't', long = "type")]
        sample_type: Option<String>,
        /// Number of functions to show.
        #[arg(short = 'n', default_value_t = 20)]
        n: usize,
        /// Compare rates: divide each profile's values by its duration (duration_nanos), so a
        /// 10 s profile and a 60 s one compare fairly. Values read per second. Not for
        /// snapshot types (heap-live-*), which are not summed over the duration.
        #[arg(long)]
        per_second: bool,
        #[command(flatten)]
        filter: FilterArgs,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        // The program's own exit status, whatever it is.
        Command::Record(args) => record::run(args).map(ExitCode::from),
        cmd => run(cmd, cli.max_decompressed_size).map(|()| ExitCode::SUCCESS),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            // Output closed early (`ferroprof top x | head`): not an error worth a message.
            if let Some(io) = e.downcast_ref::<std::io::Error>() {
                if io.kind() == std::io::ErrorKind::BrokenPipe {
                    return ExitCode::SUCCESS;
                }
            }
            if e.downcast_ref::<CliError>().is_some() {
                eprintln!("ferroprof: {e}");
            } else {
                eprintln!("ferroprof: {e:#}");
            }
            ExitCode::from(2)
        }
    }
}

fn run(cmd: Command, max_size: u64) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    let load = |path: &PathBuf| report::load_with_limit(path, max_size);
    // Loads a file and applies the filters; with filters, a line saying what they kept.
    let load_filtered = |path: &PathBuf, filter: &FilterArgs| {
        let mut p = load(path)?;
        let note = filter
            .apply(&mut p, path)?
            .map(|k| format!("{}: {} {}", path.display(), filter.describe(), k.summary()));
        anyhow::Ok((p, note))
    };
    match cmd {
        Command::Demo(args) => demo::run(args),
        Command::Record(_) => unreachable!("handled in main"),
        Command::Top {
            file,
            sample_type,
            n,
            cum,
            raw,
            filter,
        } => {
            let (p, note) = load_filtered(&file, &filter)?;
            let idx = report::pick_type(&p, sample_type.as_deref(), &file)?;
            let table = if raw {
                FunctionTable::build(&p, idx)
            } else {
                FunctionTable::build_sites(&p, idx)
            };
            if let Some(note) = note {
                writeln!(out, "{note}")?;
            }
            out.write_all(
                report::top_text(&table, n, cum, &file.display().to_string()).as_bytes(),
            )?;
            Ok(())
        }
        Command::Flamegraph {
            file,
            output,
            sample_type,
            filter,
        } => {
            let (p, note) = load_filtered(&file, &filter)?;
            let idx = report::pick_type(&p, sample_type.as_deref(), &file)?;
            let (type_name, unit) = p.sample_types().swap_remove(idx);
            let budget = report::folded_budget(max_size);
            let Some(lines) = report::folded_with_limit(&p, idx, budget) else {
                return Err(CliError(format!(
                    "{}: its folded stacks would take more than {} (a quarter of the \
                     --max-decompressed-size cap); if the file is trusted, raise the cap",
                    file.display(),
                    report::format_size(budget)
                ))
                .into());
            };
            if lines.is_empty() {
                let filtered = match &note {
                    Some(note) => format!(" ({note})"),
                    None => String::new(),
                };
                return Err(CliError(format!(
                    "{} has no samples with a positive {type_name} value{filtered}; nothing to draw",
                    file.display()
                ))
                .into());
            }
            let mut opts = inferno::flamegraph::Options::default();
            opts.title = format!("{type_name} — {}", file.display());
            opts.subtitle = filter.is_active().then(|| filter.describe());
            opts.count_name = unit;
            // No fixed width: the SVG is then fluid (see report::fit_svg_to_window).
            opts.image_width = None;
            let mut svg = Vec::new();
            inferno::flamegraph::from_lines(&mut opts, lines.iter().map(String::as_str), &mut svg)
                .map_err(|e| CliError(format!("cannot draw the flame graph: {e}")))?;
            // inferno writes UTF-8 (from Rust strings): the lossy conversion replaces nothing.
            let mut svg = String::from_utf8_lossy(&svg).into_owned();
            report::fit_svg_to_window(&mut svg);
            std::fs::write(&output, svg)
                .map_err(|e| CliError(format!("cannot write {}: {e}", output.display())))?;
            if let Some(note) = note {
                writeln!(out, "{note}")?;
            }
            writeln!(
                out,
                "wrote {} ({} stacks of {type_name})",
                output.display(),
                lines.len()
            )?;
            Ok(())
        }
        Command::Diff {
            a,
            b,
            sample_type,
            n,
            per_second,
            filter,
        } => {
            let (pa, note_a) = load_filtered(&a, &filter)?;
            let (pb, note_b) = load_filtered(&b, &filter)?;
            let ib = report::pick_type(&pb, sample_type.as_deref(), &b)?;
            let name = pb.sample_types().swap_remove(ib).0;
            let ia = report::pick_type(&pa, Some(&name), &a)?;
            let (ta, tb) = (
                FunctionTable::build_sites(&pa, ia),
                FunctionTable::build_sites(&pb, ib),
            );
            if ta.unit != tb.unit {
                return Err(CliError(format!(
                    "{name} is in {} in {} but in {} in {}",
                    ta.unit,
                    a.display(),
                    tb.unit,
                    b.display()
                ))
                .into());
            }
            let rates = if per_second {
                if report::is_snapshot_type(&name) {
                    return Err(CliError(format!(
                        "--per-second does not apply to {name}: it is a snapshot at the end of \
                         each profile, not a sum over its duration; compare it without"
                    ))
                    .into());
                }
                Some((duration_secs(&pa, &a)?, duration_secs(&pb, &b)?))
            } else {
                if let Some(hint) = duration_hint(&pa, &pb, &name) {
                    eprintln!("ferroprof: {hint}");
                }
                None
            };
            for note in [note_a, note_b].into_iter().flatten() {
                writeln!(out, "{note}")?;
            }
            out.write_all(report::diff_text_with(&ta, &tb, n, rates).as_bytes())?;
            Ok(())
        }
    }
}

/// The seconds a profile covers, for `diff --per-second`.
fn duration_secs(p: &ferroprof_pprof::Profile, path: &std::path::Path) -> anyhow::Result<f64> {
    if p.duration_nanos <= 0 {
        return Err(CliError(format!(
            "{} does not say how long it covers (duration_nanos is {}); --per-second needs it",
            path.display(),
            p.duration_nanos
        ))
        .into());
    }
    Ok(p.duration_nanos as f64 / 1e9)
}

/// A note when A and B cover clearly different durations and totals are compared as they are:
/// the change then reads as the ratio of the durations.
fn duration_hint(
    a: &ferroprof_pprof::Profile,
    b: &ferroprof_pprof::Profile,
    type_name: &str,
) -> Option<String> {
    let (da, db) = (a.duration_nanos, b.duration_nanos);
    if da <= 0 || db <= 0 || report::is_snapshot_type(type_name) {
        return None;
    }
    let ratio = da.max(db) as f64 / da.min(db) as f64;
    (ratio > 1.1).then(|| {
        format!(
            "note: A covers {} and B {}; totals differ by that alone. --per-second compares rates.",
            report::format_value(da, "nanoseconds"),
            report::format_value(db, "nanoseconds")
        )
    })
}
