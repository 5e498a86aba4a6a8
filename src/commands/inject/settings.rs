//! What one pod template's annotations ask for ([`Settings`]), read and checked against each
//! other and against the pod's own budget (docs/kubernetes.md, "Annotations"), and the
//! `terminationGracePeriodSeconds` that budget needs ([`pod_budget`]).

use std::time::Duration;

use serde_norway::Value;

use super::spec::{InjectError, Object};
use crate::config::{Handoffs, Raw, parse_bool, parse_duration};

pub(super) const ANNOTATION_INJECT: &str = "lameduck.io/inject";
pub(super) const ANNOTATION_GRACE: &str = "lameduck.io/shutdown-grace-period";
pub(super) const ANNOTATION_LAME_DUCK: &str = "lameduck.io/lame-duck-period";
pub(super) const ANNOTATION_LAME_DUCK_MAX: &str = "lameduck.io/lame-duck-max";
pub(super) const ANNOTATION_LAME_DUCK_QUIET: &str = "lameduck.io/lame-duck-quiet-window";
pub(super) const ANNOTATION_LAME_DUCK_MIN: &str = "lameduck.io/lame-duck-min";
pub(super) const ANNOTATION_CLOSE_SPREAD: &str = "lameduck.io/close-spread-window";
pub(super) const ANNOTATION_SHUTDOWN_ENDPOINT: &str = "lameduck.io/shutdown-endpoint";
pub(super) const ANNOTATION_INBOUND_PORTS: &str = "lameduck.io/inbound-ports";
pub(super) const ANNOTATION_NATIVE_SIDECAR: &str = "lameduck.io/native-sidecar";
pub(super) const ANNOTATION_LINKERD_GRACE: &str = "config.linkerd.io/shutdown-grace-period";
pub(super) const ANNOTATION_INTERCEPT: &str = "lameduck.io/intercept";
pub(super) const ANNOTATION_SKIP_INBOUND_PORTS: &str = "lameduck.io/skip-inbound-ports";
pub(super) const ANNOTATION_SKIP_OUTBOUND_PORTS: &str = "lameduck.io/skip-outbound-ports";
pub(super) const ANNOTATION_SKIP_OUTBOUND_CIDRS: &str = "lameduck.io/skip-outbound-cidrs";
pub(super) const ANNOTATION_LINKERD_SKIP_INBOUND_PORTS: &str =
    "config.linkerd.io/skip-inbound-ports";
pub(super) const ANNOTATION_LINKERD_SKIP_OUTBOUND_PORTS: &str =
    "config.linkerd.io/skip-outbound-ports";
pub(super) const ANNOTATION_REWRITE_PROBES: &str = "lameduck.io/rewrite-probes";
pub(super) const ANNOTATION_HANDOFF: &str = "lameduck.io/handoff";
pub(super) const KNOWN: [&str; 16] = [
    ANNOTATION_INJECT,
    ANNOTATION_GRACE,
    ANNOTATION_CLOSE_SPREAD,
    ANNOTATION_LAME_DUCK,
    ANNOTATION_LAME_DUCK_MAX,
    ANNOTATION_LAME_DUCK_QUIET,
    ANNOTATION_LAME_DUCK_MIN,
    ANNOTATION_SHUTDOWN_ENDPOINT,
    ANNOTATION_INBOUND_PORTS,
    ANNOTATION_NATIVE_SIDECAR,
    ANNOTATION_INTERCEPT,
    ANNOTATION_SKIP_INBOUND_PORTS,
    ANNOTATION_SKIP_OUTBOUND_PORTS,
    ANNOTATION_SKIP_OUTBOUND_CIDRS,
    ANNOTATION_REWRITE_PROBES,
    ANNOTATION_HANDOFF,
];

/// Seconds between the proxy's grace period and the pod's, for the proxy to exit in.
pub const GRACE_MARGIN_SECONDS: u64 = 5;
/// The longest adaptive lame duck inject configures when the workload chooses no lame duck (it
/// ends earlier, once the new connections it sees have stopped: docs/pod-lifecycle.md): at most
/// [`LAME_DUCK_SHARE`] of the grace period, and at most this. The rest of the grace period is
/// for the inbound drain after it (requests in flight end in well under a second; what lives
/// longer gets the close-spread window, at least a fifth of the grace period then). Jobs serve
/// no inbound traffic and get none, so that they complete without waiting.
pub(super) const DEFAULT_LAME_DUCK_MAX: Duration = Duration::from_secs(60);
/// The longest adaptive lame duck inject configures by default when the pod hands late
/// connections off to its Service (at most [`LAME_DUCK_SHARE`] of the grace period too): what
/// arrives after it still reaches a pod, one hop further (benches/README.md, "Hand-off": tens
/// of microseconds), so the app need not wait for the slowest load balancer; 10 s covers the
/// propagation of kube-proxy on most clusters, whose requests then take no extra hop.
pub(super) const HANDOFF_LAME_DUCK_MAX: Duration = Duration::from_secs(10);
/// The share of the grace period an adaptive lame duck may take by default: with a grace period
/// of 20 s, 16 s, beyond the 15 s of a propagation of 10 s ± 50 % (docs/pod-lifecycle.md).
pub(super) const LAME_DUCK_SHARE: f64 = 0.8;
/// Kubernetes' default `terminationGracePeriodSeconds`.
const DEFAULT_POD_GRACE_SECONDS: u64 = 30;

