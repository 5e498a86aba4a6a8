//! The HTTP proxy service: one request from a client, forwarded to the route's target.
//!
//! It strips hop-by-hop headers both ways, keeps the client's HTTP version towards the target,
//! streams bodies and trailers without buffering, turns WebSocket upgrades and CONNECT into
//! tracked tunnels, answers 502/504 when the target cannot be reached in time (short bodies
//! naming the target), and during a drain asks HTTP/1 clients and targets to close
//! (`connection: close`). A target that fails mid-response makes the client's response fail
//! too (hyper aborts the HTTP/1 connection or resets the HTTP/2 stream): never a response that
//! looks complete.

use std::io;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use futures_util::FutureExt;
use futures_util::future::Either;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{
    CONNECTION, CONTENT_LENGTH, CONTENT_TYPE, HeaderName, HeaderValue, TRANSFER_ENCODING, UPGRADE,
};
use hyper::upgrade::OnUpgrade;
use hyper::{Method, Request, Response, StatusCode, Version};
use hyper_util::rt::TokioIo;
use tracing::{Instrument, debug};

use super::body::{BodyError, BodyStalled, Held, Payload, RequestBodyGuard, Stall, reached_end};
use super::client::{Lease, SendError, UnreadAware, Upstream};
use super::context::{ConnCtx, HttpVersion};
use super::ending::{self, Ending, Step};
use super::headers::{
    absolute_uri, check_framing, check_response, is_connect_success, is_websocket, origin_form,
    strip_hop_by_hop, wants_upgrade,
};
use super::io::ServerIo;
use super::policy::{self, BadResponse, Synthetic, Unanswered};
use crate::conns::{ConnProtocol, Connection};
use crate::metrics::Timeout;
use crate::proxy::tcp;
use crate::sync::lock;

/// Forwards one request. What the connection must know at once (a request started, its body
/// is being read, it may upgrade) is recorded when hyper calls the service, before the future
/// first runs: hyper keeps reading the socket in between, and an HTTP/1 connection that looked
/// idle then would be parked (see `http::serve_http1`).
pub fn handle(
    ctx: Arc<ConnCtx>,
    request: Request<Incoming>,
) -> impl Future<Output = Result<Response<ProxyBody>, BodyError>> {
    ctx.request_started();
    let in_flight = InFlight::start(&ctx);
    // Watched from the start: a body dropped unread on any path below is noticed.
    let body_watch = watch_request_body(&ctx, &request);
    if ctx.version == HttpVersion::Http1
        && (request.headers().contains_key(UPGRADE) || request.method() == Method::CONNECT)
    {
        // hyper hands the socket over after a 101 (it treats any `Upgrade` header as a
        // possible upgrade): such a connection is never parked.
        ctx.never_park();
    }
    forward(ctx, request, in_flight, body_watch)
}

