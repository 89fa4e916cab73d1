# frozen_string_literal: true

# `gem build ferroprof.gemspec` in bindings/ruby of the ferroprof repository packages the
# extension's sources with the recorder crate vendored under vendor/ (made here with `cargo
# package`, which resolves the workspace's inherited fields); `gem install ferroprof-*.gem`
# then compiles it with cargo (ext/ferroprof/extconf.rb).
root = __dir__
repo = File.expand_path("../..", root)
# The repository's crates the extension uses, vendored under vendor/ as `cargo package` writes
# them (path dependencies between them become version dependencies there; extconf.rb points
# them back at vendor/ with [patch.crates-io]).
CRATES = %w[ferroprof-recorder ferroprof-export].freeze
if File.exist?(File.join(repo, "crates", "recorder", "Cargo.toml"))
  require "fileutils"
  require "tmpdir"
  Dir.mktmpdir("ferroprof-vendor") do |tmp|
    args = CRATES.flat_map { |c| ["-p", c] }
    ok = system("cargo", "package", "-q", *args, "--no-verify", "--allow-dirty", "--exclude-lockfile",
                "--target-dir", tmp, chdir: repo)
    raise "ferroprof.gemspec: `cargo package #{args.join(' ')}` failed" unless ok

    CRATES.each do |name|
      crate = Dir[File.join(tmp, "package", "#{name}-*.crate")].first
      raise "ferroprof.gemspec: cargo package made no #{name} crate" unless crate

      vendored = File.join(root, "vendor", name)
      FileUtils.rm_rf(vendored)
      FileUtils.mkdir_p(vendored)
      system("tar", "xzf", crate, "--strip-components=1", "-C", vendored, exception: true)
      # Only what the library needs (no tests, benches or examples).
      %w[tests benches examples .cargo_vcs_info.json Cargo.toml.orig].each do |f|
        FileUtils.rm_rf(File.join(vendored, f))
      end
      manifest = File.join(vendored, "Cargo.toml")
      text = File.read(manifest)
      # Sections only the repository's own tests, benches and examples use.
      text = text.gsub(/^\[(?:\[(?:example|test|bench)\]|(?:target\.[^\]]*\.)?dev-dependencies[^\]]*)\]\n(?:[^\[\n][^\n]*\n)*\n?/, "")
      File.write(manifest, text)
    end
  end
end

Gem::Specification.new do |spec|
  spec.name = "ferroprof"
  spec.version = "0.1.0"
  spec.summary = "A Ruby profiler on ferroprof-recorder (Rust): CPU, allocation and live-heap profiles in pprof"
  spec.description = <<~DESC
    The stack and heap recorders of ferroprof-recorder as a Ruby extension written in Rust
    (magnus/rb-sys), and a sampling profiler on top of them that writes pprof files.
    Installing compiles the extension: it needs cargo (Rust 1.85+) and libclang.
  DESC
  spec.license = "Apache-2.0"
  spec.authors = ["ferroprof contributors"]
  spec.homepage = "https://example.invalid/ferroprof"
  spec.required_ruby_version = ">= 3.1"
  spec.files = Dir.chdir(root) do
    Dir["lib/**/*.rb", "src/**/*.rs", "ext/ferroprof/extconf.rb", "vendor/**/*",
        "Cargo.toml", "Cargo.lock", "README.md", "ferroprof.gemspec"].reject { |f| File.directory?(f) }
  end
  spec.require_paths = ["lib"]
  spec.extensions = ["ext/ferroprof/extconf.rb"]
end
