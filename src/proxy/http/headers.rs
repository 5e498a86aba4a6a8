//! Headers and framing on hyper's path, by the rules of [`policy`]: what RFC 9110 and RFC 9112
//! refuse that hyper lets through (requests and responses), hop-by-hop headers, and the request
//! target each HTTP version is sent with.

use hyper::body::{Body, Incoming};
use hyper::header::{
    CONNECTION, CONTENT_LENGTH, HOST, HeaderMap, HeaderName, HeaderValue, TE, TRANSFER_ENCODING,
    UPGRADE,
};
use hyper::{Method, Request, Response, StatusCode, Uri};

use super::context::HttpVersion;
use super::policy::{self, BadResponse, Role, Synthetic};

/// WebSocket-style upgrades (`Connection: upgrade` with `Upgrade`) and CONNECT.
pub(super) fn wants_upgrade(request: &Request<Incoming>) -> bool {
    if request.method() == Method::CONNECT {
        return true;
    }
    request.headers().contains_key(UPGRADE)
        && request
            .headers()
            .get_all(CONNECTION)
            .iter()
            .any(|value| tokens(value).any(|token| token.eq_ignore_ascii_case(b"upgrade")))
}

/// An upgrade to WebSocket (RFC 6455 section 4.1): its tunnel is followed frame by frame.
pub(super) fn is_websocket(request: &Request<Incoming>) -> bool {
    request
        .headers()
        .get_all(UPGRADE)
        .iter()
        .any(|value| tokens(value).any(|token| token.eq_ignore_ascii_case(b"websocket")))
}

/// What the policy refuses in a target's response that hyper's client lets through: an unasked
/// `101`, a transfer coding other than one `chunked`, a bad `Content-Length`. A response framed
/// by its coding loses its `Content-Length` (RFC 9112 section 6.3: the coding wins, and a length
/// beside it would cut the body); a list of equal lengths becomes one.
pub(super) fn check_response(
    response: &mut Response<Incoming>,
    request_is_head: bool,
) -> Result<(), BadResponse> {
    if response.status() == StatusCode::SWITCHING_PROTOCOLS {
        // Forwarded, it would make the client take the connection for another protocol's.
        return Err(BadResponse::UnaskedSwitch);
    }
    // The head as it came (hyper's own bound on it is its read buffer's, looser): status line,
    // `name: value` lines, the empty line.
    let head: usize = response
        .headers()
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + 4)
        .sum::<usize>()
        + 16
        + response.status().canonical_reason().map_or(0, str::len)
        + 2;
    if head > policy::MAX_RESPONSE_HEAD {
        return Err(BadResponse::HeadTooLarge);
    }
    let has_body = policy::has_body(request_is_head, response.status().as_u16());
    let headers = response.headers_mut();
    if has_body && headers.contains_key(TRANSFER_ENCODING) {
        let values = headers.get_all(TRANSFER_ENCODING).iter();
        policy::response_codings(values.map(HeaderValue::as_bytes))?;
        headers.remove(CONTENT_LENGTH);
        return Ok(());
    }
    one_response_length(headers).map_err(|()| BadResponse::Length)
}

/// A response's `Content-Length` made one: every value (repeated headers, comma lists) the same
/// decimal number, written once; `Err` when one is not a number or they differ. Headers
/// without a length are left as they are.
fn one_response_length(headers: &mut HeaderMap) -> Result<(), ()> {
    let mut length: Option<u64> = None;
    let mut items = 0;
    for value in headers.get_all(CONTENT_LENGTH) {
        let item = policy::content_length(value.as_bytes()).ok_or(())?;
        if length.is_some_and(|length| length != item) {
            return Err(());
        }
        length = Some(item);
        items += 1 + value
            .as_bytes()
            .iter()
            .filter(|&&byte| byte == b',')
            .count();
    }
    // The usual single plain value (digits, no leading zero) is left as it is.
    let plain = headers.get(CONTENT_LENGTH).is_some_and(|value| {
        let bytes = value.as_bytes();
        bytes.iter().all(u8::is_ascii_digit) && (bytes.len() == 1 || bytes[0] != b'0')
    });
    if let Some(length) = length
        && (items > 1 || !plain)
    {
        headers.insert(CONTENT_LENGTH, HeaderValue::from(length));
    }
    Ok(())
}

