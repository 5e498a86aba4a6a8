//! What inject leaves alone, and why: a pod on the node's network, and a pod that another mesh
//! has meshed or is asked to mesh. Each passes through unchanged with a note on stderr (the
//! webhook's warnings), so that nobody is left wondering why a pod has no proxy.

use serde_norway::Value;

use super::spec::container_name;

/// Why the pod template must not be injected, if it must not.
pub(super) fn why_not(template: &Value) -> Option<String> {
    let spec = template.get("spec")?;
    if spec.get("hostNetwork") == Some(&Value::Bool(true)) {
        return Some(
            "it uses the node's network (hostNetwork), where the NAT rules would catch every \
             connection of the node and outlive the pod, and the proxy's ports would be the \
             node's"
                .into(),
        );
    }
    other_mesh(template).map(|mesh| {
        format!(
            "it is meshed by {mesh}; two proxies would compete for its traffic and ports. Take \
             it out of that mesh to mesh it with lameduck"
        )
    })
}

/// Containers that another mesh adds to the pods it meshes (Linkerd, Istio).
const OTHER_MESH_CONTAINERS: [(&str, &str); 5] = [
    ("linkerd-proxy", "Linkerd"),
    ("linkerd-init", "Linkerd"),
    ("istio-proxy", "Istio"),
    ("istio-init", "Istio"),
    ("istio-validation", "Istio"),
];

/// The mesh that has meshed, or will mesh, this pod template, and how it shows: one of its
/// containers, or the annotation or label that asks it to inject (a namespace's labels are not
/// in the manifest; the admission webhooks of both meshes then see our proxy and skip, or the
/// pod fails to start, which the warning in docs/kubernetes.md covers).
fn other_mesh(template: &Value) -> Option<String> {
    let spec = template.get("spec")?;
    for list in ["initContainers", "containers"] {
        for container in spec
            .get(list)
            .and_then(Value::as_sequence)
            .into_iter()
            .flatten()
        {
            let name = container_name(container);
            if let Some((_, mesh)) = OTHER_MESH_CONTAINERS.iter().find(|(n, _)| *n == name) {
                return Some(format!("{mesh} (container {name})"));
            }
        }
    }
    let metadata = template.get("metadata");
    let entry = |map: &str, key: &str| -> Option<String> {
        let value = metadata?.get(map)?.get(key)?;
        match value {
            Value::String(text) => Some(text.clone()),
            Value::Bool(flag) => Some(flag.to_string()),
            _ => None,
        }
    };
    let asks = |map: &str, key: &str, values: &[&str]| {
        entry(map, key)
            .filter(|value| values.contains(&value.as_str()))
            .map(|value| format!("{map} {key}: {value}"))
    };
    let linkerd = asks("annotations", "linkerd.io/inject", &["enabled", "ingress"]);
    let istio = asks("labels", "sidecar.istio.io/inject", &["true"])
        .or_else(|| asks("annotations", "sidecar.istio.io/inject", &["true"]))
        .or_else(|| {
            entry("labels", "istio.io/rev").map(|rev| format!("labels istio.io/rev: {rev}"))
        })
        .or_else(|| asks("labels", "istio.io/dataplane-mode", &["ambient"]));
    linkerd
        .map(|how| format!("Linkerd ({how})"))
        .or_else(|| istio.map(|how| format!("Istio ({how})")))
}
