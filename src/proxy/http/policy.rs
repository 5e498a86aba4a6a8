//! The rules of HTTP/1 forwarding, in one place for both engines: the fast lane
//! (`h1::lane`, byte by byte in `h1::wire`) and hyper's path (`service`, with `headers`). Each
//! engine reads the message its own way and asks this module what to do with it, so the
//! behaviour cannot drift apart (tests/engines.rs sends the same requests through both).
//!
//! - which headers concern one hop only ([`role`], [`names_a_header`]): never `Host` nor
//!   `Content-Length`;
//! - which responses are refused with a 502 ([`BadResponse`]): an unasked `101`, a length that
//!   is no number or two that differ, a transfer coding other than one `chunked`;
//! - how a response is framed for the client ([`keeps_length`], [`target_may_reuse`]) and
//!   which interim responses pass ([`Status`]);
//! - the proxy's own answers ([`Synthetic`]: every 400/408/501/502/504 it writes);
//! - the deadline of a response ([`response_deadline`]) and the replay rule ([`may_replay`]).
//!
//! What the lane takes at all is its own predicate (`h1::wire::plan_request`): only requests
//! for which both engines do the same.

use std::cell::RefCell;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hyper::StatusCode;
use tokio::time::Instant;

/// What a header is to the proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Role {
    Other,
    Host,
    Date,
    /// Hop-by-hop, and names further hop-by-hop headers.
    Connection,
    ContentLength,
    TransferEncoding,
    /// `Keep-Alive`, `Proxy-Connection`, `HTTP2-Settings`: hop-by-hop, dropped.
    HopByHop,
    /// Hop-by-hop; a request's `TE: trailers` is passed on (the target may then send trailers).
    Te,
    /// Hop-by-hop, kept for an upgrade's handshake.
    Upgrade,
    /// A request's `Expect: 100-continue` is answered by the proxy's hyper side.
    Expect,
}

/// The role of a header named `name` (any case). Most names have a length none of the
/// special ones has: no comparison for them.
#[inline]
pub(super) fn role(name: &str) -> Role {
    let is = |known: &str| name.eq_ignore_ascii_case(known);
    match name.len() {
        2 if is("te") => Role::Te,
        4 if is("host") => Role::Host,
        4 if is("date") => Role::Date,
        6 if is("expect") => Role::Expect,
        7 if is("upgrade") => Role::Upgrade,
        10 if is("connection") => Role::Connection,
        10 if is("keep-alive") => Role::HopByHop,
        14 if is("content-length") => Role::ContentLength,
        14 if is("http2-settings") => Role::HopByHop,
        16 if is("proxy-connection") => Role::HopByHop,
        16 if is(HANDOFF_HEADER) => Role::HopByHop,
        17 if is("transfer-encoding") => Role::TransferEncoding,
        _ => Role::Other,
    }
}

/// The headers of [`Role::HopByHop`], dropped wherever they are.
pub(super) const DROPPED: [&str; 4] = [
    "keep-alive",
    "proxy-connection",
    "http2-settings",
    HANDOFF_HEADER,
];

/// The mark of a request that a leaving pod handed off to its Service (`proxy/handoff.rs`): the
/// hand-off adds it, every other hop drops it (the app never sees it), and a leaving pod that
/// gets a marked request answers [`Synthetic::handed_off_already`] with it instead of handing
/// it off a second time. One hop at most: two leaving pods never pass a request to and fro.
pub(crate) const HANDOFF_HEADER: &str = "lameduck-handoff";

/// The value of [`HANDOFF_HEADER`] on the answer of a leaving pod that got a request handed off
/// already: it never reached an app, and the pod that handed it off draws another endpoint.
pub(crate) const HANDOFF_REFUSED: &str = "refused";

/// Whether a header of this role is removed on the way through (RFC 9110 section 7.6.1), the
/// ones a `Connection` names aside.
#[inline]
pub(super) fn is_hop_by_hop(role: Role) -> bool {
    matches!(
        role,
        Role::Connection | Role::HopByHop | Role::Te | Role::Upgrade | Role::TransferEncoding
    )
}

