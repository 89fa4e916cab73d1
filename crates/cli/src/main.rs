fn main() {
    eprintln!("ferroprof: not yet implemented");
    std::process::exit(2);
}
