//! Function names and mappings in written profiles, at the debug levels services ship with.
//!
//! `fixtures/names_fixture.rs` is compiled with rustc against ferroprof (built once into a
//! private target directory) with `-C debuginfo=line-tables-only` and with `-C debuginfo=1`;
//! each build profiles itself into a directory. Its file must name the fixture's functions fully
//! qualified (line-tables-only DWARF names them `encode` and `spin` only), with their mangled
//! names, and map its locations to the fixture's file and build id: read by the independent
//! decoder, and by `go tool pprof -raw`, which must not warn "Main binary filename not
//! available".

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use ferroprof_pprof::{decode, Profile};

const ENCODE: &str = "<names_fixture::codec::Rle as names_fixture::codec::Codec>::encode";
const SPIN: &str = "names_fixture::work::Spinner::spin";

fn fixture_source() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/names_fixture.rs")
}

/// ferroprof's rlib and its dependencies, built once for all tests of this binary into a
/// target directory of their own (the workspace's is locked by the `cargo test` running us).
fn ferroprof_rlib() -> &'static (PathBuf, PathBuf) {
    static BUILT: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    BUILT.get_or_init(|| {
        let target = Path::new(env!("CARGO_TARGET_TMPDIR")).join("names-fixture-target");
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let out = Command::new(cargo)
            .args([
                "build",
                "--offline",
                "-p",
                "ferroprof",
                "--lib",
                "--manifest-path",
            ])
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
            .arg("--target-dir")
            .arg(&target)
            .output()
            .expect("cargo runs");
        assert!(
            out.status.success(),
            "building ferroprof for the fixture failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let debug = target.join("debug");
        (debug.join("libferroprof.rlib"), debug.join("deps"))
    })
}