// Not `async fn`s, here and in `send`: hyper stores this future for every request
// (docs/architecture.md, "One note on `async fn`").
#[allow(clippy::manual_async_fn)]
fn forward(
    ctx: Arc<ConnCtx>,
    mut request: Request<Incoming>,
    in_flight: InFlight,
    mut body_watch: Option<RequestBodyGuard>,
) -> impl Future<Output = Result<Response<ProxyBody>, BodyError>> {
    async move {
        if let Err(refused) = check_framing(&request, ctx.version) {
            // The rest of what the client sent cannot be trusted to be framed right.
            return Ok(error_response(&ctx, refused.closing(), in_flight));
        }
        let version = request.version();
        let is_head = request.method() == Method::HEAD;
        let grpc = ctx.version == HttpVersion::Http2 && ending::is_grpc(request.headers());
        let upgrading = ctx.version == HttpVersion::Http1 && wants_upgrade(&request);
        let client_upgrade = upgrading.then(|| hyper::upgrade::on(&mut request));
        let upgrading_to_websocket = upgrading && is_websocket(&request);
        let handed_off = request.headers().contains_key(policy::HANDOFF_HEADER);
        strip_hop_by_hop(request.headers_mut(), upgrading, true);
        if let Some(mark) = &ctx.upstream.handoff_mark {
            if handed_off {
                // Another leaving pod handed it here: one hop at most, that pod sends it on.
                let mut response = error_response(&ctx, Synthetic::handed_off_already(), in_flight);
                response.headers_mut().insert(
                    policy::HANDOFF_HEADER,
                    HeaderValue::from_static(policy::HANDOFF_REFUSED),
                );
                return Ok(response);
            }
            request
                .headers_mut()
                .insert(policy::HANDOFF_HEADER, mark.clone());
        }
        let handing_off = ctx.upstream.handoff_mark.is_some();
        if ctx.closing() && !upgrading && !handing_off && request.version() != Version::HTTP_2 {
            // The pooled connection to the target closes once this request is done (a
            // hand-off's target is another pod, which stays: its pool is kept).
            request
                .headers_mut()
                .insert(CONNECTION, HeaderValue::from_static("close"));
        }
        let target = &ctx.upstream.name;
        let uri = match ctx.version {
            HttpVersion::Http1 => origin_form(&mut request, target),
            HttpVersion::Http2 => absolute_uri(&mut request, target),
        };
        if let Err(()) = uri {
            let refused = Synthetic::bad_request("invalid Host");
            return Ok(error_response(&ctx, refused, in_flight));
        }
        // Interim responses reach an HTTP/1.1 client (hyper's server cannot write them: the
        // socket does, see `context::Interim`).
        if ctx.version == HttpVersion::Http1 && version == Version::HTTP_11 && !upgrading {
            let interim_ctx = ctx.clone();
            hyper::ext::on_informational(&mut request, move |interim| {
                let code = interim.status().as_u16();
                if policy::status(code) != Ok(policy::Status::Interim) {
                    return;
                }
                let headers: Vec<(&str, &[u8])> = interim
                    .headers()
                    .iter()
                    .map(|(name, value)| (name.as_str(), value.as_bytes()))
                    .collect();
                let mut head = Vec::new();
                policy::write_interim(&mut head, code, headers.into_iter());
                interim_ctx.interim.push(&head);
            });
        }

        let limit = ctx.proxy.http.body_timeout;
        let timeouts = ctx.proxy.metrics.timeout_counter(Timeout::RequestBody);
        let payload = |body| match body_watch.take() {
            Some(watch) => Payload::Request(body, watch, Stall::new(limit, timeouts)),
            None => Payload::Stream(body, Stall::new(limit, timeouts)),
        };
        // One send future, awaited with or without the response timeout: a `Timeout` around it
        // in one branch and the bare future in the other would hold it twice in this future.
        // (The request goes into it directly, not through a local that this future would hold.)
        let upstream = &ctx.upstream;
        let mut sent = pin!(send(upstream, ctx.version, request.map(payload)));
        let mut limit = pin!(ctx.proxy.http.response_timeout.map(tokio::time::sleep));
        let interim = &ctx.interim;
        // The connection's time in the close-spread window may come first: HTTP/2's token
        // wakes the stream's task; an HTTP/1 connection's task polls this future again right
        // after setting the flag (h1.rs), so a load of it is all a poll costs.
        let mut ended = pin!(async {
            match &ctx.ending {
                Some(ending) => ending.cancelled().await,
                None => {
                    std::future::poll_fn(|_| match ctx.streams_ending() {
                        true => Poll::Ready(()),
                        false => Poll::Pending,
                    })
                    .await
                }
            }
        });
        let responded = std::future::poll_fn(|cx| {
            if ctx.version == HttpVersion::Http1 {
                interim.register(cx.waker());
            }
            if let Poll::Ready(result) = sent.as_mut().poll(cx) {
                return Poll::Ready(Waited::Response(result));
            }
            if ended.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Waited::Ended);
            }
            match limit.as_mut().as_pin_mut() {
                Some(sleep) => sleep.poll(cx).map(|()| Waited::TimedOut),
                None => Poll::Pending,
            }
        });
        let result = match responded.await {
            Waited::Response(result) => result,
            Waited::TimedOut => {
                let answer = Synthetic::no_response_in_time(target);
                return Ok(error_response(&ctx, answer, in_flight));
            }
            // Dropping the request cancels it at the app: gRPC's client hears status 14;
            // another HTTP/2 stream is reset (CANCEL), an HTTP/1 connection closed.
            Waited::Ended if grpc => return Ok(grpc_unavailable(in_flight, &ctx)),
            Waited::Ended => return Err(ending::cancel()),
        };
        let (mut response, lease) = match result {
            Ok(sent) => sent,
            Err(failure) => {
                let answer = match failure.kind {
                    FailureKind::ConnectTimeout => Synthetic::cannot_connect(target, true),
                    FailureKind::Connect => Synthetic::cannot_connect(target, false),
                    FailureKind::ClosedBeforeResponse | FailureKind::Respond => {
                        Synthetic::bad_response(target, BadResponse::Unreadable)
                    }
                    FailureKind::Bad(why) => Synthetic::bad_response(target, why),
                    FailureKind::RequestBodyStalled => Synthetic::request_body_stalled(),
                    FailureKind::RequestBodyBroken => Synthetic::request_body_broken(),
                };
                let error = &failure.error;
                let status = answer.status;
                if ctx.upstream.handoff_mark.is_some() {
                    let protocol = match ctx.version {
                        HttpVersion::Http1 => ConnProtocol::Http1,
                        HttpVersion::Http2 => ConnProtocol::Http2,
                    };
                    ctx.proxy.metrics.handoff_failed(protocol);
                    debug!(error = %error, %status, target = %target, "a late request could not be handed off to the Service");
                }
                debug!(error = %error, source = ?error.source(), %status, "forwarding failed");
                return Ok(error_response(&ctx, answer, in_flight));
            }
        };

        let upgraded = match client_upgrade {
            Some(client_upgrade)
                if response.status() == StatusCode::SWITCHING_PROTOCOLS
                    || is_connect_success(&response) =>
            {
                // A 2xx to CONNECT has no body, whatever its headers say (RFC 9110 section
                // 9.3.6): the tunnel starts right after the head.
                if response.status().is_success() {
                    response.headers_mut().remove(CONTENT_LENGTH);
                    response.headers_mut().remove(TRANSFER_ENCODING);
                }
                let target_upgrade = hyper::upgrade::on(&mut response);
                let framing = match upgrading_to_websocket {
                    true => tcp::Framing::WebSocket,
                    false => tcp::Framing::Bytes,
                };
                spawn_tunnel(&ctx, client_upgrade, target_upgrade, framing);
                true
            }
            _ => false,
        };
        if !upgraded && let Err(bad) = check_response(&mut response, is_head) {
            let answer = Synthetic::bad_response(target, bad);
            return Ok(error_response(&ctx, answer, in_flight));
        }
        strip_hop_by_hop(response.headers_mut(), upgraded, false);
        let target_http10 = response.version() == Version::HTTP_10;
        // The client hears its own HTTP version, whatever the target spoke.
        *response.version_mut() = version;
        if ctx.closing() && !upgraded && ctx.version == HttpVersion::Http1 {
            response
                .headers_mut()
                .insert(CONNECTION, HeaderValue::from_static("close"));
        }
        in_flight.record_status(&ctx, response.status());
        // An upgraded connection is the tunnel's now; it never goes back to the pool. A response
        // without a body is read to its end already (hyper will not poll it).
        // Nor does one that spoke HTTP/1.0 (the policy's rule).
        let lease = lease
            .filter(|_| !upgraded && !target_http10)
            .map(|mut lease| {
                if response.body().is_end_stream() {
                    lease.done();
                }
                lease
            });
        // How the body ends if it is still streaming at the connection's time in the
        // close-spread window.
        let kind = if grpc {
            ending::Kind::Grpc(ending::Messages::default())
        } else if ending::is_event_stream(response.headers()) {
            ending::Kind::Events
        } else {
            ending::Kind::Cut
        };
        let ending = (!upgraded).then(|| Ending::new(ctx.clone(), kind));
        let stall = Stall::new(
            ctx.proxy.http.body_timeout,
            ctx.proxy.metrics.timeout_counter(Timeout::ResponseBody),
        );
        Ok(response.map(|body| {
            let mut body = ProxyBody::new(Payload::Stream(body, stall), lease, ending);
            body._in_flight = Some(in_flight);
            body
        }))
    }
}

