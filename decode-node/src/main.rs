//! `tandem-decode`: the decode worker. Parses flags (and `--config FILE`), then serves; the logic
//! is in `tandem_decode`. Exits 1 with a message on bad flags, an unusable model
//! or a refused registration, and 0 after a drain on SIGTERM/SIGINT.

use std::process::ExitCode;

use tandem_decode::{run, DecodeArgs};
use tandem_serve::config::parse_args;

fn main() -> ExitCode {
    let args = match parse_args::<DecodeArgs>() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("tandem-decode: {:#}", anyhow::Error::from(e));
            return ExitCode::from(1);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tandem-decode: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // With its causes: `binding --listen ...: Address already in use`.
            let e = anyhow::Error::from(e);
            eprintln!("tandem-decode: {e:#}");
            ExitCode::from(1)
        }
    }
}
