//! The app containers' probes, pointed at the proxy's admin port (docs/kubernetes.md,
//! "Probes").
//!
//! The kubelet's probes come from the node's address on the pod network: on bridge plugins
//! (flannel, kubenet) and Cilium that is the bridge's or router's address, not `status.hostIP`,
//! so a probe that reaches the app through the proxy's inbound routes looks like a client and
//! holds the lame duck open. As Istio does, every `httpGet`, `tcpSocket` and `grpc` probe
//! (readiness, liveness, startup) of an app container becomes an `httpGet` of
//! `/app-health/<container>/<readyz|livez|startupz>` on the admin port, which the NAT rules
//! leave alone; the original goes to the proxy (`LAMEDUCK_APP_PROBES`), which runs it against
//! the app from inside the pod and answers as the kubelet would have concluded. Timing fields
//! (period, thresholds, timeout) stay on the probe; named ports are resolved here, where the
//! container's ports are known. `exec` probes never touch the network and stay as they are.
//!
//! `lameduck.io/rewrite-probes: disabled` leaves every probe alone.

use serde_json::{Map as JsonMap, Value as Json, json};
use serde_norway::{Mapping, Value};

use super::spec::{Object, app_containers, container_name};
use crate::config::{APP_HEALTH_PREFIX, AppProbes};

/// Each kind of probe and the last segment of its admin path (Istio's names).
const KINDS: [(&str, &str); 3] = [
    ("readinessProbe", "readyz"),
    ("livenessProbe", "livez"),
    ("startupProbe", "startupz"),
];

/// The handlers that reach the app over the network.
const NETWORK_HANDLERS: [&str; 3] = ["httpGet", "tcpSocket", "grpc"];

/// Rewrites the app containers' network probes; returns the originals as the proxy's
/// `LAMEDUCK_APP_PROBES` (JSON), or `None` when no probe was rewritten.
pub(super) fn rewrite(
    spec: &mut Value,
    object: &Object,
    admin_port: u16,
    notes: &mut Vec<String>,
) -> Option<String> {
    let mut originals = JsonMap::new();
    for container in app_containers(spec) {
        let name = container_name(container);
        let ports = container.get("ports").cloned();
        for (field, kind) in KINDS {
            let Some(probe) = container.get_mut(field).and_then(Value::as_mapping_mut) else {
                continue;
            };
            let Some(handler) = NETWORK_HANDLERS
                .into_iter()
                .find(|handler| probe.contains_key(*handler))
            else {
                continue;
            };
            let path = format!("{APP_HEALTH_PREFIX}{name}/{kind}");
            // Read back as the proxy reads it: what it would refuse stays with the kubelet.
            let kept = original(probe, handler, ports.as_ref()).and_then(|kept| {
                let one = json!({ path.as_str(): kept }).to_string();
                AppProbes::parse(&one).map(|_| kept)
            });
            match kept {
                Ok(kept) => {
                    originals.insert(path.clone(), kept);
                    *probe = pointed_at_admin(probe, &path, admin_port);
                }
                Err(why) => notes.push(object.note(format!(
                    "the {field} of container {name} is kept as it is ({why}): it reaches the \
                     app through the proxy's inbound routes, and each of its connections keeps \
                     the lame duck open like a client's"
                ))),
            }
        }
    }
    (!originals.is_empty()).then(|| Json::Object(originals).to_string())
}

/// The probe as the proxy runs it: its handler (ports resolved) and its timeout.
fn original(probe: &Mapping, handler: &str, ports: Option<&Value>) -> Result<Json, String> {
    let action = probe
        .get(handler)
        .and_then(Value::as_mapping)
        .ok_or_else(|| format!("{handler} is not a map"))?;
    let field = |key: &str| action.get(key);
    let port = resolve_port(field("port"), ports)?;
    let text = |key: &str| -> Result<Option<String>, String> {
        match field(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(text)) => Ok(Some(text.clone())),
            Some(_) => Err(format!("{handler}.{key} is not a string")),
        }
    };
    let mut kept = JsonMap::new();
    kept.insert("port".into(), port.into());
    match handler {
        "httpGet" => {
            for key in ["path", "host", "scheme"] {
                if let Some(value) = text(key)? {
                    kept.insert(key.into(), value.into());
                }
            }
            if let Some(headers) = field("httpHeaders") {
                let headers = serde_json::to_value(headers)
                    .map_err(|error| format!("httpGet.httpHeaders: {error}"))?;
                kept.insert("httpHeaders".into(), headers);
            }
        }
        "tcpSocket" => {
            if let Some(host) = text("host")? {
                kept.insert("host".into(), host.into());
            }
        }
        _ => {
            if let Some(service) = text("service")? {
                kept.insert("service".into(), service.into());
            }
        }
    }
    let mut original = JsonMap::new();
    original.insert(handler.into(), Json::Object(kept));
    if let Some(timeout) = probe.get("timeoutSeconds").and_then(Value::as_u64) {
        original.insert("timeoutSeconds".into(), timeout.into());
    }
    Ok(Json::Object(original))
}

/// A probe's port as a number: its own, or the container's port of that name.
fn resolve_port(port: Option<&Value>, ports: Option<&Value>) -> Result<u16, String> {
    match port {
        Some(Value::Number(number)) => number
            .as_u64()
            .and_then(|number| u16::try_from(number).ok())
            .filter(|number| *number != 0)
            .ok_or_else(|| format!("port {number} is no port")),
        Some(Value::String(name)) => ports
            .and_then(Value::as_sequence)
            .into_iter()
            .flatten()
            .find(|port| port.get("name").and_then(Value::as_str) == Some(name.as_str()))
            .and_then(|port| port.get("containerPort")?.as_u64())
            .and_then(|number| u16::try_from(number).ok())
            .ok_or_else(|| format!("the container declares no port named {name:?}")),
        _ => Err("it names no port".into()),
    }
}

/// The probe with its handler replaced, in the same place, by a GET of `path` on the admin
/// port (`admin_port`); its other fields (period, thresholds, timeout) as they were.
fn pointed_at_admin(probe: &Mapping, path: &str, admin_port: u16) -> Mapping {
    let handler: Value = serde_norway::to_value(json!({
        "path": path,
        "port": admin_port,
        "scheme": "HTTP",
    }))
    .expect("a JSON object is a YAML mapping");
    let mut rewritten = Mapping::new();
    for (key, value) in probe {
        match key.as_str() {
            Some(name) if NETWORK_HANDLERS.contains(&name) => {
                rewritten.insert("httpGet".into(), handler.clone());
            }
            _ => {
                rewritten.insert(key.clone(), value.clone());
            }
        }
    }
    rewritten
}
