//! The Services of a stream, for the hand-off (docs/pod-lifecycle.md, "Hand-off"): a pod
//! template whose labels a Service's selector matches, in the same namespace, hands its late
//! connections to that Service. Each TCP port of the Service maps its `targetPort` (a number,
//! or a name the pod's containers declare) to the Service's address: `NAME.NAMESPACE.svc:PORT`,
//! or `NAME:PORT` when the manifests name no namespace (the pod's DNS search path resolves
//! either to the Service's ClusterIP, whatever the cluster's domain).

use serde_norway::Value;

/// A Service with a selector, as the stream declares it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Service {
    name: String,
    namespace: Option<String>,
    selector: Vec<(String, String)>,
    ports: Vec<ServicePort>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct ServicePort {
    port: u16,
    target: TargetPort,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum TargetPort {
    Number(u16),
    Name(String),
}

/// Every `v1` Service of the documents (and of their Lists) that selects pods: not an
/// `ExternalName` one, not one without a selector (its endpoints are someone else's).
pub fn collect<'a>(documents: impl Iterator<Item = &'a Value>) -> Vec<Service> {
    let mut services = Vec::new();
    for document in documents {
        gather(document, None, &mut services);
    }
    services
}

fn gather(document: &Value, list_kind: Option<&str>, services: &mut Vec<Service>) {
    let field = |key: &str| document.get(key).and_then(Value::as_str);
    let kind = field("kind").or(list_kind).unwrap_or_default();
    if let Some(item_kind) = kind.strip_suffix("List")
        && let Some(items) = document.get("items").and_then(Value::as_sequence)
    {
        for item in items {
            gather(item, Some(item_kind), services);
        }
        return;
    }
    let api_version = field("apiVersion").unwrap_or("v1");
    if kind != "Service" || api_version != "v1" {
        return;
    }
    if let Some(service) = service(document) {
        services.push(service);
    }
}

fn service(document: &Value) -> Option<Service> {
    let metadata = document.get("metadata")?;
    let name = metadata.get("name")?.as_str()?.to_string();
    let namespace = metadata
        .get("namespace")
        .and_then(Value::as_str)
        .map(str::to_string);
    let spec = document.get("spec")?;
    if spec.get("type").and_then(Value::as_str) == Some("ExternalName") {
        return None;
    }
    let selector: Vec<(String, String)> = spec
        .get("selector")?
        .as_mapping()?
        .iter()
        .filter_map(|(key, value)| Some((key.as_str()?.to_string(), scalar(value)?)))
        .collect();
    if selector.is_empty() {
        return None;
    }
    let ports = spec
        .get("ports")
        .and_then(Value::as_sequence)
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .filter(|port| {
            port.get("protocol")
                .and_then(Value::as_str)
                .is_none_or(|protocol| protocol == "TCP")
        })
        .filter_map(|port| {
            let number = port_number(port.get("port")?)?;
            let target = match port.get("targetPort") {
                None => TargetPort::Number(number),
                Some(Value::String(name)) if name.parse::<u16>().is_err() => {
                    TargetPort::Name(name.clone())
                }
                Some(target) => TargetPort::Number(port_number(target)?),
            };
            Some(ServicePort {
                port: number,
                target,
            })
        })
        .collect();
    Some(Service {
        name,
        namespace,
        selector,
        ports,
    })
}

/// A label value as kubectl would send it: a string, or a number or boolean written bare
/// (kubectl refuses those for labels; such a Service selects nothing here either).
fn scalar(value: &Value) -> Option<String> {
    value.as_str().map(str::to_string)
}

fn port_number(value: &Value) -> Option<u16> {
    let number = match value {
        Value::Number(number) => number.as_u64()?,
        Value::String(text) => text.parse().ok()?,
        _ => return None,
    };
    u16::try_from(number).ok().filter(|port| *port != 0)
}