/// Whether a `Connection` token names a header that must go too: not the connection options
/// `close` and `keep-alive`, never `Host`, which would make the target see another host than
/// the client's (an app's Host-based "local only" check defeated), and never `Content-Length`,
/// which the message's framing needs (a response to HEAD lost its length through hyper's path;
/// HAProxy keeps it too). Any number of tokens.
#[inline]
pub(super) fn names_a_header(token: &[u8]) -> bool {
    !token.eq_ignore_ascii_case(b"close")
        && !token.eq_ignore_ascii_case(b"keep-alive")
        && !token.eq_ignore_ascii_case(b"host")
        && !token.eq_ignore_ascii_case(b"content-length")
}

/// The comma-separated tokens of a header value, trimmed, empty ones left out.
#[inline]
pub(super) fn tokens(value: &[u8]) -> impl DoubleEndedIterator<Item = &[u8]> {
    value
        .split(|&byte| byte == b',')
        .map(|token| token.trim_ascii())
        .filter(|token| !token.is_empty())
}

/// What a response's status code asks of the proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Status {
    Final,
    /// `102`, `103` and other interim responses: forwarded to an HTTP/1.1 client (RFC 9110
    /// section 15.2), hop-by-hop headers removed, before the final response.
    Interim,
    /// `100 Continue`: the proxy's hyper side answers a client's `Expect` itself, so the
    /// target's is dropped.
    Continue,
    /// `101`: an upgrade's answer, refused when the client did not ask for one.
    Switch,
}

#[inline]
pub(super) fn status(code: u16) -> Result<Status, BadResponse> {
    match code {
        100 => Ok(Status::Continue),
        101 => Ok(Status::Switch),
        102..=199 => Ok(Status::Interim),
        200..=999 => Ok(Status::Final),
        // No status code (RFC 9110 section 15: three digits, 1xx to 5xx).
        _ => Err(BadResponse::Unreadable),
    }
}

/// Why a target's response is not forwarded: the client gets a 502 instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BadResponse {
    /// Not an HTTP/1 response (hyper's parser and the lane's alike), or cut within its head.
    Unreadable,
    /// A `101` to a request that asked for no upgrade (RFC 9110 section 15.2.2).
    UnaskedSwitch,
    /// A `Content-Length` that is no number, or two that differ, even where there is no body
    /// (HAProxy's rule).
    Length,
    /// A transfer coding other than one `chunked`: the coded bytes would reach the client as
    /// the content (HAProxy's rule).
    TransferCoding,
    /// A head larger than [`MAX_RESPONSE_HEAD`].
    HeadTooLarge,
    /// A head of more than [`MAX_RESPONSE_FIELDS`] header fields.
    TooManyFields,
}

/// The largest response head either engine forwards (hyper's client's default buffer; HAProxy
/// refuses such heads too): 408 KiB, its status line, header lines and the empty line.
pub(super) const MAX_RESPONSE_HEAD: usize = 8192 + 4096 * 100;

/// The most header fields either engine reads in a response head (hyper's client's default).
pub(super) const MAX_RESPONSE_FIELDS: usize = 100;

/// The largest `Content-Length` either engine takes: 2^63 - 1, the largest size a file (a
/// signed 64-bit offset) has, and nginx's and Go's bound too. A larger one is no length.
const MAX_CONTENT_LENGTH: u64 = i64::MAX as u64;

impl BadResponse {
    pub(super) fn why(self) -> &'static str {
        match self {
            BadResponse::Unreadable => "failed to respond",
            BadResponse::UnaskedSwitch => "switched protocols unasked",
            BadResponse::Length => "sent an invalid Content-Length",
            BadResponse::TransferCoding => "sent a transfer coding other than chunked",
            BadResponse::HeadTooLarge => "sent a response head larger than 408 KiB",
            BadResponse::TooManyFields => "sent a response head of more than 100 header fields",
        }
    }
}

/// A response's `Transfer-Encoding` values, all of them: exactly one coding, `chunked`.
pub(super) fn response_codings<'a>(
    values: impl Iterator<Item = &'a [u8]>,
) -> Result<(), BadResponse> {
    let mut codings = values.flat_map(tokens);
    match (codings.next(), codings.next()) {
        (Some(coding), None) if coding.eq_ignore_ascii_case(b"chunked") => Ok(()),
        _ => Err(BadResponse::TransferCoding),
    }
}

