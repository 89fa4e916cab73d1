# frozen_string_literal: true

Gem::Specification.new do |spec|
  spec.name = "ferroprof"
  spec.version = "0.1.0"
  spec.summary = "A Ruby profiler on ferroprof-recorder (Rust): CPU, allocation and live-heap profiles in pprof"
  spec.description = <<~DESC
    The stack and heap recorders of ferroprof-recorder as a Ruby extension written in Rust
    (magnus/rb-sys), and a sampling profiler on top of them that writes pprof files.
  DESC
  spec.license = "Apache-2.0"
  spec.authors = ["ferroprof contributors"]
  spec.homepage = "https://example.invalid/ferroprof"
  spec.required_ruby_version = ">= 3.1"
  spec.files = Dir["lib/**/*.rb", "src/**/*.rs", "Cargo.toml", "Cargo.lock", "README.md", "ferroprof.gemspec"]
  spec.require_paths = ["lib"]
  # Built with cargo against the running Ruby's headers; the gem needs the ferroprof-recorder
  # crate beside it (../../crates/recorder). scripts/ruby-binding.sh builds it in the repository.
  spec.extensions = []
end
