//! The fast lane's wire format: which request heads it takes (and the head the target gets),
//! how a target's response is framed (and the head the client gets), and chunked bodies
//! decoded, each as [`policy`] rules. No I/O here.

use crate::proxy::http::policy::{self, BadResponse, Role, Status, content_length, role, tokens};

/// Request headers the lane parses; a request with more goes to hyper (which takes 100).
const MAX_REQUEST_HEADERS: usize = 64;
/// A chunked response's trailer section is read and dropped (the client did not ask for
/// trailers with `TE`); this bounds it.
const MAX_TRAILERS: usize = 16 * 1024;
/// Chunk extensions are skipped; this bounds them, over a whole body (hyper's bound).
const MAX_CHUNK_EXTENSIONS: usize = 16 * 1024;
/// hyper's bound on the number of trailer fields.
const MAX_TRAILER_FIELDS: usize = 100;

/// A request the lane takes.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct RequestPlan {
    pub(super) head_len: usize,
    pub(super) method: &'static [u8],
    pub(super) is_head: bool,
    /// The client asked to close after this request.
    pub(super) close: bool,
}

#[derive(Debug, PartialEq, Eq)]
pub(super) enum Planned {
    Request(RequestPlan),
    /// Not a whole head yet.
    Partial,
    /// Hyper's to serve.
    Other,
}

/// Decides whether the head at the start of `buf` is the lane's; if it is, writes the head
/// the target gets into `head`.
pub(super) fn plan_request(buf: &[u8], close_target: bool, head: &mut Vec<u8>) -> Planned {
    let mut headers = [httparse::EMPTY_HEADER; MAX_REQUEST_HEADERS];
    let mut request = httparse::Request::new(&mut headers);
    let head_len = match request.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Planned::Partial,
        Err(_) => return Planned::Other,
    };
    let (Some(method), Some(path), Some(1)) = (request.method, request.path, request.version)
    else {
        return Planned::Other;
    };
    let (method, is_head): (&'static [u8], bool) = match method {
        "GET" => (b"GET", false),
        "DELETE" => (b"DELETE", false),
        "OPTIONS" => (b"OPTIONS", false),
        "HEAD" => (b"HEAD", true),
        _ => return Planned::Other,
    };
    if !is_origin_form(path) {
        return Planned::Other;
    }
    head.clear();
    head.extend_from_slice(method);
    head.push(b' ');
    head.extend_from_slice(path.as_bytes());
    head.extend_from_slice(b" HTTP/1.1\r\n");
    let mut hosts = 0;
    let mut close = false;
    for header in request.headers.iter() {
        match role(header.name) {
            Role::Host => {
                hosts += 1;
                if !is_plain_authority(header.value) {
                    return Planned::Other;
                }
            }
            // Only the connection options: a request whose `Connection` names headers is
            // hyper's (the policy is the same; the lane just does not carry it out).
            Role::Connection => {
                for token in tokens(header.value) {
                    if token.eq_ignore_ascii_case(b"close") {
                        close = true;
                    } else if !token.eq_ignore_ascii_case(b"keep-alive") {
                        return Planned::Other;
                    }
                }
                continue;
            }
            Role::HopByHop => continue,
            Role::ContentLength
            | Role::TransferEncoding
            | Role::Te
            | Role::Upgrade
            | Role::Expect => return Planned::Other,
            Role::Date | Role::Other => {}
        }
        push_header(head, header.name, header.value);
    }
    if hosts != 1 {
        return Planned::Other;
    }
    if close_target {
        head.extend_from_slice(b"connection: close\r\n");
    }
    head.extend_from_slice(b"\r\n");
    Planned::Request(RequestPlan {
        head_len,
        method,
        is_head,
        close,
    })
}

/// How a response's body is delimited on the target's side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Framing {
    None,
    Length(u64),
    Chunked,
    /// Until the target closes.
    Close,
}

#[derive(Debug, PartialEq, Eq)]
pub(super) struct ResponsePlan {
    pub(super) head_len: usize,
    pub(super) code: u16,
    pub(super) framing: Framing,
    /// The target keeps the connection open after it.
    pub(super) reusable: bool,
    /// The client's head says `connection: close`: its connection ends after this response
    /// (decided once, with the head, so that what it says and what happens agree).
    pub(super) close: bool,
    /// Server-sent events without a length: may end cleanly between two chunks when the
    /// close-spread window comes (the policy in `ending.rs`).
    pub(super) events: bool,
}

