//! `lameduck webhook`: a mutating admission webhook that injects the proxy into pods as they are
//! created, so that a workload's annotations tune it wherever it comes from (Helm, operators,
//! CronJobs, `kubectl run`).
//!
//! It answers `AdmissionReview` v1 over HTTPS (`POST /mutate`; the API server calls webhooks over
//! TLS only) with a JSON Patch that makes the pod what `lameduck inject` writes for it
//! ([`admission`]), serving a certificate read from files and read again when they change
//! ([`tls`]). A plain port answers `/live`, `/ready` and `/metrics` for its probes. On SIGTERM
//! it stops accepting, finishes the reviews in flight and exits 0.

pub mod admission;
pub mod kube;
pub mod manifests;
pub mod tls;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use clap::Args;
use futures_util::StreamExt as _;
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use self::admission::{Outcome, Policy};
use crate::commands::inject::{self, InjectOptions};

const EXIT_FAILED: i32 = 1;
const EXIT_INVALID: i32 = 2;
/// The API server sends objects of at most about 3 MiB.
const MAX_REVIEW: usize = 4 * 1024 * 1024;
/// A client that has not sent its request by then is cut off.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Reviews in flight at SIGTERM get this long to finish.
const STOP_WAIT: Duration = Duration::from_secs(10);

#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct WebhookArgs {
    #[command(subcommand)]
    command: Option<WebhookCommand>,
    /// Where to serve admission reviews over HTTPS
    #[arg(long, value_name = "ADDR", default_value = "0.0.0.0:8443")]
    listen: SocketAddr,
    /// Where to serve /live, /ready and /metrics over plain HTTP
    #[arg(long, value_name = "ADDR", default_value = "0.0.0.0:9995")]
    admin: SocketAddr,
    /// The serving certificate (PEM, with its chain); read again when it changes
    #[arg(long, value_name = "FILE", required = true)]
    tls_cert: Option<PathBuf>,
    /// The serving certificate's private key (PEM)
    #[arg(long, value_name = "FILE", required = true)]
    tls_key: Option<PathBuf>,
    /// The proxy image injected pods get
    #[arg(long, value_name = "IMAGE", default_value = inject::DEFAULT_IMAGE)]
    image: String,
    /// The image of the init container that installs the NAT rules
    #[arg(long, value_name = "IMAGE", default_value = inject::DEFAULT_INIT_IMAGE)]
    init_image: String,
    /// Inject ordinary containers instead of native sidecars (clusters before 1.29)
    #[arg(long)]
    legacy_sidecar: bool,
    /// Refuse pods whose lameduck annotations are invalid (by default they start unmeshed,
    /// with a warning)
    #[arg(long)]
    deny_invalid: bool,
    /// The webhook's own namespace, whose pods are never injected (the manifests set it from
    /// the pod's own)
    #[arg(long, value_name = "NAMESPACE")]
    namespace: Option<String>,
    /// The Kubernetes API server, whose Services give injected pods their hand-off (by default
    /// the one a pod is given: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT; outside a
    /// pod, none: no hand-off)
    #[arg(long, value_name = "https://HOST:PORT")]
    kube_api: Option<String>,
    /// The token the webhook lists Services with (read again at each call)
    #[arg(long, value_name = "FILE", default_value_t = format!("{}/token", kube::SERVICE_ACCOUNT_DIR))]
    kube_token: String,
    /// The CA of the API server's certificate
    #[arg(long, value_name = "FILE", default_value_t = format!("{}/ca.crt", kube::SERVICE_ACCOUNT_DIR))]
    kube_ca: String,
}

#[derive(clap::Subcommand, Debug)]
enum WebhookCommand {
    /// Print the manifests that run the webhook on a cluster (pipe them to kubectl apply)
    Manifests(manifests::ManifestsArgs),
}

/// What every request of the webhook shares.
struct Webhook {
    policy: Policy,
    /// Where the Services of a pod's namespace come from, if anywhere.
    api: Option<kube::Api>,
    /// At most one warning a minute about Services that could not be listed.
    api_log: std::sync::Mutex<crate::logging::Throttle>,
    reviews: Family<[(&'static str, &'static str); 1], Counter>,
    bad_requests: Counter,
    registry: Registry,
    ready: AtomicBool,
}