/// Request framing that RFC 9112 and RFC 9110 refuse and hyper lets through: more than one
/// `Host` (400), a transfer coding other than `chunked` (501) or `chunked` twice (400), and a
/// CONNECT whose target is not `host:port` (400) or whose `Host` names another (400, as
/// HAProxy answers).
pub(super) fn check_framing(
    request: &Request<Incoming>,
    version: HttpVersion,
) -> Result<(), Synthetic> {
    let headers = request.headers();
    let bad = |why: &str| Err(Synthetic::bad_request(why));
    // Both checks are skipped by what the usual request looks like, at no cost: no header
    // repeated (values and names counted alike), no body.
    if version == HttpVersion::Http1 && headers.len() != headers.keys_len() {
        let mut hosts = headers.get_all(HOST).iter();
        if hosts.next().is_some() && hosts.next().is_some() {
            return bad("more than one Host");
        }
    }
    if version == HttpVersion::Http1 && !request.body().is_end_stream() {
        let mut chunked = 0;
        for value in headers.get_all(TRANSFER_ENCODING) {
            let Ok(codings) = value.to_str() else {
                return bad("Transfer-Encoding is not text");
            };
            for coding in codings.split(',').map(str::trim) {
                if coding.eq_ignore_ascii_case("chunked") {
                    chunked += 1;
                } else {
                    return Err(Synthetic::unknown_coding(coding));
                }
            }
        }
        if chunked > 1 {
            return bad("chunked applied more than once");
        }
        // hyper reads lengths up to 2^64 - 3; the policy's bound is lower (2^63 - 1).
        let mut lengths = headers.get_all(CONTENT_LENGTH).iter();
        if chunked == 0 && lengths.any(|value| policy::content_length(value.as_bytes()).is_none()) {
            return bad("invalid Content-Length");
        }
    }
    if request.method() == Method::CONNECT
        && !request
            .uri()
            .authority()
            .is_some_and(|authority| is_host_and_port(authority.as_str()))
    {
        return bad("CONNECT needs a host:port");
    }
    if request.method() == Method::CONNECT
        && let (Some(authority), Some(host)) = (request.uri().authority(), headers.get(HOST))
        && !host
            .as_bytes()
            .eq_ignore_ascii_case(authority.as_str().as_bytes())
    {
        return bad("Host differs from the CONNECT target");
    }
    Ok(())
}

/// `host:port` with a DNS name (letters, digits, `-` and `.`), an IPv4 address or a bracketed
/// IPv6 address, and a port from 1 to 65535; no user information.
pub(super) fn is_host_and_port(authority: &str) -> bool {
    let Some((host, port)) = authority.rsplit_once(':') else {
        return false;
    };
    let port_ok = port.parse::<u16>().is_ok_and(|port| port > 0);
    let host_ok = match host
        .strip_prefix('[')
        .and_then(|rest| rest.strip_suffix(']'))
    {
        Some(ipv6) => ipv6.parse::<std::net::Ipv6Addr>().is_ok(),
        None => {
            !host.is_empty()
                && host.split('.').all(|label| {
                    !label.is_empty()
                        && label
                            .bytes()
                            .all(|byte| byte.is_ascii_alphanumeric() || byte == b'-')
                })
        }
    };
    port_ok && host_ok
}

pub(super) fn is_connect_success(response: &Response<Incoming>) -> bool {
    response.status().is_success()
        && response
            .extensions()
            .get::<hyper::upgrade::OnUpgrade>()
            .is_some()
}

/// A header value's comma-separated tokens (the policy's reading).
pub(super) fn tokens(value: &HeaderValue) -> impl Iterator<Item = &[u8]> {
    policy::tokens(value.as_bytes())
}

/// Removes hop-by-hop headers: `Connection` and every header it names (never `Host`), and the
/// fixed list. When `upgrading`, `Upgrade` and `Connection: upgrade` stay so the target sees the
/// handshake; a request's `TE: trailers` stays (`request`), a response's `TE` goes.
pub(super) fn strip_hop_by_hop(headers: &mut HeaderMap, upgrading: bool, request: bool) {
    // Which hop-by-hop headers are there (the policy's roles, as bits): one pass over the
    // names, and most messages carry none.
    let bit = |role: Role| match role {
        Role::Connection => 1u8,
        Role::Te => 2,
        Role::Upgrade => 4,
        Role::TransferEncoding => 8,
        _ => 16,
    };
    let mut present = 0u8;
    for name in headers.keys() {
        let role = policy::role(name.as_str());
        if policy::is_hop_by_hop(role) {
            present |= bit(role);
        }
    }
    if present == 0 {
        return;
    }
    // The usual tokens (`keep-alive`, `close`) name no header: no allocation for them. (One
    // that names a hop-by-hop header is removed twice, which does no harm.)
    let named: Vec<HeaderName> = match present & bit(Role::Connection) != 0 {
        true => headers
            .get_all(CONNECTION)
            .iter()
            .flat_map(tokens)
            .filter(|token| policy::names_a_header(token))
            .filter_map(|token| HeaderName::from_bytes(token).ok())
            .collect(),
        false => Vec::new(),
    };
    let upgrade = (upgrading && present & bit(Role::Upgrade) != 0)
        .then(|| headers.get(UPGRADE).cloned())
        .flatten();
    let trailers = request
        && present & bit(Role::Te) != 0
        && headers
            .get_all(TE)
            .iter()
            .any(|value| tokens(value).any(|t| t.eq_ignore_ascii_case(b"trailers")));
    for name in named {
        headers.remove(name);
    }
    for (role, name) in [
        (Role::Connection, CONNECTION.as_str()),
        (Role::Te, TE.as_str()),
        (Role::Upgrade, UPGRADE.as_str()),
        (Role::TransferEncoding, TRANSFER_ENCODING.as_str()),
    ] {
        if present & bit(role) != 0 {
            headers.remove(name);
        }
    }
    if present & bit(Role::HopByHop) != 0 {
        for name in policy::DROPPED {
            headers.remove(name);
        }
    }
    if trailers {
        headers.insert(TE, HeaderValue::from_static("trailers"));
    }
    if let Some(upgrade) = upgrade {
        headers.insert(UPGRADE, upgrade);
        headers.insert(CONNECTION, HeaderValue::from_static("upgrade"));
    }
}

