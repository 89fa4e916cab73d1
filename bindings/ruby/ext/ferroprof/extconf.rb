# frozen_string_literal: true

# Builds the extension with cargo when the gem is installed (`gem install ferroprof-*.gem`, or
# Bundler with a `path:`/`gem` line): writes a Makefile whose `all` runs cargo on the gem's
# crate (src/, with the repository's crates vendored under vendor/) and whose `install` puts the
# library where `require "ferroprof/ferroprof_ruby"` finds it.
#
# Needs: cargo (Rust 1.85 or newer) and libclang (rb-sys generates Ruby's bindings with it).
# CARGO_TARGET_DIR, when set, is used as cargo's build directory (and kept); otherwise a
# directory under this one is used and removed after install.
require "rbconfig"
require "fileutils"

gem_root = File.expand_path("../..", __dir__)
cargo = ENV.fetch("CARGO", "cargo")
version = `#{cargo} --version 2>&1`
unless $?&.success?
  abort "ferroprof: cargo not found (#{cargo}): install Rust (https://rustup.rs) and retry; " \
        "the extension is compiled on install"
end
warn "ferroprof: building the extension with #{version.strip} (a minute or two the first time)"

vendored = %w[ferroprof-recorder ferroprof-export].to_h { |c| [c, File.join(gem_root, "vendor", c)] }
vendored.each_value do |path|
  next if File.exist?(File.join(path, "Cargo.toml"))

  abort "ferroprof: #{path} is missing: build the gem with `gem build ferroprof.gemspec` " \
        "from bindings/ruby of the ferroprof repository (it vendors the crates it needs)"
end

# The crate's manifest, pointed at the vendored crates and at the gem's sources. Vendored
# crates name each other by version (as `cargo package` wrote them): [patch] points those back.
manifest = File.read(File.join(gem_root, "Cargo.toml"))
vendored.each do |name, path|
  manifest = manifest.sub(/^#{name} = \{ path = "[^"]*" \}$/, %(#{name} = { path = "#{path}" }))
end
manifest = manifest.sub(/^\[lib\]$/, %([lib]\npath = "#{File.join(gem_root, 'src', 'lib.rs')}"))
manifest += "\n[patch.crates-io]\n" + vendored.map { |name, path| %(#{name} = { path = "#{path}" }\n) }.join
build = File.expand_path("build", __dir__)
FileUtils.mkdir_p(build)
File.write(File.join(build, "Cargo.toml"), manifest)
FileUtils.cp(File.join(gem_root, "Cargo.lock"), File.join(build, "Cargo.lock"))

own_target = ENV["CARGO_TARGET_DIR"].to_s.empty?
target = own_target ? File.join(build, "target") : File.expand_path(ENV["CARGO_TARGET_DIR"])
dlext = RbConfig::CONFIG["DLEXT"]
File.write("Makefile", <<~MAKE)
  # Written by extconf.rb: cargo builds the extension; install copies it into sitearchdir.
  sitearchdir = #{RbConfig::CONFIG['sitearchdir']}
  CARGO = #{cargo}
  TARGET_DIR = #{target}

  all:
  \tCARGO_TARGET_DIR="$(TARGET_DIR)" $(CARGO) build --release --manifest-path "#{build}/Cargo.toml"

  install: all
  \tmkdir -p "$(DESTDIR)$(sitearchdir)/ferroprof"
  \tcp "$(TARGET_DIR)/release/libferroprof_ruby.so" "$(DESTDIR)$(sitearchdir)/ferroprof/ferroprof_ruby.#{dlext}"
  #{own_target ? "\trm -rf \"#{target}\"" : "\t@true"}

  clean:
  \t@true

  .PHONY: all install clean
MAKE
