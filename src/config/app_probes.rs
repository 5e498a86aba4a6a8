//! The app's own probes, kept for the proxy (`--app-probes`, `LAMEDUCK_APP_PROBES`).
//!
//! `lameduck inject` points the app containers' `httpGet`, `tcpSocket` and `grpc` probes at the
//! proxy's admin port (`/app-health/<container>/<readyz|livez|startupz>`) and hands the probes
//! as they were to the proxy in this setting, as JSON in Kubernetes' own field names (Istio's
//! `ISTIO_KUBE_APP_PROBERS` has the same shape):
//!
//! ```json
//! {"/app-health/app/readyz": {"httpGet": {"path": "/healthz", "port": 8080}, "timeoutSeconds": 1},
//!  "/app-health/app/livez": {"tcpSocket": {"port": 8080}},
//!  "/app-health/app/startupz": {"grpc": {"port": 9090, "service": "shop"}}}
//! ```
//!
//! Named ports are resolved by inject; here every port is a number. This module only reads and
//! checks the setting; the admin server runs the checks (`admin/probes.rs`).

use std::time::Duration;

use serde_json::{Map, Value};

/// Where the probes the kubelet sends to the admin server live.
pub const APP_HEALTH_PREFIX: &str = "/app-health/";

/// The kubelet's default probe timeout (`timeoutSeconds`).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);

/// Every app probe, by the admin path the kubelet now asks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AppProbes(Vec<(String, AppProbe)>);

/// One probe as the app declared it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppProbe {
    pub check: Check,
    /// How long the check may take (`timeoutSeconds`, 1 s by default as for the kubelet).
    pub timeout: Duration,
}

/// What the kubelet would have done against the app.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Check {
    /// `httpGet`: a GET whose status from 200 to 399 passes.
    Http {
        https: bool,
        /// `host`; none: the pod's address.
        host: Option<String>,
        port: u16,
        path: String,
        headers: Vec<(String, String)>,
    },
    /// `tcpSocket`: a connection that opens passes.
    Tcp { host: Option<String>, port: u16 },
    /// `grpc`: the gRPC health checking protocol's `Check` answered `SERVING`.
    Grpc { port: u16, service: String },
}

impl AppProbes {
    /// Reads the setting's JSON; the error says what is wrong with it.
    pub fn parse(text: &str) -> Result<AppProbes, String> {
        let value: Value = serde_json::from_str(text).map_err(|error| error.to_string())?;
        let Value::Object(entries) = value else {
            return Err("expected a JSON object of admin paths".into());
        };
        let mut probes = Vec::with_capacity(entries.len());
        for (path, probe) in entries {
            if !path.starts_with(APP_HEALTH_PREFIX) || path.len() == APP_HEALTH_PREFIX.len() {
                return Err(format!(
                    "{path:?}: the path must start with {APP_HEALTH_PREFIX}"
                ));
            }
            let probe = AppProbe::parse(&probe).map_err(|error| format!("{path}: {error}"))?;
            probes.push((path, probe));
        }
        Ok(AppProbes(probes))
    }

    pub fn get(&self, path: &str) -> Option<&AppProbe> {
        self.0
            .iter()
            .find(|(candidate, _)| candidate == path)
            .map(|(_, probe)| probe)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl AppProbe {
    fn parse(value: &Value) -> Result<AppProbe, String> {
        let Value::Object(probe) = value else {
            return Err("expected an object".into());
        };
        let timeout = match probe.get("timeoutSeconds") {
            None => DEFAULT_TIMEOUT,
            Some(seconds) => match seconds.as_u64() {
                Some(seconds @ 1..=3600) => Duration::from_secs(seconds),
                _ => return Err("timeoutSeconds must be a whole number from 1 to 3600".into()),
            },
        };
        let handlers: Vec<&str> = ["httpGet", "tcpSocket", "grpc"]
            .into_iter()
            .filter(|key| probe.contains_key(*key))
            .collect();
        let check = match handlers[..] {
            ["httpGet"] => {
                let get = object(&probe["httpGet"], "httpGet")?;
                let https = match get.get("scheme").map(|scheme| scheme.as_str()) {
                    None | Some(Some("HTTP")) => false,
                    Some(Some("HTTPS")) => true,
                    _ => return Err("httpGet.scheme must be HTTP or HTTPS".into()),
                };
                let path = match get.get("path") {
                    None => "/".to_string(),
                    Some(Value::String(path)) => path.clone(),
                    Some(_) => return Err("httpGet.path must be a string".into()),
                };
                let mut headers = Vec::new();
                for header in get
                    .get("httpHeaders")
                    .map(|list| list.as_array().ok_or("httpGet.httpHeaders must be a list"))
                    .transpose()?
                    .into_iter()
                    .flatten()
                {
                    let name = header["name"].as_str();
                    let value = header["value"].as_str();
                    let (Some(name), Some(value)) = (name, value) else {
                        return Err("each of httpGet.httpHeaders needs a name and a value".into());
                    };
                    if !valid_header(name, value) {
                        return Err(format!("httpGet.httpHeaders: {name:?} is no valid header"));
                    }
                    headers.push((name.to_string(), value.to_string()));
                }
                Check::Http {
                    https,
                    host: host(get, "httpGet")?,
                    port: port(get, "httpGet")?,
                    path,
                    headers,
                }
            }
            ["tcpSocket"] => {
                let tcp = object(&probe["tcpSocket"], "tcpSocket")?;
                Check::Tcp {
                    host: host(tcp, "tcpSocket")?,
                    port: port(tcp, "tcpSocket")?,
                }
            }
            ["grpc"] => {
                let grpc = object(&probe["grpc"], "grpc")?;
                let service = match grpc.get("service") {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::String(service)) => service.clone(),
                    Some(_) => return Err("grpc.service must be a string".into()),
                };
                Check::Grpc {
                    port: port(grpc, "grpc")?,
                    service,
                }
            }
            [] => return Err("expected one of httpGet, tcpSocket or grpc".into()),
            _ => return Err("expected only one of httpGet, tcpSocket or grpc".into()),
        };
        Ok(AppProbe { check, timeout })
    }
}

fn object<'a>(value: &'a Value, what: &str) -> Result<&'a Map<String, Value>, String> {
    value
        .as_object()
        .ok_or_else(|| format!("{what} must be an object"))
}