/// The settings one pod template's annotations ask for.
pub(super) struct Settings {
    pub(super) grace: Duration,
    /// `terminationGracePeriodSeconds` to set, when it must be raised.
    pub(super) raise_pod_grace_to: Option<(u64, u64)>,
    pub(super) lame_duck: Option<LameDuck>,
    /// `None`: the proxy's default.
    pub(super) close_spread_window: Option<Duration>,
    pub(super) shutdown_endpoint: Option<bool>,
    pub(super) inbound_ports: Vec<u16>,
    pub(super) native: bool,
    /// Transparent interception (the default), with what its rules skip; `None` for the
    /// explicit mode, where Services point at the proxy's port.
    pub(super) intercept: Option<Intercept>,
    /// The app containers' network probes go to the proxy's admin port (`probes.rs`).
    pub(super) rewrite_probes: bool,
    pub(super) handoff: Handoff,
}

/// Where the pod's late connections go (docs/pod-lifecycle.md, "Hand-off").
pub(super) enum Handoff {
    /// To the Services that select the pod (`services.rs`).
    Discovered,
    /// As the annotation says (`PORT=HOST:PORT,...`).
    Named(String),
    /// Nowhere: refused at once.
    Disabled,
}

/// The lame duck a pod template asks for (docs/pod-lifecycle.md).
#[derive(Clone, Copy)]
pub(super) enum LameDuck {
    Fixed(Duration),
    /// `None`: the proxy's default.
    Adaptive {
        max: Duration,
        quiet: Option<Duration>,
        min: Option<Duration>,
    },
}

/// What the NAT rules of an intercepted pod leave alone.
pub(super) struct Intercept {
    pub(super) skip_inbound_ports: Vec<u16>,
    pub(super) skip_outbound_ports: Vec<u16>,
    pub(super) skip_outbound_cidrs: Vec<String>,
}

/// The pod template's annotations as strings (numbers and booleans written unquoted included).
pub(super) fn annotations(
    template: &Value,
    object: &Object,
) -> Result<Vec<(String, String)>, InjectError> {
    let Some(annotations) = template.get("metadata").and_then(|m| m.get("annotations")) else {
        return Ok(Vec::new());
    };
    let Some(annotations) = annotations.as_mapping() else {
        return Err(object.error("metadata.annotations is not a map"));
    };
    let mut pairs = Vec::new();
    for (key, value) in annotations {
        let key = key.as_str().unwrap_or_default().to_string();
        let value = match value {
            Value::String(text) => text.clone(),
            Value::Number(number) => number.to_string(),
            Value::Bool(flag) => flag.to_string(),
            _ => return Err(object.error(format!("annotation {key} is not a string"))),
        };
        pairs.push((key, value));
    }
    Ok(pairs)
}

