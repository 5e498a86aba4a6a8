//! The `lameduck` binary: install the signal handlers, parse the command line, dispatch.
//! Exit statuses (docs/lifecycle.md): 0 after a graceful shutdown, 1 when the proxy cannot
//! run, 2 for invalid configuration, 128+N when a second signal N forced the stop.

use clap::{Parser, Subcommand};
use lameduck::commands::r#await::{self, AwaitArgs};
use lameduck::commands::hook::{self, HoldArgs, PostStartArgs, PreStopArgs};
use lameduck::commands::inject;
use lameduck::commands::iptables::{self, IptablesArgs};
use lameduck::commands::status::{self, StatusArgs};
use lameduck::commands::webhook::{self, WebhookArgs};
use lameduck::config::{Config, ProxyArgs, process_env};
use lameduck::signals::ShutdownSignals;
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

// Parsed once per process: the size of the proxy's arguments costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
enum Command {
    /// Run the proxy (the default command)
    Proxy(ProxyArgs),
    /// Wait until the proxy is ready, run a command, and (with -S) shut the proxy down after it
    Await(AwaitArgs),
    /// Read Kubernetes YAML and write it back with the proxy injected as a sidecar
    Inject(InjectArgs),
    /// An app container's preStop hook: drain the proxy's inbound side, then run the
    /// container's own preStop action
    Prestop(PreStopArgs),
    /// An app container's postStart hook: the proxy serves inbound again (after a restart)
    Poststart(PostStartArgs),
    /// What the proxy is doing, for people: phase, grace left, connections, what holds a drain up
    Status(StatusArgs),
    /// Install the NAT rules that send a pod's TCP to the proxy (the init container's command)
    Iptables(IptablesArgs),
    /// Serve the admission webhook that injects the proxy into pods as they are created
    Webhook(WebhookArgs),
    /// Hold a connection to the proxy while this container lives (started by `poststart --hold`)
    #[command(hide = true)]
    Hold(HoldArgs),
    /// Copy this binary to PATH (used by legacy injection to hand it to app containers)
    #[command(hide = true)]
    CopyBinary {
        /// Where to copy the binary
        path: std::path::PathBuf,
    },
}

#[derive(clap::Args, Debug)]
struct InjectArgs {
    /// The YAML to read; - for standard input
    #[arg(
        short = 'f',
        long = "filename",
        value_name = "FILE",
        default_value = "-"
    )]
    file: String,
    /// The proxy image
    #[arg(long, value_name = "IMAGE", default_value = inject::DEFAULT_IMAGE)]
    image: String,
    /// The image of the init container that installs the NAT rules (interception)
    #[arg(long, value_name = "IMAGE", default_value = inject::DEFAULT_INIT_IMAGE)]
    init_image: String,
    /// Inject a native sidecar (true, Kubernetes 1.29+) or an ordinary container (false)
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value = "true")]
    native_sidecar: String,
}

const EXIT_CANNOT_RUN: i32 = 1;
const EXIT_INVALID_CONFIG: i32 = 2;

fn main() {
    // The other commands keep the default signal dispositions (`await` installs its own).
    let first = std::env::args_os().nth(1);
    let tool = first.as_deref().and_then(|arg| arg.to_str());
    // Every subcommand but the proxy's own is a tool (clap's derived lookup: no list to keep).
    if tool.is_some_and(|arg| arg != "proxy" && <Command as clap::Subcommand>::has_subcommand(arg))
    {
        std::process::exit(run_tool());
    }
    // Signal handlers first, before configuration is read or a socket bound: as PID 1 a
    // SIGTERM that arrives while starting up would otherwise be lost. Until they are complete
    // the signals are held pending, in this thread and in the runtime's threads.
    ShutdownSignals::hold();
    let runtime = match runtime_builder().enable_all().build() {
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
        Some(
            Command::Await(_)
            | Command::Inject(_)
            | Command::CopyBinary { .. }
            | Command::Prestop(_)
            | Command::Poststart(_)
            | Command::Status(_)
            | Command::Iptables(_)
            | Command::Webhook(_)
            | Command::Hold(_),
        ) => {
            unreachable!("dispatched before the proxy's signal handlers")
        }
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

/// The commands other than the proxy; returns the exit status.
fn run_tool() -> i32 {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => error.exit(),
    };
    match cli.command {
        Some(Command::Await(args)) => r#await::run(args, process_env),
        Some(Command::Inject(args)) => run_inject(args),
        Some(Command::CopyBinary { path }) => copy_binary(&path),
        Some(Command::Prestop(args)) => hook::prestop(args),
        Some(Command::Poststart(args)) => hook::poststart(args),
        Some(Command::Status(args)) => status::run(args, process_env),
        Some(Command::Hold(args)) => hook::hold(args),
        Some(Command::Iptables(args)) => iptables::run(args),
        Some(Command::Webhook(args)) => webhook::run(args),
        _ => unreachable!("the first argument names a tool command"),
    }
}

/// `lameduck inject`: 0 when written, 2 for input that cannot be injected, 1 when the input
/// cannot be read.
fn run_inject(args: InjectArgs) -> i32 {
    let native_sidecar = match args.native_sidecar.as_str() {
        "true" => true,
        "false" => false,
        other => {
            eprintln!(
                "lameduck inject: invalid value {other:?} for --native-sidecar; for example true or false"
            );
            return EXIT_INVALID_CONFIG;
        }
    };
    let input = match args.file.as_str() {
        "-" => std::io::read_to_string(std::io::stdin()),
        path => std::fs::read_to_string(path),
    };
    let input = match input {
        Ok(input) => input,
        Err(error) => {
            eprintln!("lameduck inject: cannot read {}: {error}", args.file);
            return EXIT_CANNOT_RUN;
        }
    };
    let options = inject::InjectOptions {
        image: args.image,
        init_image: args.init_image,
        native_sidecar,
        services: Vec::new(),
    };
    match inject::inject(&input, &options) {
        Ok(injected) => {
            for note in &injected.notes {
                eprintln!("lameduck inject: {note}");
            }
            print!("{}", injected.yaml);
            0
        }
        Err(error) => {
            eprintln!("lameduck inject: {error}");
            EXIT_INVALID_CONFIG
        }
    }
}

fn copy_binary(path: &std::path::Path) -> i32 {
    use std::os::unix::fs::PermissionsExt;
    let copied = std::env::current_exe()
        .and_then(|me| std::fs::copy(me, path))
        .and_then(|_| std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)));
    match copied {
        Ok(()) => 0,
        Err(error) => {
            eprintln!(
                "lameduck copy-binary: cannot copy to {}: {error}",
                path.display()
            );
            EXIT_CANNOT_RUN
        }
    }
}

/// One thread when the process may use one CPU (a sidecar's usual limit: no cross-thread
/// wake-ups on the hot path), else a worker per CPU. The CPU count honours affinity masks and
/// cgroup CPU quotas.
fn runtime_builder() -> tokio::runtime::Builder {
    match std::thread::available_parallelism().map_or(1, |cpus| cpus.get()) {
        1 => tokio::runtime::Builder::new_current_thread(),
        _ => tokio::runtime::Builder::new_multi_thread(),
    }
}

fn exit_with(code: i32, message: &str) -> ! {
    eprintln!("lameduck: {message}");
    std::process::exit(code);
}
