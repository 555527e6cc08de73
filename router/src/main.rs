//! `tandem-router`: the client-facing server of a disaggregated deployment. Flags, environment
//! and config file are parsed here; everything else lives in `tandem_router`.

use std::process::ExitCode;

use tandem_router::{Router, RouterArgs};
use tandem_serve::config::{init_logging, parse_args};

fn main() -> ExitCode {
    let args: RouterArgs = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("tandem-router: {:#}", anyhow::Error::from(e));
            return ExitCode::FAILURE;
        }
    };
    init_logging(args.log_format);
    let result = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(anyhow::Error::from)
        .and_then(|rt| rt.block_on(async { Router::new(args)?.run().await }).map_err(anyhow::Error::from));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tandem-router: {e:#}");
            ExitCode::FAILURE
        }
    }
}