/// The settings `get` (the pod template's annotations) asks for, checked against each other and
/// the pod's budget; `native_by_default`: `--native-sidecar`, when no annotation chooses.
pub(super) fn read<'a>(
    spec: &Value,
    object: &Object,
    get: &impl Fn(&str) -> Option<&'a str>,
    is_job: bool,
    native_by_default: bool,
) -> Result<Settings, InjectError> {
    let duration = |key: &str, value: &str| {
        parse_duration(&Raw::new(value, key), "90s")
            .map_err(|error| object.annotation_error(key, value, error.reason))
    };
    let enabled = |key: &str| -> Result<Option<bool>, InjectError> {
        match get(key) {
            None => Ok(None),
            Some("enabled") => Ok(Some(true)),
            Some("disabled") => Ok(Some(false)),
            Some(other) => match parse_bool(&Raw::new(other, key), "enabled or disabled") {
                Ok(flag) => Ok(Some(flag)),
                Err(_) => Err(object.annotation_error(key, other, "expected enabled or disabled")),
            },
        }
    };

    let pod_grace = match spec.get("terminationGracePeriodSeconds") {
        None => DEFAULT_POD_GRACE_SECONDS,
        Some(value) => value.as_u64().ok_or_else(|| {
            object.error("spec.terminationGracePeriodSeconds is not a whole number of seconds")
        })?,
    };
    let annotated = match (get(ANNOTATION_GRACE), get(ANNOTATION_LINKERD_GRACE)) {
        (Some(value), _) => Some(duration(ANNOTATION_GRACE, value)?),
        (None, Some(value)) => Some(duration(ANNOTATION_LINKERD_GRACE, value)?),
        (None, None) => None,
    };
    let grace = annotated.unwrap_or_else(|| {
        Duration::from_secs(pod_grace - GRACE_MARGIN_SECONDS.min(pod_grace / 2))
    });
    let needed = pod_budget(grace, pod_grace);
    let raise_pod_grace_to = (pod_grace < needed).then_some((pod_grace, needed));
    let within_grace = |key: &str, value: &str| {
        let period = duration(key, value)?;
        if period > grace {
            return Err(object.annotation_error(
                key,
                value,
                format!(
                    "longer than the shutdown grace period ({})",
                    format_duration(grace)
                ),
            ));
        }
        Ok(period)
    };
    let adaptive_keys = [
        ANNOTATION_LAME_DUCK_MAX,
        ANNOTATION_LAME_DUCK_QUIET,
        ANNOTATION_LAME_DUCK_MIN,
    ];
    let lame_duck = match get(ANNOTATION_LAME_DUCK) {
        Some(value) => {
            if let Some(key) = adaptive_keys.iter().find(|key| get(key).is_some()) {
                return Err(object.annotation_error(
                    key,
                    get(key).unwrap_or_default(),
                    format!(
                        "a lame duck is either fixed ({ANNOTATION_LAME_DUCK}) or adaptive, not both"
                    ),
                ));
            }
            Some(LameDuck::Fixed(within_grace(ANNOTATION_LAME_DUCK, value)?))
        }
        None if is_job && adaptive_keys.iter().all(|key| get(key).is_none()) => None,
        None => {
            let max = match get(ANNOTATION_LAME_DUCK_MAX) {
                Some(value) => within_grace(ANNOTATION_LAME_DUCK_MAX, value)?,
                // The drain after it has the rest of the grace period.
                None => DEFAULT_LAME_DUCK_MAX.min(grace.mul_f64(LAME_DUCK_SHARE)),
            };
            let quiet = match get(ANNOTATION_LAME_DUCK_QUIET) {
                Some(value) => {
                    let quiet = duration(ANNOTATION_LAME_DUCK_QUIET, value)?;
                    if quiet.is_zero() {
                        return Err(object.annotation_error(
                            ANNOTATION_LAME_DUCK_QUIET,
                            value,
                            "must be longer than zero",
                        ));
                    }
                    Some(quiet)
                }
                None => None,
            };
            let min = match get(ANNOTATION_LAME_DUCK_MIN) {
                Some(value) => {
                    let min = duration(ANNOTATION_LAME_DUCK_MIN, value)?;
                    if min > max {
                        return Err(object.annotation_error(
                            ANNOTATION_LAME_DUCK_MIN,
                            value,
                            format!(
                                "longer than the lame duck's maximum ({})",
                                format_duration(max)
                            ),
                        ));
                    }
                    Some(min)
                }
                None => None,
            };
            (!max.is_zero()).then_some(LameDuck::Adaptive { max, quiet, min })
        }
    };
    let inbound_ports = match get(ANNOTATION_INBOUND_PORTS) {
        Some(value) => {
            let ports: Result<Vec<u16>, _> = value
                .split(',')
                .map(|port| port.trim().parse::<u16>())
                .collect();
            match ports {
                Ok(ports) if !ports.is_empty() && !ports.contains(&0) => ports,
                _ => {
                    return Err(object.annotation_error(
                        ANNOTATION_INBOUND_PORTS,
                        value,
                        "expected ports such as 8080,9090",
                    ));
                }
            }
        }
        None => declared_ports(spec),
    };
    let native = enabled(ANNOTATION_NATIVE_SIDECAR)?.unwrap_or(native_by_default);
    let ports = |ours: &str, linkerd: &str| -> Result<Vec<u16>, InjectError> {
        let (key, value) = match (get(ours), get(linkerd)) {
            (Some(value), _) => (ours, value),
            (None, Some(value)) => (linkerd, value),
            (None, None) => return Ok(Vec::new()),
        };
        port_list(value).ok_or_else(|| {
            object.annotation_error(key, value, "expected ports such as 25,443 (1 to 65535)")
        })
    };
    let intercept = match enabled(ANNOTATION_INTERCEPT)?.unwrap_or(true) {
        false => None,
        true => Some(Intercept {
            skip_inbound_ports: ports(
                ANNOTATION_SKIP_INBOUND_PORTS,
                ANNOTATION_LINKERD_SKIP_INBOUND_PORTS,
            )?,
            skip_outbound_ports: ports(
                ANNOTATION_SKIP_OUTBOUND_PORTS,
                ANNOTATION_LINKERD_SKIP_OUTBOUND_PORTS,
            )?,
            skip_outbound_cidrs: match get(ANNOTATION_SKIP_OUTBOUND_CIDRS) {
                None => Vec::new(),
                Some(value) => cidr_list(value).ok_or_else(|| {
                    object.annotation_error(
                        ANNOTATION_SKIP_OUTBOUND_CIDRS,
                        value,
                        "expected CIDRs such as 10.0.0.0/8,fd00::/8",
                    )
                })?,
            },
        }),
    };
    let close_spread_window = match get(ANNOTATION_CLOSE_SPREAD) {
        Some(value) => Some(within_grace(ANNOTATION_CLOSE_SPREAD, value)?),
        None => None,
    };
    let handoff = match get(ANNOTATION_HANDOFF) {
        None | Some("enabled") => Handoff::Discovered,
        Some("disabled") => Handoff::Disabled,
        Some(value) => match Handoffs::parse(value) {
            Ok(handoffs) if !handoffs.is_empty() => Handoff::Named(value.trim().to_string()),
            Ok(_) => {
                return Err(object.annotation_error(
                    ANNOTATION_HANDOFF,
                    value,
                    "expected enabled, disabled or PORT=HOST:PORT,...",
                ));
            }
            Err(reason) => return Err(object.annotation_error(ANNOTATION_HANDOFF, value, reason)),
        },
    };
    Ok(Settings {
        handoff,
        rewrite_probes: enabled(ANNOTATION_REWRITE_PROBES)?.unwrap_or(true),
        grace,
        raise_pod_grace_to,
        lame_duck,
        close_spread_window,
        shutdown_endpoint: enabled(ANNOTATION_SHUTDOWN_ENDPOINT)?,
        inbound_ports,
        native,
        intercept,
    })
}