/// What the Services say of one pod template: its hand-offs (`POD_PORT=SERVICE:PORT`, the
/// first Service for a pod port when several select it), and notes on what could not be used.
pub fn handoffs(
    services: &[Service],
    namespace: Option<&str>,
    labels: &[(String, String)],
    named_port: impl Fn(&str) -> Option<u16>,
) -> (Vec<(u16, String)>, Vec<String>) {
    let mut handoffs: Vec<(u16, String)> = Vec::new();
    let mut notes = Vec::new();
    let selects = |service: &Service| {
        service.namespace.as_deref() == namespace
            && service
                .selector
                .iter()
                .all(|wanted| labels.iter().any(|label| label == wanted))
    };
    for service in services.iter().filter(|service| selects(service)) {
        let host = match &service.namespace {
            Some(namespace) => format!("{}.{namespace}.svc", service.name),
            None => service.name.clone(),
        };
        for port in &service.ports {
            let pod_port = match &port.target {
                TargetPort::Number(number) => *number,
                TargetPort::Name(name) => match named_port(name) {
                    Some(number) => number,
                    None => {
                        notes.push(format!(
                            "Service {}: port {} names targetPort {name:?}, which no container declares; no hand-off for it",
                            service.name, port.port
                        ));
                        continue;
                    }
                },
            };
            if handoffs.iter().any(|(known, _)| *known == pod_port) {
                continue;
            }
            handoffs.push((pod_port, format!("{host}:{}", port.port)));
        }
    }
    (handoffs, notes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> Vec<Service> {
        let documents: Vec<Value> = yaml
            .split("\n---\n")
            .map(|document| serde_norway::from_str(document).unwrap())
            .collect();
        collect(documents.iter())
    }

    fn labels(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(key, value)| (key.to_string(), value.to_string()))
            .collect()
    }

    #[test]
    fn a_service_that_selects_the_pod_maps_its_target_ports() {
        let services = parse(
            "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec:\n  selector: {app: web}\n  ports:\n  - {port: 80, targetPort: 8080}\n  - {port: 443, targetPort: https}\n  - {port: 9000}\n  - {port: 53, protocol: UDP}\n",
        );
        let named = |name: &str| (name == "https").then_some(8443);
        let (handoffs, notes) = handoffs(
            &services,
            Some("shop"),
            &labels(&[("app", "web"), ("tier", "front")]),
            named,
        );
        assert_eq!(
            handoffs,
            [
                (8080, "web.shop.svc:80".to_string()),
                (8443, "web.shop.svc:443".to_string()),
                (9000, "web.shop.svc:9000".to_string()),
            ]
        );
        assert!(notes.is_empty(), "{notes:?}");
    }

    #[test]
    fn only_services_of_the_same_namespace_whose_selector_matches() {
        let services = parse(
            "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec: {selector: {app: web}, ports: [{port: 80, targetPort: 8080}]}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: other}\nspec: {selector: {app: other}, ports: [{port: 80, targetPort: 8081}]}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: elsewhere, namespace: prod}\nspec: {selector: {app: web}, ports: [{port: 80, targetPort: 8082}]}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: external}\nspec: {type: ExternalName, externalName: example.com, selector: {app: web}}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: manual}\nspec: {ports: [{port: 80, targetPort: 8083}]}\n",
        );
        let (handoffs, _) = handoffs(&services, None, &labels(&[("app", "web")]), |_| None);
        assert_eq!(handoffs, [(8080, "web:80".to_string())]);
    }

    #[test]
    fn a_named_target_port_no_container_declares_is_noted() {
        let services = parse(
            "kind: List\napiVersion: v1\nitems:\n- apiVersion: v1\n  kind: Service\n  metadata: {name: web}\n  spec: {selector: {app: web}, ports: [{port: 80, targetPort: http}]}\n",
        );
        let (handoffs, notes) = handoffs(&services, None, &labels(&[("app", "web")]), |_| None);
        assert!(handoffs.is_empty());
        assert!(notes[0].contains("targetPort \"http\""), "{notes:?}");
    }
}
