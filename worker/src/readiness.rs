//! The readiness decision of a worker, as a pure function of what it depends on at one instant
//! ([`ReadyInputs`]), so every case is tested without a server or an engine.

use std::time::Duration;

/// What readiness checks besides the engine and the drain.
#[derive(Debug, Clone, Copy)]
pub struct ReadinessOptions {
    /// The worker registers with a router (`--router`): not ready until it has.
    pub needs_registration: bool,
    /// An engine with work that finished no step for this long is wedged (`--ready-stall-ms`).
    pub stall: Duration,
}

/// Everything readiness depends on, at one instant.
#[derive(Debug, Clone, Copy)]
pub struct ReadyInputs {
    /// The model is loaded and the servers are up.
    pub serving: bool,
    /// Registered with the router, or none to register with.
    pub registered: bool,
    pub draining: bool,
    /// The engine has work it should be stepping.
    pub has_work: bool,
    /// Since the engine's last progress (see `EngineSnapshot::progress_at`).
    pub since_progress: Duration,
    /// `--ready-stall-ms`.
    pub stall: Duration,
}

/// The readiness decision: Ok, or why not.
pub fn readiness(i: &ReadyInputs) -> Result<(), String> {
    if !i.serving {
        return Err("starting: the model is loading".into());
    }
    if i.draining {
        return Err("draining: shutting down".into());
    }
    if !i.registered {
        return Err("not registered with the router yet".into());
    }
    if i.has_work && i.since_progress > i.stall {
        return Err(format!(
            "engine wedged: it has work but finished no step for {} ms (--ready-stall-ms {})",
            i.since_progress.as_millis(),
            i.stall.as_millis()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs() -> ReadyInputs {
        ReadyInputs {
            serving: true,
            registered: true,
            draining: false,
            has_work: true,
            since_progress: Duration::from_millis(10),
            stall: Duration::from_millis(30_000),
        }
    }

    #[test]
    fn readiness_needs_serving_registered_not_draining_and_progress() {
        assert_eq!(readiness(&inputs()), Ok(()));
        let e = readiness(&ReadyInputs { serving: false, ..inputs() }).unwrap_err();
        assert!(e.contains("loading"), "{e}");
        let e = readiness(&ReadyInputs { registered: false, ..inputs() }).unwrap_err();
        assert!(e.contains("not registered"), "{e}");
        let e = readiness(&ReadyInputs { draining: true, ..inputs() }).unwrap_err();
        assert!(e.contains("draining"), "{e}");
        // Wedged: work, and no step for longer than the stall limit.
        let wedged = ReadyInputs { since_progress: Duration::from_millis(30_001), ..inputs() };
        let e = readiness(&wedged).unwrap_err();
        assert!(e.contains("wedged") && e.contains("30001 ms"), "{e}");
        // Exactly at the limit is still fine; an idle engine is never wedged.
        assert_eq!(
            readiness(&ReadyInputs { since_progress: Duration::from_millis(30_000), ..inputs() }),
            Ok(())
        );
        assert_eq!(readiness(&ReadyInputs { has_work: false, ..wedged }), Ok(()));
    }
}