/// Gives an HTTP/1 request the origin-form URI it is sent with (CONNECT keeps its authority
/// form) and a `Host`: the client's, else the authority of an absolute-form URI, else the
/// target. A `Host` that is not a valid authority is refused (400).
pub(super) fn origin_form(request: &mut Request<Incoming>, target: &str) -> Result<(), ()> {
    if request.method() == Method::CONNECT {
        return Ok(());
    }
    let uri = request.uri();
    let absolute = uri.scheme().is_some() && uri.authority().is_some();
    match (
        uri.authority().filter(|_| absolute),
        request.headers().get(HOST),
    ) {
        // Absolute form: the target's authority is the host, whatever `Host` says (RFC 9112
        // section 3.2.2), without user information.
        (Some(authority), _) => {
            let host = match authority.port() {
                Some(port) => format!("{}:{port}", authority.host()),
                None => authority.host().to_string(),
            };
            let host = HeaderValue::from_str(&host).map_err(|_| ())?;
            request.headers_mut().insert(HOST, host);
        }
        (None, Some(host)) => {
            hyper::http::uri::Authority::try_from(host.as_bytes()).map_err(|_| ())?;
        }
        (None, None) => {
            let host = HeaderValue::from_str(target).map_err(|_| ())?;
            request.headers_mut().insert(HOST, host);
        }
    }
    if absolute {
        let path = request
            .uri()
            .path_and_query()
            .map_or("/", |path| path.as_str());
        *request.uri_mut() = Uri::try_from(path).map_err(|_| ())?;
    }
    Ok(())
}

/// Gives an HTTP/2 request the absolute URI hyper-util's pooled client needs: the client's
/// `:authority` (or `Host`) as authority, falling back to the target. CONNECT keeps its
/// authority form.
pub(super) fn absolute_uri(request: &mut Request<Incoming>, target: &str) -> Result<(), ()> {
    let uri = request.uri();
    if request.method() == Method::CONNECT || (uri.scheme().is_some() && uri.authority().is_some())
    {
        return Ok(());
    }
    let authority = match (uri.authority(), request.headers().get(HOST)) {
        (Some(authority), _) => authority.as_str().to_string(),
        (None, Some(host)) => host.to_str().map_err(|_| ())?.to_string(),
        (None, None) => target.to_string(),
    };
    let path = uri.path_and_query().map_or("/", |path| path.as_str());
    *request.uri_mut() = Uri::builder()
        .scheme("http")
        .authority(authority)
        .path_and_query(path)
        .build()
        .map_err(|_| ())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_response_length_is_one_number_or_an_error() {
        let lengths = |values: &[&str]| {
            let mut headers = HeaderMap::new();
            for value in values {
                headers.append(CONTENT_LENGTH, HeaderValue::from_str(value).unwrap());
            }
            one_response_length(&mut headers).map(|()| {
                let all: Vec<_> = headers.get_all(CONTENT_LENGTH).iter().cloned().collect();
                all.iter()
                    .map(|v| v.to_str().unwrap().to_string())
                    .collect::<Vec<_>>()
            })
        };
        assert_eq!(lengths(&["5"]), Ok(vec!["5".to_string()]));
        assert_eq!(lengths(&["5, 5"]), Ok(vec!["5".to_string()]));
        assert_eq!(lengths(&["5", "5"]), Ok(vec!["5".to_string()]));
        assert_eq!(lengths(&["007"]), Ok(vec!["7".to_string()]));
        assert_eq!(lengths(&[]), Ok(vec![]));
        for bad in [
            &["nope"][..],
            &["5", "6"],
            &["5, 6"],
            &["-1"],
            &["+5"],
            &[""],
        ] {
            assert_eq!(lengths(bad), Err(()), "{bad:?}");
        }
    }
}