fn port(handler: &Map<String, Value>, what: &str) -> Result<u16, String> {
    match handler.get("port").and_then(Value::as_u64) {
        Some(port @ 1..=65535) => Ok(port as u16),
        _ => Err(format!("{what}.port must be a number from 1 to 65535")),
    }
}

fn host(handler: &Map<String, Value>, what: &str) -> Result<Option<String>, String> {
    match handler.get("host") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(host)) if host.is_empty() => Ok(None),
        Some(Value::String(host))
            if host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_' | ':')) =>
        {
            Ok(Some(host.clone()))
        }
        Some(_) => Err(format!("{what}.host must be a host name or an address")),
    }
}

/// A header the HTTP check can send as it is: a token for a name, visible characters and
/// spaces for a value.
fn valid_header(name: &str, value: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
        && value
            .bytes()
            .all(|b| b == b'\t' || (b' '..=b'~').contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_reads_each_kind_of_probe_with_the_kubelets_defaults() {
        let probes = AppProbes::parse(
            r#"{"/app-health/app/readyz": {"httpGet": {"path": "/healthz", "port": 8080,
                  "httpHeaders": [{"name": "X-Probe", "value": "yes"}]}, "timeoutSeconds": 3},
                "/app-health/app/livez": {"tcpSocket": {"port": 8080, "host": "10.0.0.9"}},
                "/app-health/app/startupz": {"grpc": {"port": 9090}},
                "/app-health/web/readyz": {"httpGet": {"port": 8443, "scheme": "HTTPS"}}}"#,
        )
        .unwrap();
        assert_eq!(probes.len(), 4);
        assert_eq!(
            probes.get("/app-health/app/readyz"),
            Some(&AppProbe {
                check: Check::Http {
                    https: false,
                    host: None,
                    port: 8080,
                    path: "/healthz".into(),
                    headers: vec![("X-Probe".into(), "yes".into())],
                },
                timeout: Duration::from_secs(3),
            })
        );
        assert_eq!(
            probes.get("/app-health/app/livez").unwrap().check,
            Check::Tcp {
                host: Some("10.0.0.9".into()),
                port: 8080
            }
        );
        let grpc = probes.get("/app-health/app/startupz").unwrap();
        assert_eq!(
            grpc.check,
            Check::Grpc {
                port: 9090,
                service: String::new()
            }
        );
        assert_eq!(grpc.timeout, DEFAULT_TIMEOUT);
        assert!(matches!(
            probes.get("/app-health/web/readyz").unwrap().check,
            Check::Http { https: true, ref path, .. } if path == "/"
        ));
        assert_eq!(probes.get("/app-health/other/readyz"), None);
    }

    #[test]
    fn it_refuses_what_it_could_not_run() {
        for (text, says) in [
            ("[]", "JSON object"),
            ("{", "EOF"),
            (r#"{"/ready": {"tcpSocket": {"port": 1}}}"#, "/app-health/"),
            (
                r#"{"/app-health/": {"tcpSocket": {"port": 1}}}"#,
                "/app-health/",
            ),
            (r#"{"/app-health/a/readyz": {}}"#, "one of"),
            (
                r#"{"/app-health/a/readyz": {"tcpSocket": {"port": 1}, "grpc": {"port": 1}}}"#,
                "only one",
            ),
            (
                r#"{"/app-health/a/readyz": {"tcpSocket": {"port": "http"}}}"#,
                "port",
            ),
            (r#"{"/app-health/a/readyz": {"grpc": {"port": 0}}}"#, "port"),
            (
                r#"{"/app-health/a/readyz": {"httpGet": {"port": 1, "scheme": "FTP"}}}"#,
                "scheme",
            ),
            (
                r#"{"/app-health/a/readyz": {"httpGet": {"port": 1, "httpHeaders": [{"name": "a b", "value": "c"}]}}}"#,
                "header",
            ),
            (
                r#"{"/app-health/a/readyz": {"httpGet": {"port": 1, "host": "a/b"}}}"#,
                "host",
            ),
            (
                r#"{"/app-health/a/readyz": {"tcpSocket": {"port": 1}, "timeoutSeconds": 0}}"#,
                "timeoutSeconds",
            ),
        ] {
            let error = AppProbes::parse(text).unwrap_err();
            assert!(error.contains(says), "{text}: {error}");
        }
    }
}