/// Sends a request. A bodiless idempotent request whose pooled connection the target closed
/// before answering (the keep-alive race) is sent once more, on another connection, as RFC 9110
/// section 9.2.2 allows. Outbound, a request that got no answer goes again as the policy and
/// the retry budget allow (`retry.rs`). Anything else is never sent twice.
#[allow(clippy::manual_async_fn)]
fn send(
    upstream: &Upstream,
    version: HttpVersion,
    request: Request<Payload>,
) -> impl Future<Output = Result<(Response<Incoming>, Option<Lease>), Failure>> + '_ {
    async move {
        let retries = upstream.retries.as_ref();
        if let Some(retries) = retries {
            retries.deposit();
        }
        let has_body = !request.body().is_end_stream();
        // Outbound, a request's body is kept as it goes (up to a bound), to send it whole
        // again should the target reset the connection without reading it.
        let (held, request) = match retries.is_some() && has_body {
            true => {
                let (parts, body) = request.into_parts();
                let (held, body) = Held::keep(body);
                (Some(held), Request::from_parts(parts, body))
            }
            false => (None, request),
        };
        // The request's parts, to send it again; the headers as a list, not a second map: a
        // map's clone also copies its hash index, and the copy is almost never used.
        let parts = (retries.is_some() || (!has_body && replayable(&request))).then(|| {
            let headers: Vec<(HeaderName, HeaderValue)> = request
                .headers()
                .iter()
                .map(|(name, value)| (name.clone(), value.clone()))
                .collect();
            (
                request.method().clone(),
                request.uri().clone(),
                request.version(),
                headers,
            )
        });
        let method = request.method().clone();
        let mut next = Some(request);
        let mut replayed = false;
        let mut tries = policy::Tries::default();
        loop {
            let request = match (next.take(), &parts) {
                (Some(request), _) => request,
                (None, Some((method, uri, version_of_request, headers))) => {
                    let body = match &held {
                        Some(held) => Held::again(held),
                        None => Payload::Bytes(None),
                    };
                    let mut again = Request::new(body);
                    *again.method_mut() = method.clone();
                    *again.uri_mut() = uri.clone();
                    *again.version_mut() = *version_of_request;
                    again.headers_mut().extend(headers.iter().cloned());
                    again
                }
                (None, None) => unreachable!("a request is sent again only whole or rebuilt"),
            };
            // A replay goes on a new connection: another idle one may be closing too (a target
            // that closes idle connections after a timeout closes those last used together at
            // once).
            let mut failure = match send_once(upstream, version, request, replayed).await {
                Ok((response, _)) if upstream.handoff_mark.is_some() && handed_back(&response) => {
                    Failure::handed_back()
                }
                Err(failure) => failure,
                sent => return sent,
            };
            let unsent = failure.unsent.take().map(|request| *request);
            if failure.kind == FailureKind::ClosedBeforeResponse
                && !replayed
                && !has_body
                && parts.is_some()
            {
                debug!(error = %failure.error, "the target closed a pooled connection before answering; retrying once");
                replayed = true;
                next = unsent;
                continue;
            }
            let (Some(retries), Some(unanswered)) = (retries, failure.unanswered) else {
                return Err(failure);
            };
            // The body can go again whole: handed back unsent, or kept as far as it went with
            // the rest still to come.
            let body_whole =
                unsent.is_some() || held.as_ref().is_some_and(|held| lock(held).can_go_again());
            let handoff = upstream.handoff_mark.is_some();
            let allowed = tries.left(unanswered, handoff)
                && (unsent.is_some() || (parts.is_some() && (!has_body || body_whole)))
                && policy::may_retry(unanswered, method.as_str().as_bytes(), has_body, body_whole);
            if !allowed || !retries.withdraw(unanswered, &upstream.name) {
                return Err(failure);
            }
            debug!(error = %failure.error, reason = unanswered.as_str(), "no answer; sending the request again");
            tries.took(unanswered);
            next = unsent;
        }
    }
}