/// `lameduck webhook`: 0 after SIGTERM, 1 when it cannot serve, 2 for bad arguments.
pub fn run(args: WebhookArgs) -> i32 {
    if let Some(WebhookCommand::Manifests(manifests)) = &args.command {
        return match manifests::render(manifests) {
            Ok(yaml) => {
                print!("{yaml}");
                0
            }
            Err(error) => {
                eprintln!("lameduck webhook manifests: {error}");
                EXIT_INVALID
            }
        };
    }
    crate::logging::init("info", crate::config::LogFormat::Plain);
    let (Some(cert), Some(key)) = (&args.tls_cert, &args.tls_key) else {
        eprintln!("lameduck webhook: --tls-cert and --tls-key are needed");
        return EXIT_INVALID;
    };
    let certs = match tls::Reloading::new(cert, key) {
        Ok(certs) => Arc::new(certs),
        Err(error) => {
            eprintln!("lameduck webhook: {error}");
            return EXIT_INVALID;
        }
    };
    let api = match kube::Api::new(
        args.kube_api.as_deref(),
        args.kube_token.clone().into(),
        args.kube_ca.clone().into(),
    ) {
        Ok(api) => api,
        // In a pod without the API's CA (no ServiceAccount token mounted): no hand-offs.
        Err(error) if args.kube_api.is_none() => {
            eprintln!("lameduck webhook: no hand-offs from Services: {error}");
            None
        }
        Err(error) => {
            eprintln!("lameduck webhook: {error}");
            return EXIT_INVALID;
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("lameduck webhook: cannot start the runtime: {error}");
            return EXIT_FAILED;
        }
    };
    runtime.block_on(serve(args, certs, api))
}

async fn serve(args: WebhookArgs, certs: Arc<tls::Reloading>, api: Option<kube::Api>) -> i32 {
    let bind = |addr: SocketAddr| crate::net::bind(addr, false);
    let (reviews_listener, admin_listener) = match (bind(args.listen), bind(args.admin)) {
        (Ok(reviews), Ok(admin)) => (reviews, admin),
        (Err(error), _) | (_, Err(error)) => {
            eprintln!("lameduck webhook: cannot listen: {error}");
            return EXIT_FAILED;
        }
    };
    let mut registry = Registry::with_prefix("lameduck_webhook");
    let reviews = Family::default();
    registry.register(
        "reviews",
        "Admission reviews answered, by outcome: injected, skipped, invalid (allowed unmeshed), denied",
        reviews.clone(),
    );
    let bad_requests = Counter::default();
    registry.register(
        "bad_requests",
        "Requests that were not admission reviews (answered 400)",
        bad_requests.clone(),
    );
    let webhook = Arc::new(Webhook {
        policy: Policy {
            inject: InjectOptions {
                image: args.image,
                init_image: args.init_image,
                native_sidecar: !args.legacy_sidecar,
                services: Vec::new(),
            },
            deny_invalid: args.deny_invalid,
            own_namespace: args.namespace,
        },
        api,
        api_log: std::sync::Mutex::new(crate::logging::Throttle::new(Duration::from_secs(60))),
        reviews,
        bad_requests,
        registry,
        ready: AtomicBool::new(true),
    });
    let local = |listener: &TcpListener, fallback| listener.local_addr().unwrap_or(fallback);
    let services_from = webhook
        .api
        .as_ref()
        .map_or("nowhere (no hand-offs)".to_string(), kube::Api::address);
    info!(listen = %local(&reviews_listener, args.listen), admin = %local(&admin_listener, args.admin), services_from, "webhook serving");
    tokio::spawn(serve_admin(admin_listener, webhook.clone()));

    let acceptor = tokio_rustls::TlsAcceptor::from(tls::server_config(certs));
    let tracker = TaskTracker::new();
    let mut signals = match signal_hook_tokio::Signals::new([libc::SIGTERM, libc::SIGINT]) {
        Ok(signals) => signals,
        Err(error) => {
            eprintln!("lameduck webhook: cannot install signal handlers: {error}");
            return EXIT_FAILED;
        }
    };
    loop {
        let (stream, peer) = tokio::select! {
            // The kubelet stops the webhook's pod.
            _ = signals.next() => break,
            accepted = reviews_listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    debug!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let (acceptor, webhook) = (acceptor.clone(), webhook.clone());
        tracker.spawn(async move {
            let handshake = tokio::time::timeout(HEADER_READ_TIMEOUT, acceptor.accept(stream));
            let stream = match handshake.await {
                Ok(Ok(stream)) => stream,
                Ok(Err(error)) => return debug!(%peer, %error, "TLS handshake failed"),
                Err(_) => return debug!(%peer, "TLS handshake timed out"),
            };
            let service = hyper::service::service_fn(move |request| {
                let webhook = webhook.clone();
                async move { Ok::<_, Infallible>(answer(&webhook, request).await) }
            });
            let served = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service)
                .await;
            if let Err(error) = served {
                debug!(%peer, %error, "connection ended with an error");
            }
        });
    }
    info!("stopping: finishing the reviews in flight");
    webhook.ready.store(false, Ordering::Release);
    drop(reviews_listener);
    tracker.close();
    let _ = tokio::time::timeout(STOP_WAIT, tracker.wait()).await;
    0
}