/// Compiles the fixture at `debuginfo` (optimized, as released code is) into `dir`.
fn build_fixture(debuginfo: &str, dir: &Path) -> PathBuf {
    let (rlib, deps) = ferroprof_rlib();
    let exe = dir.join("names_fixture");
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let out = Command::new(rustc)
        .args(["--edition", "2021", "--crate-type", "bin", "--crate-name"])
        .arg("names_fixture")
        .args(["-C", "opt-level=2", "-C"])
        .arg(format!("debuginfo={debuginfo}"))
        .arg("-L")
        .arg(format!("dependency={}", deps.display()))
        .arg("--extern")
        .arg(format!("ferroprof={}", rlib.display()))
        .arg("-o")
        .arg(&exe)
        .arg(fixture_source())
        .output()
        .expect("rustc runs");
    assert!(
        out.status.success(),
        "compiling the fixture failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

/// What one run of the fixture wrote.
struct Run {
    dir: PathBuf,
    exe: PathBuf,
    file: PathBuf,
    profile: Profile,
}

impl Run {
    /// Removes the build and its profile (left behind when a check fails, to look at).
    fn clean(self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn run_fixture(debuginfo: &str) -> Run {
    let dir = std::env::temp_dir().join(format!(
        "ferroprof-names-{}-{}",
        debuginfo,
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let profiles = dir.join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let exe = build_fixture(debuginfo, &dir);
    let out = Command::new(&exe)
        .arg(&profiles)
        .output()
        .expect("the fixture runs");
    assert!(
        out.status.success(),
        "the fixture failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let files: Vec<PathBuf> = std::fs::read_dir(&profiles)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "pprof"))
        .collect();
    assert_eq!(files.len(), 1, "one profile, at stop: {files:?}");
    let profile = decode(&std::fs::read(&files[0]).unwrap()).expect("the profile decodes");
    Run {
        dir,
        exe: std::fs::canonicalize(&exe).unwrap(),
        file: files[0].clone(),
        profile,
    }
}

/// The line the fixture's function `fn NAME(` is declared at (the last: a trait's declaration
/// comes before the impl).
fn declared_line(name: &str) -> i64 {
    let src = std::fs::read_to_string(fixture_source()).unwrap();
    let lines: Vec<&str> = src.lines().collect();
    let at = lines
        .iter()
        .rposition(|l| l.contains(&format!("fn {name}(")))
        .expect("the fixture declares it");
    at as i64 + 1
}

/// The GNU build id of `exe`, in hex.
fn build_id(exe: &Path) -> String {
    use object::Object;
    let data = std::fs::read(exe).unwrap();
    let file = object::File::parse(&*data).unwrap();
    let id = file
        .build_id()
        .unwrap()
        .expect("rustc's binaries have a build id");
    id.iter().map(|b| format!("{b:02x}")).collect()
}

/// The executable segments of `exe`: page-aligned (file offset, size in memory).
fn code_segments(exe: &Path) -> Vec<(u64, u64)> {
    use object::{Object, ObjectSegment, SegmentFlags};
    let data = std::fs::read(exe).unwrap();
    let file = object::File::parse(&*data).unwrap();
    file.segments()
        .filter(|s| matches!(s.flags(), SegmentFlags::Elf { p_flags } if p_flags & 1 != 0))
        .map(|s| {
            let lead = s.address() % 4096;
            let size = (s.address() + s.size()).next_multiple_of(4096) - (s.address() - lead);
            (s.file_range().0 - lead, size)
        })
        .collect()
}

/// Sum of `value` over samples whose stack has a frame named exactly `function`.
fn total_in(p: &Profile, value: &str, function: &str) -> i64 {
    let i = p
        .value_index(value)
        .unwrap_or_else(|| panic!("no {value} in {:?}", p.sample_types()));
    p.sample
        .iter()
        .filter(|s| p.stack(s).iter().any(|l| l.function == function))
        .map(|s| s.value[i])
        .sum()
}

/// Checks the profile of one build: names, system names, start lines, mappings.
fn check(run: &Run, debuginfo: &str) {
    let p = &run.profile;
    let names: Vec<&str> = p.function.iter().map(|f| p.str(f.name)).collect();
    // Fully qualified: DWARF's short names never stand alone.
    for short in ["encode", "spin"] {
        assert!(
            !names.contains(&short),
            "{debuginfo}: a function named only {short:?}: {names:?}"
        );
    }
    assert!(
        total_in(p, "cpu-time", SPIN) > 0,
        "{debuginfo}: no CPU in {SPIN}: {names:?}"
    );
    assert!(
        total_in(p, "alloc-samples", ENCODE) > 0,
        "{debuginfo}: no allocation in {ENCODE}: {names:?}"
    );
    for (name, short) in [(ENCODE, "encode"), (SPIN, "spin")] {
        let f = p
            .function
            .iter()
            .find(|f| p.str(f.name) == name)
            .unwrap_or_else(|| panic!("{debuginfo}: no function {name}: {names:?}"));
        let system = p.str(f.system_name);
        // The linkage name: Rust's legacy (`_ZN...E`) or v0 (`_R...`) mangling of that path.
        assert!(
            (system.starts_with("_ZN") || system.starts_with("_R"))
                && system.contains(short)
                && system.contains("names_fixture"),
            "{debuginfo}: {name}'s system name is {system:?}"
        );
        assert!(
            p.str(f.filename).ends_with("names_fixture.rs"),
            "{debuginfo}: {name} in {:?}",
            p.str(f.filename)
        );
        // line-tables-only DWARF has no declaration lines; debug = 1 has.
        let want = declared_line(short);
        match debuginfo {
            "1" => assert_eq!(f.start_line, want, "{debuginfo}: {name}'s start line"),
            _ => assert!(
                f.start_line == 0 || f.start_line == want,
                "{debuginfo}: {name}'s start line {}",
                f.start_line
            ),
        }
    }

    // One mapping per object, the fixture's first, with its file and build id.
    assert!(!p.mapping.is_empty(), "{debuginfo}: no mapping");
    let main = &p.mapping[0];
    assert_eq!(
        p.str(main.filename),
        run.exe.to_string_lossy(),
        "{debuginfo}"
    );
    assert_eq!(p.str(main.build_id), build_id(&run.exe), "{debuginfo}");
    assert!(
        main.has_functions && main.has_filenames && main.has_line_numbers && main.has_inline_frames,
        "{debuginfo}: {main:?}"
    );
    let size = main.memory_limit - main.memory_start;
    assert!(
        code_segments(&run.exe).contains(&(main.file_offset, size)),
        "{debuginfo}: {main:?} is not a code segment of the file: {:?}",
        code_segments(&run.exe)
    );
    let mut ids: Vec<u64> = p.mapping.iter().map(|m| m.id).collect();
    ids.dedup();
    assert_eq!(ids, (1..=p.mapping.len() as u64).collect::<Vec<_>>());
    let mut starts: Vec<u64> = p.mapping.iter().map(|m| m.memory_start).collect();
    starts.sort_unstable();
    starts.dedup();
    assert_eq!(
        starts.len(),
        p.mapping.len(),
        "{debuginfo}: one mapping per object"
    );
    // Every address location links to the mapping holding it (the fixture's functions to the
    // fixture's), none to one that does not.
    let mut linked = 0;
    for l in p.location.iter().filter(|l| l.address != 0) {
        let holder = p
            .mapping
            .iter()
            .find(|m| m.memory_start <= l.address && l.address < m.memory_limit);
        assert_eq!(
            l.mapping_id,
            holder.map_or(0, |m| m.id),
            "{debuginfo}: location {l:?}"
        );
        let ours = l.line.iter().any(|line| {
            [ENCODE, SPIN].iter().any(|n| {
                p.function
                    .iter()
                    .any(|f| f.id == line.function_id && p.str(f.name) == *n)
            })
        });
        if ours {
            assert_eq!(l.mapping_id, main.id, "{debuginfo}: {l:?}");
            linked += 1;
        }
    }
    assert!(
        linked > 0,
        "{debuginfo}: no location of the fixture's functions"
    );
    // libc's code shows up too (the profiler's own threads wait in it), in a mapping of its own.
    assert!(
        p.mapping
            .iter()
            .any(|m| p.str(m.filename).contains("libc.so")),
        "{debuginfo}: no mapping for libc: {:?}",
        p.mapping
            .iter()
            .map(|m| p.str(m.filename))
            .collect::<Vec<_>>()
    );
}

/// `go tool pprof ARGS` as `ferroprof_pprof::go_tool` runs it, keeping stderr (where pprof
/// warns): (stdout, stderr).
fn go_pprof(go: &Path, args: &[&str]) -> (String, String) {
    let tmp = std::env::temp_dir().join(format!("ferroprof-gopprof-names-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let out = Command::new(go)
        .args(["tool", "pprof"])
        .args(args)
        .env("PPROF_TMPDIR", &tmp)
        .env("HOME", &tmp)
        .env("GOCACHE", tmp.join("gocache"))
        .env("GOFLAGS", "")
        .output()
        .expect("go runs");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(
        out.status.success(),
        "go tool pprof {args:?}: {stderr}\n{stdout}"
    );
    (stdout, stderr)
}

/// `go tool pprof` reads the mappings: no warning, the fixture's mapping listed with its file,
/// build id and flags, the fixture's locations in it, the names qualified.
fn check_with_go(run: &Run, debuginfo: &str) {
    let Some(go) = ferroprof_pprof::go_tool::go_for_tests() else {
        return;
    };
    let file = run.file.to_str().unwrap();
    let (raw, err) = go_pprof(&go, &["-raw", file]);
    assert!(
        !err.contains("Main binary filename not available"),
        "{debuginfo}: go tool pprof warns: {err}"
    );
    let mappings = raw
        .split("\nMappings\n")
        .nth(1)
        .unwrap_or_else(|| panic!("{debuginfo}: no Mappings in -raw:\n{raw}"));
    let exe = run.exe.to_str().unwrap();
    let id = build_id(&run.exe);
    let line = mappings
        .lines()
        .find(|l| l.contains(exe))
        .unwrap_or_else(|| {
            panic!("{debuginfo}: the fixture is not among the mappings:\n{mappings}")
        });
    assert!(
        line.starts_with("1: ") && line.contains(&id) && line.contains("[FN][FL][LN][IN]"),
        "{debuginfo}: {line}"
    );
    // The fixture's functions, in locations of mapping 1, with their system names.
    let encode = raw
        .lines()
        .find(|l| l.contains(ENCODE))
        .unwrap_or_else(|| panic!("{debuginfo}: {ENCODE} not in -raw:\n{raw}"));
    assert!(
        encode.contains("(_"),
        "{debuginfo}: no system name: {encode}"
    );
    let spin = raw
        .lines()
        .find(|l| l.contains(SPIN) && l.contains(" M="))
        .unwrap_or_else(|| panic!("{debuginfo}: no location line of {SPIN} in -raw:\n{raw}"));
    assert!(spin.contains(" M=1 "), "{debuginfo}: {spin}");
    let (top, err) = go_pprof(&go, &["-top", "-sample_index=cpu-time", file]);
    assert!(
        !err.contains("Main binary filename not available"),
        "{debuginfo}: {err}"
    );
    assert!(
        top.contains(SPIN),
        "{debuginfo}: {SPIN} not in -top:\n{top}"
    );
}

#[test]
fn line_tables_only_names_are_fully_qualified_and_mapped() {
    let run = run_fixture("line-tables-only");
    check(&run, "line-tables-only");
    check_with_go(&run, "line-tables-only");
    run.clean();
}

#[test]
fn limited_debug_info_names_are_fully_qualified_and_mapped() {
    let run = run_fixture("1");
    check(&run, "1");
    check_with_go(&run, "1");
    run.clean();
}