#[derive(Debug, PartialEq, Eq)]
pub(super) enum Parsed {
    Response(ResponsePlan),
    /// An interim (`1xx`) head of this length; what the client gets of it (nothing for a
    /// `100 Continue`) is in `out`.
    Interim(usize),
    Partial,
    /// Not a response the policy forwards (a 502).
    Bad(BadResponse),
}

/// Reads the response head at the start of `buf` as hyper's client would, and writes the head
/// the client gets into `out`.
pub(super) fn plan_response(
    buf: &[u8],
    request_is_head: bool,
    close: bool,
    out: &mut Vec<u8>,
) -> Parsed {
    let mut headers = [httparse::EMPTY_HEADER; policy::MAX_RESPONSE_FIELDS];
    let mut response = httparse::Response::new(&mut headers);
    let head_len = match response.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Parsed::Partial,
        Err(httparse::Error::TooManyHeaders) => return Parsed::Bad(BadResponse::TooManyFields),
        Err(_) => return Parsed::Bad(BadResponse::Unreadable),
    };
    let (Some(code), Some(version)) = (response.code, response.version) else {
        return Parsed::Bad(BadResponse::Unreadable);
    };
    match policy::status(code) {
        Err(bad) => return Parsed::Bad(bad),
        Ok(Status::Switch) => return Parsed::Bad(BadResponse::UnaskedSwitch),
        Ok(Status::Continue) => return Parsed::Interim(head_len),
        Ok(Status::Interim) => {
            let headers = response
                .headers
                .iter()
                .map(|header| (header.name, header.value));
            policy::write_interim(out, code, headers);
            return Parsed::Interim(head_len);
        }
        Ok(Status::Final) => {}
    }
    // What the framing and `Connection` headers say, in one pass.
    let mut codings = false;
    let mut length: Option<u64> = None;
    let mut bad_length = false;
    let mut target_close = false;
    // The headers `Connection` names: rarely any, so the list allocates only then.
    let mut named: Vec<&[u8]> = Vec::new();
    for header in response.headers.iter() {
        match role(header.name) {
            Role::TransferEncoding => codings = true,
            Role::ContentLength => match content_length(header.value) {
                Some(value) if length.is_none_or(|length| length == value) => {
                    length = Some(value);
                }
                _ => bad_length = true,
            },
            Role::Connection => {
                for token in tokens(header.value) {
                    if token.eq_ignore_ascii_case(b"close") {
                        target_close = true;
                    } else if token.eq_ignore_ascii_case(b"keep-alive") {
                        // The usual token, and no header's name: nothing to look up.
                    } else if policy::names_a_header(token) {
                        named.push(token);
                    }
                }
            }
            _ => {}
        }
    }
    let is_named = |name: &str| {
        named
            .iter()
            .any(|token| token.eq_ignore_ascii_case(name.as_bytes()))
    };
    let framing = if !policy::has_body(request_is_head, code) {
        // No body, but a length that is not one is as bad here as anywhere.
        if bad_length {
            return Parsed::Bad(BadResponse::Length);
        }
        Framing::None
    } else if codings {
        if version == 0 {
            return Parsed::Bad(BadResponse::Unreadable);
        }
        let values = response
            .headers
            .iter()
            .filter(|header| role(header.name) == Role::TransferEncoding)
            .map(|header| header.value);
        if let Err(bad) = policy::response_codings(values) {
            return Parsed::Bad(bad);
        }
        Framing::Chunked
    } else if bad_length {
        return Parsed::Bad(BadResponse::Length);
    } else if let Some(length) = length {
        Framing::Length(length)
    } else {
        Framing::Close
    };
    let reusable = policy::target_may_reuse(version == 1, target_close, framing == Framing::Close);

    out.extend_from_slice(b"HTTP/1.1 ");
    push_decimal(out, u64::from(code));
    out.push(b' ');
    out.extend_from_slice(response.reason.unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    let mut has_date = false;
    for header in response.headers.iter() {
        let role = role(header.name);
        match role {
            Role::ContentLength if framing == Framing::None && policy::keeps_length(code) => {}
            Role::ContentLength => continue,
            _ if policy::is_hop_by_hop(role) => continue,
            _ if !named.is_empty() && is_named(header.name) => continue,
            Role::Date => has_date = true,
            _ => {}
        }
        push_header(out, header.name, header.value);
    }
    match framing {
        Framing::Length(length) => {
            out.extend_from_slice(b"content-length: ");
            push_decimal(out, length);
            out.extend_from_slice(b"\r\n");
        }
        Framing::Chunked | Framing::Close => {
            out.extend_from_slice(b"transfer-encoding: chunked\r\n");
        }
        _ => {}
    }
    if close {
        out.extend_from_slice(b"connection: close\r\n");
    }
    // The target's, unless `Connection` named it; else the proxy's (hyper adds one too).
    if !has_date {
        policy::push_date(out);
    }
    out.extend_from_slice(b"\r\n");
    Parsed::Response(ResponsePlan {
        head_len,
        code,
        framing,
        reusable,
        close,
        // Looked for only in a body without a length: a sized response never ends early.
        events: matches!(framing, Framing::Chunked | Framing::Close)
            && response.headers.iter().any(|header| {
                header.name.eq_ignore_ascii_case("content-type")
                    && header.value.starts_with(b"text/event-stream")
            }),
    })
}

