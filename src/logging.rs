//! Log output: `tracing` events to stderr, as plain text or JSON lines, filtered with
//! `RUST_LOG` syntax (docs/admin.md). Stdout stays free for commands that print data.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

/// Installs the global subscriber. The filter was validated with the configuration.
pub fn init(filter: &str, format: LogFormat) {
    let filter = EnvFilter::builder().parse_lossy(filter);
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let _ = match format {
        LogFormat::Plain => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// At most one log line per interval about a condition that may repeat thousands of times a
/// second (out of file descriptors, at the connection limit); counts the ones held back.
#[derive(Debug)]
pub struct Throttle {
    interval: Duration,
    last: Option<Instant>,
    suppressed: u64,
}

impl Throttle {
    pub fn new(interval: Duration) -> Throttle {
        Throttle {
            interval,
            last: None,
            suppressed: 0,
        }
    }

    /// `Some(lines held back since the last one)` when a line may be logged now.
    pub fn due(&mut self) -> Option<u64> {
        if self.last.is_some_and(|last| last.elapsed() < self.interval) {
            self.suppressed += 1;
            return None;
        }
        self.last = Some(Instant::now());
        Some(std::mem::take(&mut self.suppressed))
    }
}