/// The `terminationGracePeriodSeconds` an injected pod needs (docs/pod-lifecycle.md): the inbound
/// drain, which the preStop hook waits for and which the proxy bounds by its grace period (lame
/// duck included); then the app's own shutdown, with the budget it had before injection; then
/// the margin in which the proxy, signalled last, exits.
pub fn pod_budget(grace: Duration, app_budget: u64) -> u64 {
    let drain = grace.as_secs() + u64::from(grace.subsec_nanos() > 0);
    drain + app_budget + GRACE_MARGIN_SECONDS
}

/// `25,443` (spaces allowed); `None` when any item is not a port.
fn port_list(value: &str) -> Option<Vec<u16>> {
    value
        .split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(|item| item.parse::<u16>().ok().filter(|port| *port != 0))
        .collect()
}

/// `10.0.0.0/8,fd00::/8,169.254.169.254`; `None` when any item is not an address block.
fn cidr_list(value: &str) -> Option<Vec<String>> {
    value
        .split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(|item| {
            let (addr, prefix) = item.split_once('/').unwrap_or((item, ""));
            let addr: std::net::IpAddr = addr.parse().ok()?;
            let max = if addr.is_ipv4() { 32 } else { 128 };
            let valid = prefix.is_empty() || prefix.parse::<u8>().is_ok_and(|p| p <= max);
            valid.then(|| item.to_string())
        })
        .collect()
}

/// TCP ports the app containers declare, in order, without repeats.
fn declared_ports(spec: &Value) -> Vec<u16> {
    let mut ports = Vec::new();
    let containers = spec
        .get("containers")
        .and_then(Value::as_sequence)
        .map(Vec::as_slice)
        .unwrap_or_default();
    for container in containers {
        let declared = container
            .get("ports")
            .and_then(Value::as_sequence)
            .map(Vec::as_slice)
            .unwrap_or_default();
        for port in declared {
            let tcp = port
                .get("protocol")
                .and_then(Value::as_str)
                .is_none_or(|protocol| protocol == "TCP");
            if let Some(number) = port
                .get("containerPort")
                .and_then(Value::as_u64)
                .and_then(|n| u16::try_from(n).ok())
                && tcp
                && !ports.contains(&number)
            {
                ports.push(number);
            }
        }
    }
    ports
}

/// `90s`, or `1500ms` when not whole seconds.
pub(super) fn format_duration(duration: Duration) -> String {
    if duration.subsec_nanos() == 0 {
        format!("{}s", duration.as_secs())
    } else {
        format!("{}ms", duration.as_millis())
    }
}