/// Not an `async fn`: the request goes straight into the pool's future instead of being held
/// once more by this one.
fn send_once<'a>(
    upstream: &'a Upstream,
    version: HttpVersion,
    request: Request<Payload>,
    fresh: bool,
) -> impl Future<Output = Result<(Response<Incoming>, Option<Lease>), Failure>> + 'a {
    match version {
        HttpVersion::Http1 => Either::Left(upstream.http1.send(request, fresh).map(|sent| {
            sent.map(|(response, lease)| (response, Some(lease)))
                .map_err(Failure::from)
        })),
        HttpVersion::Http2 => Either::Right(
            upstream
                .http2
                .send(request)
                .map(|sent| sent.map(|response| (response, None)).map_err(Failure::from)),
        ),
    }
}

impl From<SendError> for Failure {
    fn from(error: SendError) -> Failure {
        match error {
            SendError::Connect(error) => Failure::not_connected(error, None),
            SendError::NotConnected(error, request) => Failure::not_connected(error, Some(request)),
            SendError::Http(error) => Failure::of(error, true),
            SendError::Fresh(error) => Failure::of(error, false),
            SendError::BadHead(why) => Failure {
                kind: FailureKind::Bad(why),
                error: format!("the target {}", why.why()).into(),
                unanswered: None,
                unsent: None,
            },
            SendError::Unsent(error, request) => Failure {
                unanswered: Some(Unanswered::NotSent),
                unsent: Some(request),
                ..Failure::of(error, false)
            },
        }
    }
}