/// `name: value`, the name lowercase as hyper writes it.
fn push_header(out: &mut Vec<u8>, name: &str, value: &[u8]) {
    out.extend(name.bytes().map(|byte| byte.to_ascii_lowercase()));
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// A request target in origin form with only the bytes hyper's URI parser takes as they are;
/// anything else (a fragment, quotes, braces, bytes above ASCII) goes to hyper.
fn is_origin_form(path: &str) -> bool {
    let bytes = path.as_bytes();
    if bytes.first() != Some(&b'/') || bytes.len() >= usize::from(u16::MAX) - 1 {
        return false;
    }
    let mut query = false;
    bytes.iter().all(|&byte| {
        if byte == b'?' {
            query = true;
            return true;
        }
        // `<` and `>` are refused by hyper's URI parser even in a query: not the lane's.
        matches!(byte, 0x21 | 0x24..=0x3B | 0x3D | 0x40..=0x5F | 0x61..=0x7A | 0x7C | 0x7E)
            || (query && matches!(byte, 0x60 | 0x7B | 0x7D))
    })
}

/// A `Host` of a DNS name or IPv4 address, or a bracketed IPv6 address, with an optional port:
/// all of which hyper's authority parser takes. Anything else goes to hyper to judge.
fn is_plain_authority(value: &[u8]) -> bool {
    let (host_ok, port) = match value.strip_prefix(b"[") {
        Some(rest) => match rest.iter().position(|&byte| byte == b']') {
            Some(close) => (
                close > 0
                    && rest[..close]
                        .iter()
                        .all(|&byte| byte.is_ascii_hexdigit() || byte == b':' || byte == b'.'),
                &rest[close + 1..],
            ),
            None => return false,
        },
        None => {
            let end = value
                .iter()
                .position(|&byte| byte == b':')
                .unwrap_or(value.len());
            (
                end > 0
                    && value[..end]
                        .iter()
                        .all(|&byte| byte.is_ascii_alphanumeric() || byte == b'-' || byte == b'.'),
                &value[end..],
            )
        }
    };
    let port_ok = match port.strip_prefix(b":") {
        Some(digits) => (1..=5).contains(&digits.len()) && digits.iter().all(u8::is_ascii_digit),
        None => port.is_empty(),
    };
    host_ok && port_ok
}

fn push_decimal(out: &mut Vec<u8>, mut value: u64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (value % 10) as u8;
        value /= 10;
        if value == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[at..]);
}

