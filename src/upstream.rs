//! Connections to a route's target for HTTP: one pooled keep-alive client per route and HTTP
//! version (HTTP/1.1 towards HTTP/1 clients, HTTP/2 prior knowledge towards HTTP/2 clients).
//!
//! The connector ignores the request's URI and always dials the route's target (resolving a
//! host name at connect time), so the client's `Host` / `:authority` reaches the app unchanged.
//! Pooled connections run on their own tasks, outside the drain: they hold no client, and
//! during a drain every HTTP/1 request towards the target carries `connection: close`, so a
//! pooled connection closes as its last request finishes.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::Uri;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpStream;

use crate::config::{Direction, Target};
use crate::metrics::Metrics;
use crate::proxy::Payload;
use crate::tcp;

/// How long an idle pooled connection to a target is kept.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// The pooled clients of one route.
pub struct Upstream {
    pub http1: Client<Connector, Payload>,
    pub http2: Client<Connector, Payload>,
}

impl Upstream {
    pub fn new(
        target: Target,
        direction: Direction,
        connect_timeout: Duration,
        metrics: Arc<Metrics>,
    ) -> Upstream {
        let connector = Connector {
            target: Arc::new(target),
            direction,
            connect_timeout,
            metrics,
        };
        let mut builder = Client::builder(TokioExecutor::new());
        builder
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .pool_timer(TokioTimer::new());
        let http1 = builder.build(connector.clone());
        let http2 = builder
            .http2_only(true)
            .timer(TokioTimer::new())
            .build(connector);
        Upstream { http1, http2 }
    }
}

/// Dials the route's target, whatever the URI says.
#[derive(Clone)]
pub struct Connector {
    target: Arc<Target>,
    direction: Direction,
    connect_timeout: Duration,
    metrics: Arc<Metrics>,
}

impl tower_service::Service<Uri> for Connector {
    type Response = TokioIo<TcpStream>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<TokioIo<TcpStream>>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            match tcp::connect(&this.target, this.connect_timeout).await {
                Ok(stream) => {
                    let _ = stream.set_nodelay(true);
                    Ok(TokioIo::new(stream))
                }
                Err((failure, error)) => {
                    this.metrics.connect_failed(this.direction, failure);
                    Err(error)
                }
            }
        })
    }
}
