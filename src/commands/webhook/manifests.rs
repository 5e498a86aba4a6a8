//! `lameduck webhook manifests`: what an administrator applies to run the webhook: its
//! Namespace, ServiceAccount (allowed to list Services, for the hand-off), Deployment and
//! Service, the `MutatingWebhookConfiguration`, and
//! its certificate: generated here (a CA, and a serving certificate it signs, with the CA in
//! the configuration's `caBundle`), or with `--cert-manager` an Issuer and a Certificate whose
//! CA cert-manager injects.
//!
//! Which pods are injected (webhook selectors see labels, not annotations): every pod of a
//! namespace labelled `lameduck.io/inject=enabled` unless the pod is labelled
//! `lameduck.io/inject=disabled`, and elsewhere the pods labelled `lameduck.io/inject=enabled`.
//! The system namespaces and the webhook's own are never selected.

use base64::Engine as _;
use clap::Args;

use crate::commands::inject;

/// The Service's port: the API server calls webhooks on 443 unless told otherwise.
const SERVICE_PORT: u16 = 443;
const LISTEN_PORT: u16 = 8443;
const ADMIN_PORT: u16 = 9995;
const NAME: &str = "lameduck-webhook";
/// Namespaces never injected, whatever their labels.
const SYSTEM_NAMESPACES: [&str; 3] = ["kube-system", "kube-public", "kube-node-lease"];

#[derive(Args, Debug)]
pub struct ManifestsArgs {
    /// The namespace the webhook runs in (never injected itself)
    #[arg(long, default_value = "lameduck")]
    namespace: String,
    /// The webhook's image (the proxy's image: the same binary)
    #[arg(long, value_name = "IMAGE", default_value = inject::DEFAULT_IMAGE)]
    image: String,
    /// The init container image injected pods get
    #[arg(long, value_name = "IMAGE", default_value = inject::DEFAULT_INIT_IMAGE)]
    init_image: String,
    /// Let cert-manager issue the serving certificate and fill in the CA, instead of
    /// generating them here
    #[arg(long)]
    cert_manager: bool,
    /// How long the generated certificates are valid, in days
    #[arg(long, value_name = "DAYS", default_value_t = 825)]
    validity_days: u32,
}

/// The manifests, as YAML documents; an error when the certificates cannot be made.
pub fn render(args: &ManifestsArgs) -> Result<String, String> {
    let valid = |name: &str| {
        (1..=63).contains(&name.len())
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !name.starts_with('-')
            && !name.ends_with('-')
    };
    if !valid(&args.namespace) {
        return Err(format!(
            "invalid --namespace {:?}: a namespace is a DNS label (a-z, 0-9, -); for example lameduck",
            args.namespace
        ));
    }
    // Quoted wherever it stands alone: `no` or `123` are namespaces, and YAML 1.1 values.
    let ns = &format!("\"{}\"", args.namespace);
    let dns = [
        format!("{NAME}.{}.svc", args.namespace),
        format!("{NAME}.{}.svc.cluster.local", args.namespace),
    ];
    let mut out = format!(
        r#"# lameduck's admission webhook: `lameduck webhook manifests | kubectl apply -f -`.
apiVersion: v1
kind: Namespace
metadata:
  name: {ns}
  labels:
    lameduck.io/inject: disabled
---
apiVersion: v1
kind: ServiceAccount
metadata:
  name: {NAME}
  namespace: {ns}
---
# The webhook reads the Services of a pod's namespace for the pod's hand-off; the workloads get
# no permission.
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: {NAME}
rules:
- apiGroups: [""]
  resources: [services]
  verbs: [list]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: {NAME}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: {NAME}
subjects:
- kind: ServiceAccount
  name: {NAME}
  namespace: {ns}
---
"#
    );
    let ca_bundle = if args.cert_manager {
        out.push_str(&cert_manager(ns, &dns));
        None
    } else {
        let (ca_pem, cert_pem, key_pem) = certificates(&dns, args.validity_days)?;
        let b64 = |text: &str| base64::engine::general_purpose::STANDARD.encode(text);
        out.push_str(&format!(
            r#"apiVersion: v1
kind: Secret
metadata:
  name: {NAME}-tls
  namespace: {ns}
type: kubernetes.io/tls
data:
  tls.crt: "{}"
  tls.key: "{}"
  ca.crt: "{}"
---
"#,
            b64(&cert_pem),
            b64(&key_pem),
            b64(&ca_pem)
        ));
        Some(b64(&ca_pem))
    };
    out.push_str(&deployment(args, ns));
    out.push_str(&format!(
        r#"---
apiVersion: v1
kind: Service
metadata:
  name: {NAME}
  namespace: {ns}
spec:
  selector:
    app: {NAME}
  ports:
  - name: https
    port: {SERVICE_PORT}
    targetPort: {LISTEN_PORT}
    protocol: TCP
---
"#
    ));
    out.push_str(&webhook_configuration(args, ns, ca_bundle.as_deref()));
    Ok(out)
}

/// A CA and a serving certificate for `dns` signed by it: (CA, certificate, key), PEM.
fn certificates(dns: &[String], days: u32) -> Result<(String, String, String), String> {
    let now = std::time::SystemTime::now();
    let until = now + std::time::Duration::from_secs(u64::from(days) * 86_400);
    let fail = |error: rcgen::Error| format!("cannot make the certificates: {error}");
    let ca_key = rcgen::KeyPair::generate().map_err(fail)?;
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(fail)?;
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
    ca.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
    ];
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "lameduck webhook CA");
    ca.not_before = now.into();
    ca.not_after = until.into();
    let ca = ca.self_signed(&ca_key).map_err(fail)?;
    let key = rcgen::KeyPair::generate().map_err(fail)?;
    let mut serving = rcgen::CertificateParams::new(dns.to_vec()).map_err(fail)?;
    serving
        .distinguished_name
        .push(rcgen::DnType::CommonName, dns[0].clone());
    serving.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    serving.not_before = now.into();
    serving.not_after = until.into();
    let serving = serving.signed_by(&key, &ca, &ca_key).map_err(fail)?;
    Ok((ca.pem(), serving.pem(), key.serialize_pem()))
}

