//! `tandem-prefill`: a server binary of the disaggregated deployment.
//!
//! Not implemented yet: the engine currently runs in one process through `tandem generate`.
//! This binary exits with a clear message instead of pretending to serve.

fn main() {
    eprintln!("tandem-prefill: not implemented yet; use `tandem generate` to run the engine in one process");
    std::process::exit(2);
}