/// Why a request got no response from the target.
struct Failure {
    kind: FailureKind,
    error: Box<dyn std::error::Error + Send + Sync>,
    /// Whether, and why, it may be sent again (see [`policy::may_retry`]); `None`: the target
    /// answered (badly), or the client's side failed.
    unanswered: Option<Unanswered>,
    /// The request, handed back whole: it was never sent.
    unsent: Option<Box<Request<Payload>>>,
}

impl Failure {
    /// A hand-off that the Service sent to another leaving pod, which refused it unsent.
    fn handed_back() -> Failure {
        Failure {
            kind: FailureKind::Respond,
            error: "the Service sent the hand-off to another pod that is going away".into(),
            unanswered: Some(Unanswered::NotSent),
            unsent: None,
        }
    }

    fn not_connected(error: io::Error, request: Option<Box<Request<Payload>>>) -> Failure {
        Failure {
            kind: match error.kind() {
                io::ErrorKind::TimedOut => FailureKind::ConnectTimeout,
                _ => FailureKind::Connect,
            },
            error: error.into(),
            unanswered: Some(Unanswered::NotConnected),
            unsent: request,
        }
    }

    /// A failure on a connection: `reused` for the pool's, where a close before the response is
    /// the keep-alive race; on a connection dialled for the request it is the target's answer.
    fn of(error: hyper::Error, reused: bool) -> Failure {
        let unanswered = unanswered(&error);
        let kind = if stalled(&error) {
            FailureKind::RequestBodyStalled
        } else if error.is_user() {
            // The request body failed on the client's side: a malformed chunk, a client gone
            // mid-body.
            FailureKind::RequestBodyBroken
        } else if reused
            && (error.is_incomplete_message()
                || error.is_canceled()
                || unanswered == Some(Unanswered::Unread))
        {
            // The keep-alive race: closed, or reset with the request unread, before any byte
            // of a response on a connection the pool lent.
            FailureKind::ClosedBeforeResponse
        } else if error.is_parse() && error.to_string().contains("content-length") {
            // hyper's parser refuses a bad length where there is a body; the policy names it.
            FailureKind::Bad(BadResponse::Length)
        } else {
            FailureKind::Respond
        };
        Failure {
            kind,
            error: error.into(),
            unanswered,
            unsent: None,
        }
    }
}

/// What a connection's failure says of the request on it: refused unprocessed by an HTTP/2
/// target (`REFUSED_STREAM`, or above a GOAWAY's last stream), or cut before any response (the
/// connection closed or reset: the app may have seen it). A response the target sent, however
/// bad, is an answer; so is a failure of the client's own request body.
fn unanswered(error: &hyper::Error) -> Option<Unanswered> {
    if error.is_user() || error.is_parse() || error.is_timeout() || stalled(error) {
        return None;
    }
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        if let Some(h2) = cause.downcast_ref::<h2::Error>()
            && (h2.reason() == Some(h2::Reason::REFUSED_STREAM) || h2.is_go_away())
        {
            return Some(Unanswered::NotSent);
        }
        if cause
            .downcast_ref::<io::Error>()
            .is_some_and(|io| io.kind() == io::ErrorKind::ConnectionReset)
        {
            return Some(Unanswered::Unread);
        }
        source = cause.source();
    }
    Some(Unanswered::MayHaveReached)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FailureKind {
    /// No connection within the connect timeout (504).
    ConnectTimeout,
    /// The target refused the connection or could not be resolved (502).
    Connect,
    /// A reused connection that the target had closed (502, unless the request is replayed).
    ClosedBeforeResponse,
    /// The connection failed before the response's head arrived (502).
    Respond,
    /// A response head the policy refuses: a bad length, too large (502).
    Bad(BadResponse),
    /// The client's request body stopped arriving before the response's head (408).
    RequestBodyStalled,
    /// The client's request body was malformed (a bad chunk) or cut short (400).
    RequestBodyBroken,
}