/// A `Content-Length` value: digits, or a comma list of equal ones (RFC 9110 section 8.6), at
/// most [`MAX_CONTENT_LENGTH`].
#[inline]
pub(super) fn content_length(value: &[u8]) -> Option<u64> {
    let mut length = None;
    for part in value.split(|&byte| byte == b',') {
        let part = part.trim_ascii();
        if part.is_empty() || !part.iter().all(u8::is_ascii_digit) {
            return None;
        }
        let parsed: u64 = std::str::from_utf8(part).ok()?.parse().ok()?;
        if parsed > MAX_CONTENT_LENGTH || length.is_some_and(|length| length != parsed) {
            return None;
        }
        length = Some(parsed);
    }
    length
}

/// Whether a response has a body on the wire (RFC 9112 section 6.3).
#[inline]
pub(super) fn has_body(request_is_head: bool, code: u16) -> bool {
    !request_is_head && code != 204 && code != 304
}

/// Whether the client's response carries the target's `Content-Length` where there is no body:
/// a HEAD's tells of the body the client did not get; a 204 has none to tell of (RFC 9110
/// section 8.6), and a 304 goes without one (RFC 9110 lets it; hyper's server cannot write it).
#[inline]
pub(super) fn keeps_length(code: u16) -> bool {
    code != 204 && code != 304
}

/// Whether the target's connection may serve another request after this response: it ended
/// where its framing said, the target did not ask to close, and it spoke HTTP/1.1 (an HTTP/1.0
/// target's connection is not reused, even with `keep-alive`: hyper would speak HTTP/1.0 on it
/// from then on).
#[inline]
pub(super) fn target_may_reuse(http11: bool, target_close: bool, close_delimited: bool) -> bool {
    http11 && !target_close && !close_delimited
}

/// The deadline of a response head: `--http-response-timeout` counted from the request's
/// start, the connect to the target included.
pub(super) fn response_deadline(limit: Option<Duration>) -> Option<Instant> {
    limit.map(|limit| Instant::now() + limit)
}

/// Whether a request that got no response may be sent again, once, on another connection: only
/// the keep-alive race (a pooled connection that the target closed before answering), and only
/// for an idempotent request without a body (RFC 9110 section 9.2.2). A fresh connection that
/// closes is the target's answer: a 502, never a second try.
pub(super) fn may_replay(method: &[u8], has_body: bool, reused: bool) -> bool {
    let idempotent = matches!(
        method,
        b"GET" | b"HEAD" | b"OPTIONS" | b"TRACE" | b"PUT" | b"DELETE"
    );
    reused && idempotent && !has_body
}

/// Why a request got no response, as far as sending it again goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Unanswered {
    /// No connection: refused, reset or timed out in the connect. It never reached the app.
    NotConnected,
    /// Never sent, or refused unprocessed: HTTP/2 `REFUSED_STREAM`, a stream above a GOAWAY's
    /// last stream id, an HTTP/1 request that hyper handed back unwritten.
    NotSent,
    /// The target reset the connection before any byte of a response: its kernel held bytes
    /// of the request its app never read (a socket closed with unread data is reset, one whose
    /// data was read is closed with a FIN): a pod that exited, or a listener closed with the
    /// connection in its queue.
    Unread,
    /// The connection closed or failed before any byte of a response, after the request (or
    /// part of it) went out: the app may have seen it.
    MayHaveReached,
}

impl Unanswered {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Unanswered::NotConnected => "not_connected",
            Unanswered::NotSent => "not_sent",
            Unanswered::Unread => "unread",
            Unanswered::MayHaveReached => "may_have_reached",
        }
    }
}

/// How many times one request is sent again at most, beyond the keep-alive race: the retry
/// budget bounds retries overall, this one request's share of them. A refused connect costs the
/// callee nothing and fails at once, and behind a Service each new connect draws an endpoint
/// again: a rollout may leave half of them gone for seconds, and with 10 draws one request in
/// 2,000 that needs a new connection failed then (the rollout harness saw it); with 30, one in
/// two billion.
///
/// A hand-off (`handoff`) goes through the node's Service rules, which may still send it back
/// to this very pod (a loop, reset unread) or to another leaving one (refused, never sent on):
/// neither reached an app, and each try draws an endpoint again, so such a request goes again
/// as often as a refused connect.
fn max_retries(unanswered: Unanswered, handoff: bool) -> u32 {
    match unanswered {
        Unanswered::NotConnected => 30,
        Unanswered::NotSent | Unanswered::Unread if handoff => 30,
        Unanswered::NotSent | Unanswered::Unread | Unanswered::MayHaveReached => 3,
    }
}

