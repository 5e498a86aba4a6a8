//! The `lameduck` binary: install the signal handlers, parse the command line, dispatch.
//! Exit statuses (CONTRACT section 3): 0 after a graceful shutdown, 1 when the proxy cannot
//! run, 2 for invalid configuration, 128+N when a second signal N forced the stop.

use clap::{Parser, Subcommand};
use lameduck::config::{Config, ProxyArgs, process_env};
use lameduck::signals::ShutdownSignals;
use lameduck::wrapper::{self, AwaitArgs};
use lameduck::{app, logging};

/// lameduck: a service-mesh sidecar proxy that shuts down gracefully.
///
/// Forwards a pod's inbound and outbound traffic, and on SIGTERM, SIGINT or POST /shutdown
/// stops accepting, lets the connections in flight finish, and never outlives its grace period.
#[derive(Parser, Debug)]
#[command(name = "lameduck", version, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    proxy: ProxyArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the proxy (the default command)
    Proxy(ProxyArgs),
    /// Wait until the proxy is ready, run a command, and (with -S) shut the proxy down after it
    Await(AwaitArgs),
}

const EXIT_CANNOT_RUN: i32 = 1;
const EXIT_INVALID_CONFIG: i32 = 2;

fn main() {
    // `lameduck await` handles the signals of the command it runs, and installs its own.
    if std::env::args_os()
        .nth(1)
        .is_some_and(|first| first == "await")
    {
        let code = match Cli::try_parse() {
            Ok(Cli {
                command: Some(Command::Await(args)),
                ..
            }) => wrapper::run(args, process_env),
            Ok(_) => unreachable!("the first argument names the await command"),
            Err(error) => error.exit(),
        };
        std::process::exit(code);
    }
    // Signal handlers first, before configuration is read or a socket bound: as PID 1 a
    // SIGTERM that arrives while starting up would otherwise be lost.
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => exit_with(
            EXIT_CANNOT_RUN,
            &format!("cannot start the runtime: {error}"),
        ),
    };
    let signals = {
        let _context = runtime.enter();
        match ShutdownSignals::install() {
            Ok(signals) => signals,
            Err(error) => exit_with(
                EXIT_CANNOT_RUN,
                &format!("cannot install signal handlers: {error}"),
            ),
        }
    };

    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // --help and --version print and exit 0; usage errors exit 2.
        Err(error) => error.exit(),
    };
    let args = match cli.command {
        Some(Command::Proxy(args)) => args,
        Some(Command::Await(_)) => unreachable!("dispatched before the proxy's signal handlers"),
        None => cli.proxy,
    };
    let config = match Config::from_sources(args, process_env) {
        Ok(config) => config,
        Err(error) => exit_with(EXIT_INVALID_CONFIG, &error.to_string()),
    };
    logging::init(&config.log_filter, config.log_format);

    let code = runtime.block_on(async move {
        match app::build(config) {
            Ok(bound) => bound.run(signals).await.code(),
            Err(error) => {
                tracing::error!("{error}");
                EXIT_CANNOT_RUN
            }
        }
    });
    // Exit without waiting for the runtime's tasks: the lifecycle has finished them or reset them.
    std::process::exit(code);
}

fn exit_with(code: i32, message: &str) -> ! {
    eprintln!("lameduck: {message}");
    std::process::exit(code);
}