/// Whether `error` comes from a request body that stalled.
fn stalled(error: &hyper::Error) -> bool {
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        if cause.is::<BodyStalled>() {
            return true;
        }
        source = cause.source();
    }
    false
}

/// Whether a hand-off's response is another leaving pod's refusal
/// ([`Synthetic::handed_off_already`]).
fn handed_back(response: &Response<Incoming>) -> bool {
    response.status() == StatusCode::SERVICE_UNAVAILABLE
        && response
            .headers()
            .get(policy::HANDOFF_HEADER)
            .is_some_and(|value| value == policy::HANDOFF_REFUSED)
}

/// Whether the request may be sent again if the keep-alive race strikes (the policy's rule;
/// the race itself, a reused connection, is what `ClosedBeforeResponse` says).
fn replayable(request: &Request<Payload>) -> bool {
    let has_body = !request.body().is_end_stream();
    policy::may_replay(request.method().as_str().as_bytes(), has_body, true)
}

/// The proxy's own answer (see [`Synthetic`]), as hyper writes it.
fn error_response(ctx: &ConnCtx, answer: Synthetic, in_flight: InFlight) -> Response<ProxyBody> {
    let mut response = Response::new(ProxyBody::new(
        Payload::Bytes(Some(Bytes::from(answer.body))),
        None,
        None,
    ));
    *response.status_mut() = answer.status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    if (answer.close || ctx.closing()) && ctx.version == HttpVersion::Http1 {
        response
            .headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
    }
    in_flight.record_status(ctx, answer.status);
    response.body_mut()._in_flight = Some(in_flight);
    response
}

/// A gRPC call whose connection's time in the close-spread window came before its response:
/// a trailers-only response, `grpc-status: 14`, which the client's channel retries elsewhere.
fn grpc_unavailable(in_flight: InFlight, ctx: &ConnCtx) -> Response<ProxyBody> {
    let mut response = Response::new(ProxyBody::new(Payload::Bytes(None), None, None));
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    ending::grpc_unavailable(headers);
    in_flight.record_status(ctx, StatusCode::OK);
    response.body_mut()._in_flight = Some(in_flight);
    response
}

/// What a request waited for came: the response, the response timeout, or its connection's
/// time in the close-spread window.
enum Waited<T> {
    Response(T),
    TimedOut,
    Ended,
}

/// Joins the client's and the target's upgraded connections as a tunnel, tracked by the
/// drain like a TCP connection: untouched by `go_away`, reset by `terminate`.
fn spawn_tunnel(ctx: &Arc<ConnCtx>, client: OnUpgrade, target: OnUpgrade, framing: tcp::Framing) {
    let registration = ctx.registration.clone();
    let (spread, terminate) = (ctx.spread.clone(), ctx.terminate.clone());
    let side = ctx.proxy.drain.side(ctx.conn().direction());
    let proxy = ctx.proxy.clone();
    let tunnel = async move {
        let (client, target) = match tokio::try_join!(client, target) {
            Ok(pair) => pair,
            Err(error) => {
                debug!(%error, "upgrade failed");
                return;
            }
        };
        let conn = registration.conn();
        conn.set_protocol(match framing {
            tcp::Framing::WebSocket => ConnProtocol::WebSocket,
            tcp::Framing::Bytes => ConnProtocol::Tunnel,
        });
        match (
            client.downcast::<TokioIo<ServerIo>>(),
            target.downcast::<TokioIo<UnreadAware>>(),
        ) {
            (Ok(client), Ok(target)) => {
                let Some(client_stream) = client.io.into_inner().into_stream() else {
                    return;
                };
                let target_stream = target.io.into_inner().into_inner();
                // Bytes read past the handshake on either side go first.
                if tcp::write_all(&target_stream, &client.read_buf)
                    .await
                    .is_err()
                    || tcp::write_all(&client_stream, &target.read_buf)
                        .await
                        .is_err()
                {
                    return;
                }
                conn.bytes_from_peer
                    .fetch_add(client.read_buf.len() as u64, Ordering::Relaxed);
                conn.bytes_to_peer
                    .fetch_add(target.read_buf.len() as u64, Ordering::Relaxed);
                let watches = (&spread, &terminate);
                tcp::pipe(client_stream, target_stream, conn, watches, &proxy, framing).await;
            }
            _ => debug!("upgraded connections of unexpected types; closing the tunnel"),
        }
        drop(registration);
    };
    side.spawn(tunnel.in_current_span());
}