/// How often one request has gone again, by why: each reason is held to its own bound
/// ([`max_retries`]). One count for all let the connects that a rollout refuses use up the tries
/// of a request whose connection was then cut: a GET refused three times, then reset by an app
/// closing its listener, failed with 502 where a fourth draw would have found a live pod (the
/// rollout harness saw it through a meshed caller).
#[derive(Debug, Default)]
pub(crate) struct Tries([u32; 4]);

impl Tries {
    fn slot(unanswered: Unanswered) -> usize {
        match unanswered {
            Unanswered::NotConnected => 0,
            Unanswered::NotSent => 1,
            Unanswered::Unread => 2,
            Unanswered::MayHaveReached => 3,
        }
    }

    /// Whether the request may go once more for `unanswered` (the budget has its own say).
    pub(crate) fn left(&self, unanswered: Unanswered, handoff: bool) -> bool {
        self.0[Tries::slot(unanswered)] < max_retries(unanswered, handoff)
    }

    /// It goes once more for `unanswered`.
    pub(crate) fn took(&mut self, unanswered: Unanswered) {
        self.0[Tries::slot(unanswered)] += 1;
    }
}

/// Whether an outbound request that got no answer may be sent again (when the retry budget
/// allows, and within its deadline): one that never reached the app whatever its method, its
/// body only if it can go again whole (`body_whole`: handed back unsent, or kept as far as it
/// went with the rest still to come); one that may have reached it only when it is
/// idempotent and has no body (RFC 9110 section 9.2.2). Inbound requests are never retried
/// beyond the keep-alive race ([`may_replay`]): the app behind them is this pod's own.
pub(crate) fn may_retry(
    unanswered: Unanswered,
    method: &[u8],
    has_body: bool,
    body_whole: bool,
) -> bool {
    match unanswered {
        Unanswered::NotConnected | Unanswered::NotSent | Unanswered::Unread => {
            !has_body || body_whole
        }
        Unanswered::MayHaveReached => may_replay(method, has_body, true),
    }
}