/// One chunk of a chunked body.
pub(super) fn push_chunk(out: &mut Vec<u8>, data: &[u8]) {
    let mut digits = [0u8; 16];
    let mut at = digits.len();
    let mut value = data.len();
    loop {
        at -= 1;
        digits[at] = b"0123456789abcdef"[value % 16];
        value /= 16;
        if value == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[at..]);
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

/// Where a chunked body's decoding is (RFC 9112 section 7.1), across reads.
#[derive(Debug, Default)]
enum ChunkState {
    /// In a chunk-size line's digits (`size` so far).
    #[default]
    SizeStart,
    Size(u64),
    /// Whitespace after the digits.
    SizeSpace(u64),
    /// In the extensions.
    Extensions(u64),
    /// The size line's CR seen.
    SizeLf(u64),
    Data(u64),
    DataCr,
    DataLf,
    /// At the start of a trailer line, or of the final CRLF.
    EndCr,
    /// In a trailer line.
    Trailer,
    /// A trailer line's CR seen.
    TrailerLf,
    /// The final CR seen.
    EndLf,
    Done,
}

#[derive(Debug, Default)]
pub(super) struct ChunkDecoder {
    state: ChunkState,
    /// Bytes of chunk extensions in the body so far.
    extensions: usize,
    /// Trailer lines so far.
    trailer_fields: usize,
    /// The trailer section as it came, read as hyper reads it (its bytes and lines alike),
    /// then checked as field lines and dropped. Empty unless the body has trailers.
    trailers: Vec<u8>,
}

impl ChunkDecoder {
    /// Decodes what `input` holds, writing each piece of data as a chunk of its own into
    /// `out`. Returns the bytes used and whether the body ended (its trailers, dropped, too).
    pub(super) fn decode(
        &mut self,
        input: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(usize, bool), &'static str> {
        use ChunkState::*;
        let mut at = 0;
        while at < input.len() {
            if let Data(left) = self.state {
                let take = (input.len() - at).min(usize::try_from(left).unwrap_or(usize::MAX));
                push_chunk(out, &input[at..at + take]);
                at += take;
                let left = left - take as u64;
                self.state = if left == 0 { DataCr } else { Data(left) };
                continue;
            }
            let byte = input[at];
            at += 1;
            self.state = match (std::mem::take(&mut self.state), byte) {
                (SizeStart, byte) => match hex(byte) {
                    Some(digit) => Size(u64::from(digit)),
                    None => return Err("no chunk size"),
                },
                // Leading zeros are as many as the target likes; the value must fit (hyper's
                // rule).
                (Size(size), byte) => match hex(byte) {
                    Some(_) if size >> 60 != 0 => return Err("chunk size too large"),
                    Some(digit) => Size((size << 4) | u64::from(digit)),
                    None => match byte {
                        b' ' | b'\t' => SizeSpace(size),
                        b';' => Extensions(size),
                        b'\r' => SizeLf(size),
                        _ => return Err("bad chunk size"),
                    },
                },
                (SizeSpace(size), b' ' | b'\t') => SizeSpace(size),
                (SizeSpace(size), b';') => Extensions(size),
                (SizeSpace(size), b'\r') => SizeLf(size),
                (Extensions(size), b'\r') => SizeLf(size),
                (Extensions(_), b'\n') => return Err("bare LF in a chunk extension"),
                (Extensions(size), _) => {
                    self.extensions += 1;
                    if self.extensions >= MAX_CHUNK_EXTENSIONS {
                        return Err("chunk extensions too long");
                    }
                    Extensions(size)
                }
                (SizeLf(0), b'\n') => EndCr,
                (SizeLf(size), b'\n') => Data(size),
                (DataCr, b'\r') => DataLf,
                (DataLf, b'\n') => SizeStart,
                // The trailer section is kept as hyper keeps it: from its first byte (a
                // body without trailers keeps nothing), every byte up to the final LF.
                (EndCr, b'\r') => {
                    if !self.trailers.is_empty() {
                        self.keep_trailer_byte(byte)?;
                    }
                    EndLf
                }
                (EndCr | Trailer, byte) => {
                    self.keep_trailer_byte(byte)?;
                    if byte == b'\r' { TrailerLf } else { Trailer }
                }
                (TrailerLf, b'\n') => {
                    if self.trailer_fields >= MAX_TRAILER_FIELDS {
                        return Err("too many trailer fields");
                    }
                    self.trailer_fields += 1;
                    self.keep_trailer_byte(byte)?;
                    EndCr
                }
                (EndLf, b'\n') => {
                    if !self.trailers.is_empty() {
                        self.keep_trailer_byte(byte)?;
                        check_trailers(&self.trailers, self.trailer_fields)?;
                        self.trailers = Vec::new();
                    }
                    self.state = Done;
                    return Ok((at, true));
                }
                _ => return Err("bad chunk framing"),
            };
        }
        Ok((at, matches!(self.state, Done)))
    }

    /// Keeps a byte of the trailer section, within its bound (hyper's).
    fn keep_trailer_byte(&mut self, byte: u8) -> Result<(), &'static str> {
        self.trailers.push(byte);
        if self.trailers.len() >= MAX_TRAILERS {
            return Err("trailers too large");
        }
        Ok(())
    }
}

