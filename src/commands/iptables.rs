//! `lameduck iptables`: the init container's command. Installs, in the current network
//! namespace, the NAT rules that send the pod's TCP to the proxy: inbound connections to the
//! proxy's inbound port, the app's outbound connections to its outbound port, except the
//! proxy's own (by its uid), loopback traffic, and the ports and CIDRs asked to be skipped.
//! The proxy's `orig-dst` routes then forward each connection where it was going.
//!
//! The rules live in two chains of their own (`LAMEDUCK_PREROUTING`, `LAMEDUCK_OUTPUT`) in the
//! `nat` table, for IPv4 and IPv6. Each family is written with one `iptables-restore --noflush`
//! (one transaction: all of it or nothing), which empties the chains before filling them; the
//! jumps from `PREROUTING` and `OUTPUT` are added only when absent. So running the command
//! twice leaves the same rules.

use std::io::Write as _;
use std::net::IpAddr;
use std::process::{Command, Stdio};

use clap::{Args, ValueEnum};

const EXIT_FAILED: i32 = 1;
const EXIT_INVALID: i32 = 2;
/// multiport matches at most 15 ports per rule.
const MULTIPORT_MAX: usize = 15;
const INBOUND_CHAIN: &str = "LAMEDUCK_PREROUTING";
const OUTBOUND_CHAIN: &str = "LAMEDUCK_OUTPUT";

/// The uid the proxy runs as in an intercepted pod: one of its own, so that its connections
/// (and only its) are exempt. Not 65532, the uid of every distroless app.
pub const PROXY_UID: u32 = 2110;

#[derive(Args, Debug)]
pub struct IptablesArgs {
    /// The proxy's inbound port: inbound TCP is redirected there
    #[arg(long, value_name = "PORT", default_value_t = 4143)]
    inbound_port: u16,
    /// The proxy's outbound port: the app's outbound TCP is redirected there
    #[arg(long, value_name = "PORT", default_value_t = 4140)]
    outbound_port: u16,
    /// The proxy's admin port: never redirected (probes reach the proxy itself)
    #[arg(long, value_name = "PORT", default_value_t = 4191)]
    admin_port: u16,
    /// The uid the proxy runs as: its own connections are not redirected
    #[arg(long, value_name = "UID", default_value_t = PROXY_UID)]
    proxy_uid: u32,
    /// Inbound ports that go straight to the app (comma-separated, or repeated)
    #[arg(long, value_name = "PORTS", value_delimiter = ',', value_parser = parse_port)]
    skip_inbound_ports: Vec<u16>,
    /// Outbound ports that go straight to their destination
    #[arg(long, value_name = "PORTS", value_delimiter = ',', value_parser = parse_port)]
    skip_outbound_ports: Vec<u16>,
    /// Outbound destinations (CIDRs, IPv4 or IPv6) that go straight to their destination
    #[arg(long, value_name = "CIDRS", value_delimiter = ',', value_parser = parse_cidr)]
    skip_outbound_cidrs: Vec<Cidr>,
    /// Which iptables: nft (the kernel's nf_tables, the default) or legacy
    #[arg(long, value_enum, default_value_t = Backend::Nft)]
    backend: Backend,
    /// Print the rules (iptables-restore input, for each family) instead of installing them
    #[arg(long)]
    dry_run: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Backend {
    Nft,
    Legacy,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    V4,
    V6,
}

impl Family {
    fn name(self) -> &'static str {
        match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        }
    }

    fn tool(self, backend: Backend, what: &str) -> String {
        let prefix = match self {
            Family::V4 => "iptables",
            Family::V6 => "ip6tables",
        };
        let backend = match backend {
            Backend::Nft => "nft",
            Backend::Legacy => "legacy",
        };
        format!("{prefix}-{backend}-{what}")
    }
}

/// An address block: `10.0.0.0/8`, `fd00::/8`, or one address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

fn parse_port(value: &str) -> Result<u16, String> {
    match value.trim().parse::<u16>() {
        Ok(port) if port != 0 => Ok(port),
        _ => Err(format!("{value:?} is not a port (1 to 65535)")),
    }
}

fn parse_cidr(value: &str) -> Result<Cidr, String> {
    let value = value.trim();
    let bad = || format!("{value:?} is not a CIDR; for example 10.0.0.0/8 or fd00::/8");
    let (addr, prefix) = match value.split_once('/') {
        Some((addr, prefix)) => (addr, Some(prefix)),
        None => (value, None),
    };
    let addr: IpAddr = addr.parse().map_err(|_| bad())?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    let prefix = match prefix {
        None => max,
        Some(prefix) => prefix
            .parse::<u8>()
            .ok()
            .filter(|p| *p <= max)
            .ok_or_else(bad)?,
    };
    Ok(Cidr { addr, prefix })
}

/// The jumps from the built-in chains to ours.
const JUMPS: [&str; 2] = [
    "-A PREROUTING -j LAMEDUCK_PREROUTING",
    "-A OUTPUT -j LAMEDUCK_OUTPUT",
];