/// An interim (`1xx`) response head for the client: the status with its usual reason, the
/// headers that are not hop-by-hop (nor named by its `Connection`).
pub(super) fn write_interim<'a>(
    out: &mut Vec<u8>,
    code: u16,
    headers: impl Iterator<Item = (&'a str, &'a [u8])> + Clone,
) {
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(code.to_string().as_bytes());
    out.push(b' ');
    let reason = StatusCode::from_u16(code)
        .ok()
        .and_then(|status| status.canonical_reason());
    out.extend_from_slice(reason.unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    let named = |name: &str| {
        headers
            .clone()
            .filter(|(header, _)| role(header) == Role::Connection)
            .flat_map(|(_, value)| tokens(value))
            .any(|token| names_a_header(token) && token.eq_ignore_ascii_case(name.as_bytes()))
    };
    for (name, value) in headers.clone() {
        if is_hop_by_hop(role(name)) || named(name) {
            continue;
        }
        out.extend(name.bytes().map(|byte| byte.to_ascii_lowercase()));
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// `date: ...` for a response without one (RFC 9110 section 6.6.1: an origin with a clock
/// sends one; hyper adds it too), formatted at most once a second, as hyper does.
#[inline]
pub(super) fn push_date(out: &mut Vec<u8>) {
    thread_local! {
        static DATE: RefCell<(u64, String)> = const { RefCell::new((0, String::new())) };
    }
    let now = SystemTime::now();
    let second = now
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_secs();
    DATE.with(|date| {
        let mut date = date.borrow_mut();
        if date.0 != second || date.1.is_empty() {
            *date = (second, httpdate::fmt_http_date(now));
        }
        out.extend_from_slice(b"date: ");
        out.extend_from_slice(date.1.as_bytes());
        out.extend_from_slice(b"\r\n");
    });
}

/// A response the proxy writes itself: a status and a one-line `text/plain` body naming the
/// target or the fault (linkerd's `SyntheticHttpResponse`). Both engines write these, and
/// only these.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Synthetic {
    pub(crate) status: StatusCode,
    pub(crate) body: String,
    /// The client's connection cannot serve on after it (the rest of its request cannot be
    /// read as a next one).
    pub(crate) close: bool,
}

impl Synthetic {
    fn new(status: StatusCode, body: String) -> Synthetic {
        Synthetic {
            status,
            body,
            close: false,
        }
    }

    /// No connection to the target: refused (502), or not within the connect timeout (504).
    pub(crate) fn cannot_connect(target: &str, timed_out: bool) -> Synthetic {
        match timed_out {
            true => Synthetic::new(
                StatusCode::GATEWAY_TIMEOUT,
                format!("gateway timeout: cannot connect to {target}\n"),
            ),
            false => Synthetic::new(
                StatusCode::BAD_GATEWAY,
                format!("bad gateway: cannot connect to {target}\n"),
            ),
        }
    }

    /// A leaving pod's answer to a request another leaving pod handed off to it (503, marked
    /// with [`HANDOFF_HEADER`]: the pod that handed it off sends it elsewhere).
    pub(crate) fn handed_off_already() -> Synthetic {
        Synthetic::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service unavailable: this pod is going away and the request was handed off to it already\n".into(),
        )
    }

    /// No response head within the response timeout.
    pub(crate) fn no_response_in_time(target: &str) -> Synthetic {
        Synthetic::new(
            StatusCode::GATEWAY_TIMEOUT,
            format!("gateway timeout: {target} did not respond in time\n"),
        )
    }

    /// A response the proxy does not forward (see [`BadResponse`]), or none at all.
    pub(crate) fn bad_response(target: &str, bad: BadResponse) -> Synthetic {
        Synthetic::new(
            StatusCode::BAD_GATEWAY,
            format!("bad gateway: {target} {}\n", bad.why()),
        )
    }

    /// A request the proxy refuses.
    pub(crate) fn bad_request(why: &str) -> Synthetic {
        Synthetic::new(StatusCode::BAD_REQUEST, format!("bad request: {why}\n"))
    }

    /// A request body that stopped arriving before the response (408).
    pub(crate) fn request_body_stalled() -> Synthetic {
        Synthetic::new(
            StatusCode::REQUEST_TIMEOUT,
            "request timeout: the request body stopped arriving\n".into(),
        )
        .closing()
    }

    /// A request body that was malformed or cut short (400).
    pub(crate) fn request_body_broken() -> Synthetic {
        Synthetic::bad_request("the request body is malformed or incomplete").closing()
    }

    /// A transfer coding the proxy does not implement (501).
    pub(crate) fn unknown_coding(coding: &str) -> Synthetic {
        Synthetic::new(
            StatusCode::NOT_IMPLEMENTED,
            format!("not implemented: transfer coding {coding:?}\n"),
        )
    }

    /// The same answer, ending the client's connection.
    pub(crate) fn closing(mut self) -> Synthetic {
        self.close = true;
        self
    }

    /// The whole response as HTTP/1.1 bytes (the lane's; hyper writes the same head from
    /// [`Synthetic::status`] and the body). To a HEAD the head alone (RFC 9110 section 9.3.2:
    /// a body there would be read as the start of the next response), its `content-length`
    /// the body's, as hyper writes it.
    pub(super) fn write_http1(&self, out: &mut Vec<u8>, close: bool, is_head: bool) {
        out.clear();
        out.extend_from_slice(b"HTTP/1.1 ");
        out.extend_from_slice(self.status.as_str().as_bytes());
        out.push(b' ');
        out.extend_from_slice(self.status.canonical_reason().unwrap_or("").as_bytes());
        out.extend_from_slice(b"\r\ncontent-type: text/plain; charset=utf-8\r\n");
        if close || self.close {
            out.extend_from_slice(b"connection: close\r\n");
        }
        out.extend_from_slice(b"content-length: ");
        out.extend_from_slice(self.body.len().to_string().as_bytes());
        out.extend_from_slice(b"\r\n");
        push_date(out);
        out.extend_from_slice(b"\r\n");
        if !is_head {
            out.extend_from_slice(self.body.as_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dropped_names_are_the_hop_by_hop_role() {
        for name in DROPPED {
            assert_eq!(role(name), Role::HopByHop, "{name}");
            assert_eq!(role(&name.to_uppercase()), Role::HopByHop, "{name}");
        }
        for name in ["connection", "te", "upgrade", "transfer-encoding"] {
            assert!(is_hop_by_hop(role(name)), "{name}");
        }
        assert!(!is_hop_by_hop(role("content-length")));
        assert!(!is_hop_by_hop(role("host")));
    }

    #[test]
    fn connection_never_names_host_and_any_number_of_tokens_is_read() {
        assert!(!names_a_header(b"Host"));
        assert!(!names_a_header(b"Content-Length"));
        assert!(!names_a_header(b"close"));
        assert!(names_a_header(b"x-secret"));
        let value = b"a, b,, c ,d,e,f,g,h,i,j";
        assert_eq!(tokens(value).count(), 10);
    }

    #[test]
    fn only_one_chunked_coding_is_a_response_framing() {
        let check = |values: &[&[u8]]| response_codings(values.iter().copied());
        assert_eq!(check(&[b"chunked"]), Ok(()));
        assert_eq!(check(&[b"Chunked "]), Ok(()));
        for bad in [
            &[&b"gzip, chunked"[..]][..],
            &[b"chunked", b"identity"],
            &[b"gzip"],
            &[b"chunked, chunked"],
            &[b""],
        ] {
            assert_eq!(check(bad), Err(BadResponse::TransferCoding), "{bad:?}");
        }
    }

    #[test]
    fn statuses_and_lengths() {
        assert_eq!(status(99), Err(BadResponse::Unreadable));
        assert_eq!(status(0), Err(BadResponse::Unreadable));
        assert_eq!(status(103), Ok(Status::Interim));
        assert_eq!(status(100), Ok(Status::Continue));
        assert_eq!(status(101), Ok(Status::Switch));
        assert_eq!(status(200), Ok(Status::Final));
        assert_eq!(content_length(b"5, 5"), Some(5));
        assert_eq!(content_length(b"007"), Some(7));
        for bad in [
            &b"5, 6"[..],
            b"+5",
            b"-1",
            b"",
            b"nope",
            b"99999999999999999999",
        ] {
            assert_eq!(content_length(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn only_the_keep_alive_race_is_replayed() {
        assert!(may_replay(b"GET", false, true));
        assert!(may_replay(b"DELETE", false, true));
        assert!(!may_replay(b"GET", false, false), "a fresh connection");
        assert!(!may_replay(b"GET", true, true), "a body");
        assert!(!may_replay(b"POST", false, true), "not idempotent");
    }

    #[test]
    fn only_requests_that_never_reached_the_app_are_retried_whatever_their_method() {
        use Unanswered::*;
        assert!(
            may_retry(NotConnected, b"POST", true, true),
            "a body not sent"
        );
        assert!(may_retry(NotSent, b"POST", false, false));
        assert!(
            !may_retry(NotSent, b"POST", true, false),
            "a body partly sent"
        );
        assert!(may_retry(MayHaveReached, b"GET", false, true));
        assert!(
            !may_retry(MayHaveReached, b"POST", true, true),
            "a POST that may have reached the app"
        );
        assert!(!may_retry(MayHaveReached, b"PATCH", false, true));
        assert!(!may_retry(MayHaveReached, b"PUT", true, true), "a body");
    }

    #[test]
    fn interim_responses_lose_their_hop_by_hop_headers() {
        let mut out = Vec::new();
        let headers: [(&str, &[u8]); 4] = [
            ("Link", b"</a>; rel=preload"),
            ("Connection", b"x-hint"),
            ("X-Hint", b"1"),
            ("Keep-Alive", b"timeout=5"),
        ];
        write_interim(&mut out, 103, headers.into_iter());
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "HTTP/1.1 103 Early Hints\r\nlink: </a>; rel=preload\r\n\r\n"
        );
    }

    #[test]
    fn a_synthetic_response_reads_the_same_whichever_engine_writes_it() {
        let mut out = Vec::new();
        Synthetic::bad_response("x", BadResponse::Unreadable).write_http1(&mut out, true, false);
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with("HTTP/1.1 502 Bad Gateway\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\ncontent-length: 33\r\ndate: "), "{text}");
        assert!(
            text.ends_with("\r\n\r\nbad gateway: x failed to respond\n"),
            "{text}"
        );
    }
}