/// A response body, holding its request's [`InFlight`] until the body ends, and for HTTP/1 the
/// pooled connection it comes from, which goes back to the pool once the body has ended.
pub struct ProxyBody {
    payload: Payload,
    _in_flight: Option<InFlight>,
    lease: Option<Lease>,
    /// How the body ends if its connection's time in the close-spread window comes first.
    ending: Option<Ending<Arc<ConnCtx>>>,
    /// The body's failure, given at the next poll (see `poll_frame`).
    held_failure: Option<BodyError>,
}

impl ProxyBody {
    fn new(payload: Payload, lease: Option<Lease>, ending: Option<Ending<Arc<ConnCtx>>>) -> Self {
        ProxyBody {
            payload,
            _in_flight: None,
            lease,
            ending,
            held_failure: None,
        }
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        if let Some(failure) = this.held_failure.take() {
            return Poll::Ready(Some(Err(failure)));
        }
        let payload = &mut this.payload;
        let poll = match &mut this.ending {
            None => Pin::new(payload).poll_frame(cx),
            Some(ending) => match ending.poll(cx, |cx| Pin::new(payload).poll_frame(cx)) {
                Step::Pass(poll) => poll,
                Step::End(last) => {
                    // Dropped, the body towards the app cancels its stream there.
                    this.payload = Payload::Bytes(None);
                    return Poll::Ready(last);
                }
            },
        };
        if let Some(lease) = &mut this.lease
            && reached_end(&poll, &this.payload)
        {
            lease.done();
        }
        match poll {
            // A body that breaks (a malformed chunk line, garbage in its trailers): hyper's
            // HTTP/1 server closes at the failure, and what it holds unwritten is lost, the
            // head too when the body broke at once, and the client may be left without any
            // response or with less of the body than came. Given a poll later, the failure
            // finds all of it written (hyper writes out what it holds while a body waits): the
            // client gets the head and the body up to the break, then the cut, as from the
            // fast lane.
            Poll::Ready(Some(Err(failure))) => {
                this.held_failure = Some(failure);
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            poll => poll,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.payload.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.payload.size_hint()
    }
}

/// Counts a request as in flight from its head to the end of its response body.
pub struct InFlight {
    conn: Arc<Connection>,
    started: Instant,
    duration: prometheus_client::metrics::histogram::Histogram,
}

impl InFlight {
    pub(super) fn start(ctx: &ConnCtx) -> InFlight {
        let conn = ctx.conn().clone();
        conn.requests_in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight {
            duration: ctx.proxy.metrics.request_duration(conn.direction()),
            conn,
            started: Instant::now(),
        }
    }

    pub(super) fn record_status(&self, ctx: &ConnCtx, status: StatusCode) {
        self.record_code(ctx, status.as_u16());
    }

    pub(super) fn record_code(&self, ctx: &ConnCtx, code: u16) {
        ctx.proxy
            .metrics
            .request_finished(self.conn.direction(), code);
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let now = Instant::now();
        self.conn.request_done(now);
        self.conn.requests_in_flight.fetch_sub(1, Ordering::AcqRel);
        self.duration
            .observe(now.duration_since(self.started).as_secs_f64());
    }
}

/// A guard that tells an HTTP/1 connection when the request's body has been read to its end;
/// none for a request without a body, or on HTTP/2 (which never parks).
fn watch_request_body(ctx: &Arc<ConnCtx>, request: &Request<Incoming>) -> Option<RequestBodyGuard> {
    if ctx.version != HttpVersion::Http1 || request.body().is_end_stream() {
        return None;
    }
    ctx.body_opened();
    Some(RequestBodyGuard::new(ctx.clone()))
}