/// The `iptables-restore` input for one family, with those of [`JUMPS`] that are missing.
fn rules(args: &IptablesArgs, family: Family, missing_jumps: &[&str]) -> String {
    let mut out = String::from("*nat\n");
    out.push_str(&format!(
        ":{INBOUND_CHAIN} - [0:0]\n:{OUTBOUND_CHAIN} - [0:0]\n"
    ));
    // Inbound: everything to the proxy's inbound port, but the admin port and the skipped.
    let mut skip_inbound = vec![args.admin_port];
    skip_inbound.extend(&args.skip_inbound_ports);
    for ports in dedup(skip_inbound).chunks(MULTIPORT_MAX) {
        out.push_str(&format!(
            "-A {INBOUND_CHAIN} -p tcp -m multiport --dports {} -j RETURN\n",
            join(ports)
        ));
    }
    out.push_str(&format!(
        "-A {INBOUND_CHAIN} -p tcp -j REDIRECT --to-ports {}\n",
        args.inbound_port
    ));
    // Outbound: the proxy's own connections and loopback traffic first, then the skipped.
    out.push_str(&format!(
        "-A {OUTBOUND_CHAIN} -m owner --uid-owner {} -j RETURN\n",
        args.proxy_uid
    ));
    out.push_str(&format!("-A {OUTBOUND_CHAIN} -o lo -j RETURN\n"));
    for ports in dedup(args.skip_outbound_ports.clone()).chunks(MULTIPORT_MAX) {
        out.push_str(&format!(
            "-A {OUTBOUND_CHAIN} -p tcp -m multiport --dports {} -j RETURN\n",
            join(ports)
        ));
    }
    for cidr in &args.skip_outbound_cidrs {
        if cidr.addr.is_ipv4() == (family == Family::V4) {
            out.push_str(&format!("-A {OUTBOUND_CHAIN} -d {cidr} -j RETURN\n"));
        }
    }
    out.push_str(&format!(
        "-A {OUTBOUND_CHAIN} -p tcp -j REDIRECT --to-ports {}\n",
        args.outbound_port
    ));
    for jump in missing_jumps {
        out.push_str(jump);
        out.push('\n');
    }
    out.push_str("COMMIT\n");
    out
}

fn dedup(mut ports: Vec<u16>) -> Vec<u16> {
    ports.sort_unstable();
    ports.dedup();
    ports
}

fn join(ports: &[u16]) -> String {
    ports
        .iter()
        .map(u16::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// `lameduck iptables`: 0 when installed (or printed), 1 when a family's rules could not be
/// installed, 2 for invalid flags.
pub fn run(args: IptablesArgs) -> i32 {
    if args.inbound_port == args.outbound_port {
        eprintln!("lameduck iptables: --inbound-port and --outbound-port must differ");
        return EXIT_INVALID;
    }
    if args.dry_run {
        for family in [Family::V4, Family::V6] {
            print!("# {}\n{}", family.name(), rules(&args, family, &JUMPS));
        }
        return 0;
    }
    // A kernel without IPv6 (ipv6.disable=1) has no IPv6 to intercept.
    let ipv6 = std::path::Path::new("/proc/net/if_inet6").exists();
    if !ipv6 {
        eprintln!("lameduck iptables: this network namespace has no IPv6; IPv4 rules only");
    }
    let families: &[Family] = if ipv6 {
        &[Family::V4, Family::V6]
    } else {
        &[Family::V4]
    };
    for &family in families {
        if let Err(error) = install(&args, family) {
            eprintln!(
                "lameduck iptables: {} rules not installed: {error}",
                family.name()
            );
            return EXIT_FAILED;
        }
    }
    eprintln!(
        "lameduck iptables: inbound TCP to port {}, outbound TCP to port {} (uid {} exempt)",
        args.inbound_port, args.outbound_port, args.proxy_uid
    );
    0
}

/// Installs one family's rules in one transaction.
fn install(args: &IptablesArgs, family: Family) -> Result<(), String> {
    let save = family.tool(args.backend, "save");
    let saved = Command::new(&save)
        .args(["-t", "nat"])
        .output()
        .map_err(|error| cannot_run(&save, &error))?;
    if !saved.status.success() {
        return Err(failed(&save, &saved.stderr));
    }
    let saved = String::from_utf8_lossy(&saved.stdout);
    let missing: Vec<&str> = JUMPS
        .into_iter()
        .filter(|jump| !saved.lines().any(|line| line.trim() == *jump))
        .collect();
    let restore = family.tool(args.backend, "restore");
    let mut child = Command::new(&restore)
        .arg("--noflush")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|error| cannot_run(&restore, &error))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(rules(args, family, &missing).as_bytes())
            .map_err(|error| format!("{restore}: {error}"))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|error| format!("{restore}: {error}"))?;
    match out.status.success() {
        true => Ok(()),
        false => Err(failed(&restore, &out.stderr)),
    }
}

fn cannot_run(tool: &str, error: &std::io::Error) -> String {
    match error.kind() {
        std::io::ErrorKind::NotFound => {
            format!("{tool} not found (the iptables package; the lameduck-init image has it)")
        }
        _ => format!("cannot run {tool}: {error}"),
    }
}

fn failed(tool: &str, stderr: &[u8]) -> String {
    let stderr = String::from_utf8_lossy(stderr);
    let hint = if stderr.contains("ermission denied") || stderr.contains("must be root") {
        " (the container needs the NET_ADMIN and NET_RAW capabilities)"
    } else {
        ""
    };
    format!("{tool} failed: {}{hint}", stderr.trim())
}
