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
    /// Holds SIGTERM, SIGINT and SIGHUP pending (blocked) in the calling thread and in every
    /// thread it starts afterwards. Called first thing in `main`, before the runtime starts its
    /// threads: a signal that arrives before the handlers are complete waits instead of being
    /// lost (signal-hook installs its handler before it records what the handler must do, and
    /// PID 1 drops signals it has no handler for). [`ShutdownSignals::install`] releases them.
    pub fn hold() {
        set_mask(libc::SIG_BLOCK);
    }

    /// Installs the handlers, then releases the signals held by [`ShutdownSignals::hold`] in
    /// this thread, which receives any that arrived meanwhile. Needs a Tokio runtime context.
    pub fn install() -> io::Result<ShutdownSignals> {
        let stream = Signals::new([SIGTERM, SIGINT, SIGHUP])?;
        let arrived = Arc::new(AtomicBool::new(false));
        signal_hook::flag::register(SIGTERM, arrived.clone())?;
        signal_hook::flag::register(SIGINT, arrived.clone())?;
        set_mask(libc::SIG_UNBLOCK);
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

/// Blocks or unblocks SIGTERM, SIGINT and SIGHUP for the calling thread.
fn set_mask(how: libc::c_int) {
    // SAFETY: the set is initialised by sigemptyset before use, and pthread_sigmask only reads
    // it; a null old-set pointer is allowed.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for signal in [SIGTERM, SIGINT, SIGHUP] {
            libc::sigaddset(&mut set, signal);
        }
        libc::pthread_sigmask(how, &set, std::ptr::null_mut());
    }
}
