//! Log output: `tracing` events to stderr, as plain text or JSON lines, filtered with
//! `RUST_LOG` syntax (CONTRACT section 6). Stdout stays free for commands that print data.

use std::io::IsTerminal;

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