/// A trailer section (its lines, then the empty line) read as field lines, as hyper reads it:
/// dropped all the same, but a section that is none says the body's framing was wrong.
fn check_trailers(section: &[u8], lines: usize) -> Result<(), &'static str> {
    let mut fields = vec![httparse::EMPTY_HEADER; lines];
    match httparse::parse_headers(section, &mut fields) {
        Ok(httparse::Status::Complete((_, fields))) => {
            let valid = fields.iter().all(|field| {
                hyper::header::HeaderName::from_bytes(field.name.as_bytes()).is_ok()
                    && hyper::header::HeaderValue::from_bytes(field.value).is_ok()
            });
            if valid {
                Ok(())
            } else {
                Err("invalid trailer field")
            }
        }
        _ => Err("trailers that are no field lines"),
    }
}

fn hex(byte: u8) -> Option<u8> {
    match byte {
        b'0'..=b'9' => Some(byte - b'0'),
        b'a'..=b'f' => Some(byte - b'a' + 10),
        b'A'..=b'F' => Some(byte - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(raw: &str, closing: bool) -> (Planned, String) {
        let mut head = Vec::new();
        let planned = plan_request(raw.as_bytes(), closing, &mut head);
        (planned, String::from_utf8(head).unwrap())
    }

    #[test]
    fn the_lane_takes_a_plain_request_and_rewrites_its_head_as_hyper_would() {
        let raw = "GET /a?b=c HTTP/1.1\r\nHost: app.test:8080\r\nUser-Agent: x\r\n\
                   Connection: keep-alive\r\nKeep-Alive: timeout=5\r\nProxy-Connection: x\r\n\r\nNEXT";
        let (planned, head) = request(raw, false);
        assert_eq!(
            planned,
            Planned::Request(RequestPlan {
                head_len: raw.len() - 4,
                method: b"GET",
                is_head: false,
                close: false
            })
        );
        assert_eq!(
            head,
            "GET /a?b=c HTTP/1.1\r\nhost: app.test:8080\r\nuser-agent: x\r\n\r\n"
        );
        let (planned, head) = request(
            "HEAD / HTTP/1.1\r\nhost: [::1]\r\nconnection: Close\r\n\r\n",
            true,
        );
        assert!(matches!(
            planned,
            Planned::Request(RequestPlan {
                is_head: true,
                close: true,
                ..
            })
        ));
        assert_eq!(
            head,
            "HEAD / HTTP/1.1\r\nhost: [::1]\r\nconnection: close\r\n\r\n"
        );
    }

    #[test]
    fn anything_else_goes_to_hyper() {
        let others = [
            "POST / HTTP/1.1\r\nHost: a\r\n\r\n",
            "CONNECT a:443 HTTP/1.1\r\nHost: a:443\r\n\r\n",
            "GET / HTTP/1.0\r\nHost: a\r\n\r\n",
            "GET http://a/ HTTP/1.1\r\nHost: a\r\n\r\n",
            "GET * HTTP/1.1\r\nHost: a\r\n\r\n",
            "GET / HTTP/1.1\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: user@a\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a:\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a:123456\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a b\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nTE: trailers\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nConnection: x-secret\r\n\r\n",
            "GET /a#b HTTP/1.1\r\nHost: a\r\n\r\n",
            "GET /{x} HTTP/1.1\r\nHost: a\r\n\r\n",
            "GET /\"x HTTP/1.1\r\nHost: a\r\n\r\n",
            "GET /\u{e9} HTTP/1.1\r\nHost: a\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nX: a\0b\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n",
            "GE T / HTTP/1.1\r\nHost: a\r\n\r\n",
        ];
        for raw in others {
            assert_eq!(request(raw, false).0, Planned::Other, "{raw:?}");
        }
        let many: String = (0..MAX_REQUEST_HEADERS)
            .map(|i| format!("X-{i}: y\r\n"))
            .collect();
        let raw = format!("GET / HTTP/1.1\r\nHost: a\r\n{many}\r\n");
        assert_eq!(request(&raw, false).0, Planned::Other, "too many headers");
        // A query may carry what a path may not, but not `<` or `>` (hyper refuses them).
        assert!(matches!(
            request("GET /?q={x}`y` HTTP/1.1\r\nHost: a\r\n\r\n", false).0,
            Planned::Request(_)
        ));
        assert_eq!(
            request("GET /?q=<y> HTTP/1.1\r\nHost: a\r\n\r\n", false).0,
            Planned::Other
        );
        assert_eq!(
            request("GET / HTTP/1.1\r\nHost: a\r\n", false).0,
            Planned::Partial
        );
        assert_eq!(request("", false).0, Planned::Partial);
    }

    fn response(raw: &str, head: bool, close: bool) -> (Parsed, String) {
        let mut out = Vec::new();
        let parsed = plan_response(raw.as_bytes(), head, close, &mut out);
        (parsed, String::from_utf8(out).unwrap())
    }

    fn framing(raw: &str, head: bool) -> Option<(Framing, bool)> {
        match response(raw, head, false).0 {
            Parsed::Response(plan) => Some((plan.framing, plan.reusable)),
            _ => None,
        }
    }

    #[test]
    fn responses_are_framed_as_hyper_reads_them() {
        let date = "Date: Thu, 01 Jan 2026 00:00:00 GMT\r\n";
        let (parsed, head) = response(
            &format!(
                "HTTP/1.1 200 Fine\r\nServer: s\r\n{date}Content-Length: 2\r\nKeep-Alive: timeout=5\r\n\r\nok"
            ),
            false,
            false,
        );
        assert!(matches!(
            parsed,
            Parsed::Response(ResponsePlan {
                code: 200,
                framing: Framing::Length(2),
                reusable: true,
                ..
            })
        ));
        assert_eq!(
            head,
            format!(
                "HTTP/1.1 200 Fine\r\nserver: s\r\n{}content-length: 2\r\n\r\n",
                date.to_lowercase().replacen(
                    "thu, 01 jan 2026 00:00:00 gmt",
                    "Thu, 01 Jan 2026 00:00:00 GMT",
                    1
                )
            )
        );
        type Case = (&'static str, bool, Option<(Framing, bool)>);
        let cases: [Case; 15] = [
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 5, 5\r\n\r\n",
                false,
                Some((Framing::Length(5), true)),
            ),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\n",
                false,
                None,
            ),
            ("HTTP/1.1 200 OK\r\ncontent-length: +5\r\n\r\n", false, None),
            (
                "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 5\r\n\r\n",
                false,
                Some((Framing::Chunked, true)),
            ),
            // Coded content is a 502 (HAProxy's rule).
            (
                "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
                false,
                None,
            ),
            (
                "HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
                false,
                None,
            ),
            (
                "HTTP/1.1 200 OK\r\n\r\n",
                false,
                Some((Framing::Close, false)),
            ),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\n",
                false,
                Some((Framing::Length(5), false)),
            ),
            (
                "HTTP/1.0 200 OK\r\ncontent-length: 5\r\n\r\n",
                false,
                Some((Framing::Length(5), false)),
            ),
            // An HTTP/1.0 target's connection is not reused, even with `keep-alive`.
            (
                "HTTP/1.0 200 OK\r\ncontent-length: 5\r\nconnection: keep-alive\r\n\r\n",
                false,
                Some((Framing::Length(5), false)),
            ),
            // A length that is no number is a 502, a HEAD's too (HAProxy's rule, and hyper's
            // path's).
            (
                "HTTP/1.1 200 OK\r\ncontent-length: nope\r\n\r\n",
                true,
                None,
            ),
            (
                "HTTP/1.1 099 Early\r\ncontent-length: 0\r\n\r\n",
                false,
                None,
            ),
            (
                "HTTP/1.1 204 No Content\r\n\r\n",
                false,
                Some((Framing::None, true)),
            ),
            (
                "HTTP/1.1 304 Not Modified\r\ncontent-length: 9\r\n\r\n",
                false,
                Some((Framing::None, true)),
            ),
            (
                "HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\n\r\n",
                false,
                None,
            ),
        ];
        for (raw, head, expected) in cases {
            assert_eq!(framing(raw, head), expected, "{raw:?}");
        }
        assert_eq!(
            response(
                "HTTP/1.1 103 Early Hints\r\nlink: x\r\n\r\nHTTP/1.1 200",
                false,
                false
            )
            .0,
            Parsed::Interim(37)
        );
        assert_eq!(
            response("HTTP/1.1 200 OK\r\n", false, false).0,
            Parsed::Partial
        );
        assert_eq!(
            response("HTTP/1.1 200 OK\r\nbad header\r\n\r\n", false, false).0,
            Parsed::Bad(BadResponse::Unreadable)
        );
    }

    #[test]
    fn the_clients_response_head_loses_hop_by_hop_headers_and_gets_its_own_framing() {
        let (_, head) = response(
            "HTTP/1.1 200 OK\r\nConnection: x-hop, keep-alive\r\nX-Hop: 1\r\nX-Kept: 2\r\nUpgrade: y\r\nTE: z\r\n\
             Transfer-Encoding: chunked\r\nContent-Length: 9\r\nHTTP2-Settings: q\r\n\r\n",
            false,
            true,
        );
        assert!(head.starts_with("HTTP/1.1 200 OK\r\nx-kept: 2\r\ntransfer-encoding: chunked\r\nconnection: close\r\ndate: "), "{head}");
        assert!(head.ends_with(" GMT\r\n\r\n"), "{head}");
        // A HEAD response keeps the length the target announced.
        let (_, head) = response(
            "HTTP/1.1 200 OK\r\nDate: d\r\nContent-Length: 42\r\n\r\n",
            true,
            false,
        );
        assert_eq!(
            head,
            "HTTP/1.1 200 OK\r\ndate: d\r\ncontent-length: 42\r\n\r\n"
        );
    }

    fn dechunk(input: &[u8], step: usize) -> Result<(Vec<u8>, usize), &'static str> {
        let mut decoder = ChunkDecoder::default();
        let mut out = Vec::new();
        let mut at = 0;
        while at < input.len() {
            let end = (at + step).min(input.len());
            let (used, done) = decoder.decode(&input[at..end], &mut out)?;
            if done {
                return Ok((out, at + used));
            }
            assert_eq!(used, end - at, "an unfinished body leaves no byte unused");
            at = end;
        }
        Err("unfinished")
    }

    /// The chunks the client gets, read back.
    fn data_of(chunks: &[u8]) -> Vec<u8> {
        let mut data = Vec::new();
        let mut rest = chunks;
        while !rest.is_empty() {
            let line_end = rest.windows(2).position(|w| w == b"\r\n").unwrap();
            let size =
                usize::from_str_radix(std::str::from_utf8(&rest[..line_end]).unwrap(), 16).unwrap();
            data.extend_from_slice(&rest[line_end + 2..line_end + 2 + size]);
            rest = &rest[line_end + 4 + size..];
        }
        data
    }

    #[test]
    fn chunked_bodies_decode_alike_however_they_are_split() {
        let body = b"5;ext=1\r\nhello\r\n6 \r\n world\r\n0\r\nX-Trailer: t\r\n\r\nAFTER";
        for step in 1..body.len() {
            let (chunks, used) = dechunk(body, step).unwrap();
            assert_eq!(used, body.len() - 5, "step {step}");
            assert_eq!(data_of(&chunks), b"hello world", "step {step}");
        }
        // Trailer sections as hyper reads them: a field line ending in a bare LF before a
        // CRLF it takes (its field parser does), more fields than CRLF lines it refuses, and
        // lines that are no fields.
        assert!(dechunk(b"0\r\nX: y\n\r\n\r\n", 3).is_ok());
        let bad: [&[u8]; 11] = [
            b"0\r\nX: y\nZ: w\r\n\r\n",
            b"5\nhello\r\n0\r\n\r\n",
            b"x\r\n",
            b"5\r\nhelloX\r\n",
            b"fffffffffffffffff\r\n",
            b"5;a\nb\r\nhello\r\n",
            b"0\r\nX: y\n\r\n",
            b"\r\n",
            b"0\r\nnot a field\r\n\r\n",
            b"0\r\nx y: t\r\n\r\n",
            b"0\r\nx: a\x7fb\r\n\r\n",
        ];
        for input in bad {
            assert!(
                dechunk(input, input.len()).is_err(),
                "{:?}",
                String::from_utf8_lossy(input)
            );
        }
        let long_extension = format!("1;{}\r\n", "e".repeat(MAX_CHUNK_EXTENSIONS + 1));
        assert!(dechunk(long_extension.as_bytes(), 64).is_err());
    }
}