/// The policy with the Services of the review's namespace, for the pod's hand-off; `None`
/// when there are none to be had (no API server, not a pod's review, the API did not answer).
async fn with_services(webhook: &Webhook, body: &[u8]) -> Option<Policy> {
    let api = webhook.api.as_ref()?;
    let namespace = admission::pod_namespace(body)?;
    match api.services(&namespace).await {
        Ok(services) => {
            let mut policy = webhook.policy.clone();
            policy.inject.services = services.to_vec();
            Some(policy)
        }
        Err(error) => {
            if let Some(suppressed) = crate::sync::lock(&webhook.api_log).due() {
                warn!(%namespace, %error, suppressed, "cannot list the Services of the pod's namespace: the pod is injected without a hand-off");
            }
            None
        }
    }
}

/// One request on the HTTPS port.
async fn answer(webhook: &Webhook, request: Request<Incoming>) -> Response<Full<Bytes>> {
    if request.uri().path() != "/mutate" {
        return text(StatusCode::NOT_FOUND, "not found\n");
    }
    if request.method() != Method::POST {
        return text(StatusCode::METHOD_NOT_ALLOWED, "POST an AdmissionReview\n");
    }
    let body = match Limited::new(request.into_body(), MAX_REVIEW)
        .collect()
        .await
    {
        Ok(body) => body.to_bytes(),
        Err(error) => {
            webhook.bad_requests.inc();
            return text(
                StatusCode::BAD_REQUEST,
                &format!("cannot read the review: {error}\n"),
            );
        }
    };
    let policy = match with_services(webhook, &body).await {
        Some(policy) => std::borrow::Cow::Owned(policy),
        None => std::borrow::Cow::Borrowed(&webhook.policy),
    };
    match admission::review(&body, &policy) {
        Ok((answer, outcome)) => {
            webhook
                .reviews
                .get_or_create(&[("outcome", outcome.label())])
                .inc();
            match &outcome {
                Outcome::Injected => info!("pod injected"),
                Outcome::Skipped(why) => debug!(why, "pod left as it is"),
                Outcome::Invalid { denied, message } => {
                    warn!(denied, "{message}");
                }
            }
            let mut response = Response::new(Full::new(Bytes::from(answer.to_string())));
            response.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("application/json"),
            );
            response
        }
        Err(error) => {
            webhook.bad_requests.inc();
            text(StatusCode::BAD_REQUEST, &format!("{}\n", error.0))
        }
    }
}

/// `/live`, `/ready` and `/metrics` on the plain port.
async fn serve_admin(listener: TcpListener, webhook: Arc<Webhook>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let webhook = webhook.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                let webhook = webhook.clone();
                async move {
                    let response = match request.uri().path() {
                        "/live" => text(StatusCode::OK, "live\n"),
                        "/ready" if webhook.ready.load(Ordering::Acquire) => {
                            text(StatusCode::OK, "ready\n")
                        }
                        "/ready" => text(StatusCode::SERVICE_UNAVAILABLE, "not ready\n"),
                        "/metrics" => {
                            let mut body = String::new();
                            let _ = encode(&mut body, &webhook.registry);
                            text(StatusCode::OK, &body)
                        }
                        _ => text(StatusCode::NOT_FOUND, "not found\n"),
                    };
                    Ok::<_, Infallible>(response)
                }
            });
            let _ = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn text(status: StatusCode, body: &str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
    *response.status_mut() = status;
    response
}
