//! The process signals that drive the lifecycle: SIGTERM and SIGINT start the shutdown (a
//! second one means "stop now"), SIGHUP is logged and ignored (a sidecar has nothing to reload,
//! and as PID 1 it must not die of it).
//!
//! [`ShutdownSignals::install`] is the first thing `main` does, before configuration is read
//! or a socket bound: a signal that arrives while the proxy starts is kept, not lost.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures_util::StreamExt;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook_tokio::Signals;

pub struct ShutdownSignals {
    stream: Signals,
    /// Set by the signal handler itself the moment SIGTERM or SIGINT arrives, before the
    /// stream delivers it, so start-up can tell "a shutdown is already pending".
    arrived: Arc<AtomicBool>,
}

impl ShutdownSignals {
    /// Installs the handlers. Needs a Tokio runtime context.
    pub fn install() -> io::Result<ShutdownSignals> {
        // The stream first: a signal that arrives between the two registrations is then in
        // the stream (and acted on), only missing from the flag. The other order would set
        // the flag for a signal the stream never delivers, and start-up would wait for it.
        let stream = Signals::new([SIGTERM, SIGINT, SIGHUP])?;
        let arrived = Arc::new(AtomicBool::new(false));
        signal_hook::flag::register(SIGTERM, arrived.clone())?;
        signal_hook::flag::register(SIGINT, arrived.clone())?;
        Ok(ShutdownSignals { stream, arrived })
    }

    /// Whether SIGTERM or SIGINT has arrived since the handlers were installed.
    pub fn arrived(&self) -> bool {
        self.arrived.load(Ordering::Acquire)
    }

    /// The next SIGTERM or SIGINT, by number; SIGHUPs on the way are logged and skipped.
    pub async fn next(&mut self) -> i32 {
        loop {
            match self.stream.next().await {
                Some(SIGHUP) => tracing::info!(
                    "SIGHUP received and ignored: lameduck has no configuration to reload"
                ),
                Some(signal) => return signal,
                // The stream ends only when its handle is closed, which nothing does.
                None => std::future::pending::<()>().await,
            }
        }
    }
}