/// A self-signed Issuer and the serving Certificate (cert-manager puts `ca.crt` beside it and
/// injects it into the webhook configuration).
fn cert_manager(ns: &str, dns: &[String]) -> String {
    format!(
        r#"apiVersion: cert-manager.io/v1
kind: Issuer
metadata:
  name: {NAME}
  namespace: {ns}
spec:
  selfSigned: {{}}
---
apiVersion: cert-manager.io/v1
kind: Certificate
metadata:
  name: {NAME}
  namespace: {ns}
spec:
  secretName: {NAME}-tls
  dnsNames:
  - {}
  - {}
  issuerRef:
    name: {NAME}
    kind: Issuer
  privateKey:
    algorithm: ECDSA
    size: 256
---
"#,
        dns[0], dns[1]
    )
}

fn deployment(args: &ManifestsArgs, ns: &str) -> String {
    format!(
        r#"apiVersion: apps/v1
kind: Deployment
metadata:
  name: {NAME}
  namespace: {ns}
spec:
  replicas: 2
  selector:
    matchLabels:
      app: {NAME}
  template:
    metadata:
      labels:
        app: {NAME}
        lameduck.io/inject: disabled
    spec:
      serviceAccountName: {NAME}
      containers:
      - name: webhook
        image: "{image}"
        command:
        - /usr/local/bin/lameduck
        - webhook
        - --listen
        - 0.0.0.0:{LISTEN_PORT}
        - --admin
        - 0.0.0.0:{ADMIN_PORT}
        - --tls-cert
        - /tls/tls.crt
        - --tls-key
        - /tls/tls.key
        - --namespace
        - {ns}
        - --image
        - "{image}"
        - --init-image
        - "{init_image}"
        ports:
        - name: https
          containerPort: {LISTEN_PORT}
          protocol: TCP
        - name: admin
          containerPort: {ADMIN_PORT}
          protocol: TCP
        readinessProbe:
          httpGet:
            path: /ready
            port: admin
          periodSeconds: 5
        livenessProbe:
          httpGet:
            path: /live
            port: admin
          periodSeconds: 10
        resources:
          requests:
            cpu: 10m
            memory: 20Mi
        securityContext:
          runAsNonRoot: true
          runAsUser: 65532
          readOnlyRootFilesystem: true
          allowPrivilegeEscalation: false
          capabilities:
            drop:
            - ALL
        volumeMounts:
        - name: tls
          mountPath: /tls
          readOnly: true
      volumes:
      - name: tls
        secret:
          secretName: {NAME}-tls
"#,
        image = args.image,
        init_image = args.init_image,
    )
}

/// Two webhooks: one for the pods of labelled namespaces, one for labelled pods elsewhere.
fn webhook_configuration(args: &ManifestsArgs, ns: &str, ca_bundle: Option<&str>) -> String {
    let annotations = match ca_bundle {
        None => format!(
            "  annotations:\n    cert-manager.io/inject-ca-from: \"{}/{NAME}\"\n",
            args.namespace
        ),
        Some(_) => String::new(),
    };
    let ca = match ca_bundle {
        Some(bundle) => format!("    caBundle: \"{bundle}\"\n"),
        None => String::new(),
    };
    let mut never: Vec<String> = SYSTEM_NAMESPACES.iter().map(|n| n.to_string()).collect();
    never.push(ns.to_string());
    let never: String = never
        .iter()
        .map(|name| format!("\n        - {name}"))
        .collect();
    let hook = |name: &str, namespace_label: &str, object_selector: &str| {
        format!(
            r#"- name: {name}
  admissionReviewVersions:
  - v1
  sideEffects: None
  failurePolicy: Ignore
  timeoutSeconds: 5
  reinvocationPolicy: Never
  matchPolicy: Equivalent
  clientConfig:
    service:
      name: {NAME}
      namespace: {ns}
      path: /mutate
      port: {SERVICE_PORT}
{ca}  rules:
  - apiGroups:
    - ""
    apiVersions:
    - v1
    operations:
    - CREATE
    resources:
    - pods
    scope: Namespaced
  namespaceSelector:
    matchExpressions:
    - key: kubernetes.io/metadata.name
      operator: NotIn
      values:{never}
{namespace_label}  objectSelector:
{object_selector}"#
        )
    };
    let in_labelled_namespaces = hook(
        "namespaces.inject.lameduck.io",
        "    - key: lameduck.io/inject\n      operator: In\n      values:\n        - enabled\n",
        "    matchExpressions:\n    - key: lameduck.io/inject\n      operator: NotIn\n      values:\n        - disabled\n",
    );
    let labelled_pods = hook(
        "pods.inject.lameduck.io",
        "    - key: lameduck.io/inject\n      operator: NotIn\n      values:\n        - enabled\n",
        "    matchLabels:\n      lameduck.io/inject: enabled\n",
    );
    format!(
        r#"apiVersion: admissionregistration.k8s.io/v1
kind: MutatingWebhookConfiguration
metadata:
  name: {NAME}
{annotations}webhooks:
{in_labelled_namespaces}{labelled_pods}"#
    )
}
