//! Reads Kubernetes YAML the way kubectl does, and says where each document lies in the input.
//!
//! kubectl (and Helm, Argo CD: every client built on `sigs.k8s.io/yaml`) decodes YAML with
//! go-yaml v2's YAML 1.1 rules and converts the result to JSON before anything else looks at it.
//! A manifest means what that JSON says, so this module produces exactly it (as a
//! `serde_norway::Value`, so that the rest of inject works on one value type):
//!
//! - plain scalars resolve as go-yaml v2 resolves them: `yes`, `y`, `on` (any of their listed
//!   cases) are booleans; `0640` is octal (416), `0x1F`, `0o17`, `0b101`, `+12` and `1_000`
//!   are integers, `1e3` and `.5` floats; timestamps stay strings (go-yaml hands them to
//!   kubectl as their text); base-60 (`1:30`) is a string, as go-yaml reads it, unlike YAML
//!   1.1's own spec;
//! - quoted and block scalars are strings; `!!str`, `!!int`, `!!float`, `!!bool`, `!!null` and
//!   `!!binary` tags are honoured; any other tag is dropped and the text kept as a string;
//! - `<<` merge keys merge a mapping, or a sequence of them (earlier ones win), at the place
//!   they appear, so that a key written before `<<` is overridden by the merge and one written
//!   after it overrides the merge; duplicate keys: the last one wins;
//! - keys become strings as the JSON conversion writes them (`1` as `"1"`, `true` as
//!   `"true"`); a null or collection key is an error, as it is to kubectl;
//! - numbers are what JSON then carries: a float with no fraction is an integer, an integer
//!   beyond 64 bits a float, `.nan` and `.inf` an error;
//! - a file that does not end with a line break is read as if it did: go-yaml's scanner keeps
//!   the final line break of a block scalar (`|`) at the end of the input.
//!
//! The parser is yaml-rust2's (events with each scalar's style and tag, which a generic value
//! loses); the rules above are go-yaml v2's `resolve.go` and sigs.k8s.io/yaml's
//! `convertToJSONableObject`, checked against the real kubectl by tests/inject.rs.

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;

use base64::Engine as _;
use serde_norway::{Mapping, Value};
use yaml_rust2::parser::{Event, Parser, Tag};
use yaml_rust2::scanner::{Marker, ScanError, TScalarStyle};

/// Collections nested deeper than this are refused (a hostile file must not exhaust the stack).
const MAX_DEPTH: usize = 256;
/// The most nodes that aliases may copy into one stream (a "billion laughs" file is refused, as
/// go-yaml refuses excessive aliasing).
const MAX_ALIASED_NODES: usize = 1_000_000;
/// The tag prefix of YAML's own types (`!!str` is `tag:yaml.org,2002:str`).
const CORE_TAG: &str = "tag:yaml.org,2002:";

/// The input as read: its text (with a final line break added when it had none) and its
/// documents, empty ones (null to kubectl, which skips them) included.
pub struct Stream {
    pub text: String,
    pub documents: Vec<Document>,
}

/// One document: what kubectl reads in it, and its bytes in [`Stream::text`] (from the start
/// of the line that begins it, `---` included, to where the next one begins; comments before
/// a `---` go with the document above them).
pub struct Document {
    pub value: Value,
    pub source: Range<usize>,
}

/// Input that kubectl could not read either: invalid YAML, or YAML with no JSON meaning.
#[derive(Debug)]
pub struct ReadError {
    /// 1-based, counting empty documents too.
    pub document: usize,
    pub line: usize,
    pub column: usize,
    pub message: String,
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "document {}: line {}, column {}: {}",
            self.document, self.line, self.column, self.message
        )
    }
}

impl std::error::Error for ReadError {}

/// Reads every document of `input`.
pub fn stream(input: &str) -> Result<Stream, ReadError> {
    let mut text = input.to_string();
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    // A flow collection's closing bracket on a line of its own, indented no deeper than the
    // key it belongs to (Elastic's filebeat manifests write `args: [` ... `]` so): go-yaml reads
    // it, yaml-rust2's scanner calls it invalid indentation. Inside a flow collection a line
    // break is only white space, so such a bracket is read as the end of the line before it:
    // the line break becomes a space (same length: every offset stays), one bracket at a time,
    // only where the scanner stopped. What is written back is the text as it came.
    let mut parsed = text.clone();
    let mut first_error = None;
    let read = loop {
        match parse(&parsed) {
            Ok(read) => break read,
            // Each turn joins one line break (fewer every time): this ends.
            Err(error) => match closer_line_break(&parsed, &error) {
                Some(at) => {
                    first_error.get_or_insert(error);
                    parsed.replace_range(at..at + 1, " ");
                }
                None => return Err(first_error.unwrap_or(error)),
            },
        }
    };
    let starts = byte_offsets(&text, read.iter().map(|(start, _)| *start));

    let mut documents = Vec::new();
    let line_start = |at: usize| text[..at].rfind('\n').map_or(0, |newline| newline + 1);
    for (index, (_, value)) in read.into_iter().enumerate() {
        let start = if index == 0 {
            0
        } else {
            line_start(starts[index])
        };
        let end = starts
            .get(index + 1)
            .map_or(text.len(), |&next| line_start(next));
        documents.push(Document {
            value,
            source: start..end,
        });
    }
    Ok(Stream { text, documents })
}

/// Every document of `text`: where it starts (a character index) and its value.
fn parse(text: &str) -> Result<Vec<(usize, Value)>, ReadError> {
    let mut loader = Loader {
        parser: Parser::new_from_str(text),
        anchors: HashMap::new(),
        aliased: 0,
        document: 0,
    };
    let mut read = Vec::new();
    loop {
        let (event, mark) = loader.next()?;
        match event {
            Event::StreamStart => {}
            Event::StreamEnd => return Ok(read),
            Event::DocumentStart => {
                loader.document += 1;
                loader.anchors.clear();
                let (event, mark_node) = loader.next()?;
                let value = loader.node(event, mark_node, 0)?;
                match loader.next()? {
                    (Event::DocumentEnd, _) => {}
                    (other, at) => return Err(loader.error(at, format!("unexpected {other:?}"))),
                }
                read.push((mark.index(), value));
            }
            other => return Err(loader.error(mark, format!("unexpected {other:?}"))),
        }
    }
}

/// Where the scanner stopped at a flow collection's closing bracket for its indentation: the
/// byte offset of the line break before it, when the bracket begins its line and the line
/// before holds no comment (which the bracket would then be part of).
fn closer_line_break(text: &str, error: &ReadError) -> Option<usize> {
    if error.message != "invalid indentation" || error.line < 2 {
        return None;
    }
    let mut lines = text.split_inclusive('\n');
    let before = lines.by_ref().take(error.line - 1).collect::<Vec<_>>();
    let line = lines.next()?;
    let (indent, rest) = line.split_at(line.len() - line.trim_start_matches([' ', '\t']).len());
    let previous = before.last()?;
    let closes = rest.starts_with([']', '}']) && indent.chars().count() + 1 == error.column;
    if !closes || previous.contains('#') {
        return None;
    }
    let line_start: usize = before.iter().map(|line| line.len()).sum();
    Some(line_start - 1)
}

/// The byte offsets of ascending character indexes (the parser counts characters).
fn byte_offsets(text: &str, chars: impl Iterator<Item = usize>) -> Vec<usize> {
    let mut offsets = Vec::new();
    let mut walk = text.char_indices().enumerate().peekable();
    for wanted in chars {
        while walk.next_if(|(index, _)| *index < wanted).is_some() {}
        offsets.push(walk.peek().map_or(text.len(), |(_, (byte, _))| *byte));
    }
    offsets
}

struct Loader<'a> {
    parser: Parser<std::str::Chars<'a>>,
    /// The value of each anchor of the current document, by the parser's anchor id.
    anchors: HashMap<usize, Value>,
    /// Nodes copied by aliases so far.
    aliased: usize,
    document: usize,
}

impl Loader<'_> {
    fn next(&mut self) -> Result<(Event, Marker), ReadError> {
        self.parser.next_token().map_err(|error: ScanError| {
            let message = error.info().to_string();
            self.error(*error.marker(), message)
        })
    }

    fn error(&self, mark: Marker, message: impl Into<String>) -> ReadError {
        ReadError {
            document: self.document.max(1),
            line: mark.line(),
            column: mark.col() + 1,
            message: message.into(),
        }
    }

    /// The value of the node that `event` starts.
    fn node(&mut self, event: Event, mark: Marker, depth: usize) -> Result<Value, ReadError> {
        if depth > MAX_DEPTH {
            return Err(self.error(mark, format!("nested deeper than {MAX_DEPTH} levels")));
        }
        let (anchor, value) = match event {
            Event::Scalar(text, style, anchor, tag) => {
                let value = scalar(&text, style, tag.as_ref()).map_err(|m| self.error(mark, m))?;
                (anchor, value)
            }
            Event::Alias(id) => {
                let Some(value) = self.anchors.get(&id) else {
                    return Err(self.error(mark, "an alias to an unknown anchor"));
                };
                self.aliased += size(value);
                if self.aliased > MAX_ALIASED_NODES {
                    return Err(self.error(mark, "excessive aliasing"));
                }
                return Ok(value.clone());
            }
            Event::SequenceStart(anchor, _) => {
                let mut items = Vec::new();
                loop {
                    let (event, mark) = self.next()?;
                    if event == Event::SequenceEnd {
                        break;
                    }
                    items.push(self.node(event, mark, depth + 1)?);
                }
                (anchor, Value::Sequence(items))
            }
            Event::MappingStart(anchor, _) => (anchor, self.mapping(depth)?),
            other => return Err(self.error(mark, format!("unexpected {other:?}"))),
        };
        if anchor > 0 {
            self.anchors.insert(anchor, value.clone());
        }
        Ok(value)
    }

    /// A mapping's entries, up to its end, merges applied where they stand.
    fn mapping(&mut self, depth: usize) -> Result<Value, ReadError> {
        let mut map = Mapping::new();
        loop {
            let (event, key_mark) = self.next()?;
            if event == Event::MappingEnd {
                break;
            }
            let key = match &event {
                Event::Scalar(text, TScalarStyle::Plain, _, None) if text == "<<" => None,
                Event::Scalar(_, _, _, Some(tag))
                    if tag.handle == CORE_TAG && tag.suffix == "merge" =>
                {
                    None
                }
                Event::Scalar(text, style, anchor, tag) => {
                    let key = key_text(text, *style, tag.as_ref())
                        .map_err(|message| self.error(key_mark, message))?;
                    // An anchored key (rare) can be an alias's value elsewhere.
                    if *anchor > 0
                        && let Ok(value) = scalar(text, *style, tag.as_ref())
                    {
                        self.anchors.insert(*anchor, value);
                    }
                    Some(key)
                }
                _ => {
                    let value = self.node(event, key_mark, depth + 1)?;
                    Some(json_key(&value).map_err(|message| self.error(key_mark, message))?)
                }
            };
            let (event, mark) = self.next()?;
            let value = self.node(event, mark, depth + 1)?;
            match key {
                Some(key) => {
                    map.insert(Value::String(key), value);
                }
                None => merge(&mut map, value).map_err(|message| self.error(mark, message))?,
            }
        }
        Ok(Value::Mapping(map))
    }
}

/// Merges a `<<` value into `map`: a mapping's entries, or those of each mapping in a sequence,
/// earlier ones taking precedence over later ones (go-yaml v2 applies them last to first).
fn merge(map: &mut Mapping, value: Value) -> Result<(), String> {
    const WANT: &str = "map merge requires a mapping or a sequence of mappings as the value";
    match value {
        Value::Mapping(entries) => {
            for (key, value) in entries {
                map.insert(key, value);
            }
            Ok(())
        }
        Value::Sequence(items) => {
            if !items.iter().all(Value::is_mapping) {
                return Err(WANT.into());
            }
            for item in items.into_iter().rev() {
                merge(map, item)?;
            }
            Ok(())
        }
        _ => Err(WANT.into()),
    }
}

/// The number of nodes in `value`.
fn size(value: &Value) -> usize {
    match value {
        Value::Sequence(items) => 1 + items.iter().map(size).sum::<usize>(),
        Value::Mapping(map) => 1 + map.iter().map(|(k, v)| size(k) + size(v)).sum::<usize>(),
        _ => 1,
    }
}

/// A scalar as go-yaml v2 resolves it, then as the JSON conversion carries it.
fn scalar(text: &str, style: TScalarStyle, tag: Option<&Tag>) -> Result<Value, String> {
    json_value(resolved(text, style, tag)?, text)
}

/// What go-yaml v2 makes of a scalar.
#[derive(Debug, PartialEq)]
enum Resolved {
    Null,
    Bool(bool),
    Int(i64),
    /// Beyond `i64` (go-yaml's `uint64` and `big.Int`); JSON readers take it as a float.
    Wide(f64),
    Float(f64),
    Str(String),
}

fn resolved(text: &str, style: TScalarStyle, tag: Option<&Tag>) -> Result<Resolved, String> {
    let core = match tag {
        None if style != TScalarStyle::Plain => return Ok(Resolved::Str(text.into())),
        None => return Ok(resolve_plain(text)),
        Some(tag) if tag.handle == CORE_TAG => tag.suffix.as_str(),
        // A tag of the application's own (`!Thing`), or the non-specific `!`: go-yaml keeps the
        // text as a string and drops the tag.
        Some(_) => return Ok(Resolved::Str(text.into())),
    };
    let resolved = resolve_plain(text);
    let mismatch = || format!("cannot decode {text:?} as a !!{core}");
    Ok(match core {
        "str" | "timestamp" => Resolved::Str(text.into()),
        "binary" => {
            let compact: String = text.split_whitespace().collect();
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(compact)
                .map_err(|error| format!("invalid !!binary: {error}"))?;
            Resolved::Str(String::from_utf8_lossy(&bytes).into_owned())
        }
        "int" => match resolved {
            Resolved::Int(_) | Resolved::Wide(_) => resolved,
            _ => return Err(mismatch()),
        },
        "float" => match resolved {
            Resolved::Int(int) => Resolved::Float(int as f64),
            Resolved::Wide(float) | Resolved::Float(float) => Resolved::Float(float),
            _ => return Err(mismatch()),
        },
        "bool" => match resolved {
            Resolved::Bool(_) => resolved,
            _ => return Err(mismatch()),
        },
        "null" => match resolved {
            Resolved::Null => resolved,
            _ => return Err(mismatch()),
        },
        // !!map, !!seq, !!set and the like on a scalar: go-yaml keeps the text.
        _ => Resolved::Str(text.into()),
    })
}

/// go-yaml v2's `resolve` for a plain scalar without a tag.
fn resolve_plain(text: &str) -> Resolved {
    let Some(first) = text.bytes().next() else {
        return Resolved::Null;
    };
    let word = match text {
        "y" | "Y" | "yes" | "Yes" | "YES" | "true" | "True" | "TRUE" | "on" | "On" | "ON" => {
            Some(Resolved::Bool(true))
        }
        "n" | "N" | "no" | "No" | "NO" | "false" | "False" | "FALSE" | "off" | "Off" | "OFF" => {
            Some(Resolved::Bool(false))
        }
        "~" | "null" | "Null" | "NULL" => Some(Resolved::Null),
        ".nan" | ".NaN" | ".NAN" => Some(Resolved::Float(f64::NAN)),
        ".inf" | ".Inf" | ".INF" | "+.inf" | "+.Inf" | "+.INF" => {
            Some(Resolved::Float(f64::INFINITY))
        }
        "-.inf" | "-.Inf" | "-.INF" => Some(Resolved::Float(f64::NEG_INFINITY)),
        _ => None,
    };
    let string = || Resolved::Str(text.into());
    match first {
        b'y' | b'Y' | b'n' | b'N' | b't' | b'T' | b'f' | b'F' | b'o' | b'O' | b'~' => {
            word.unwrap_or_else(string)
        }
        b'.' => word
            .or_else(|| go_float(text).map(Resolved::Float))
            .unwrap_or_else(string),
        b'+' | b'-' | b'0'..=b'9' => word.or_else(|| number(text)).unwrap_or_else(string),
        _ => string(),
    }
}

/// An integer (Go's `ParseInt`/`ParseUint` with base 0, after dropping `_`), else a float of
/// go-yaml's float syntax, else a positive integer too wide for 64 bits.
fn number(text: &str) -> Option<Resolved> {
    let plain: String = text.chars().filter(|&c| c != '_').collect();
    let (negative, unsigned) = match plain.as_bytes().first() {
        Some(b'-') => (true, &plain[1..]),
        Some(b'+') => (false, &plain[1..]),
        _ => (false, plain.as_str()),
    };
    let (radix, digits) = match unsigned.as_bytes() {
        [b'0', b'x' | b'X', ..] => (16, &unsigned[2..]),
        [b'0', b'o' | b'O', ..] => (8, &unsigned[2..]),
        [b'0', b'b' | b'B', ..] => (2, &unsigned[2..]),
        [b'0', _, ..] => (8, &unsigned[1..]),
        _ => (10, unsigned),
    };
    let valid = !digits.is_empty() && digits.chars().all(|c| c.is_digit(radix));
    if valid {
        if let Ok(magnitude) = u128::from_str_radix(digits, radix) {
            let signed = if negative {
                -(magnitude as i128)
            } else {
                magnitude as i128
            };
            if let Ok(int) = i64::try_from(signed) {
                return Some(Resolved::Int(int));
            }
        }
    }
    if yaml_style_float(&plain) {
        if let Some(float) = go_float(&plain) {
            return Some(Resolved::Float(float));
        }
    }
    // Too wide for 64 bits: go-yaml keeps a `big.Int` (positive only: its ParseUint fails
    // on a sign with a syntax error, not a range error, and then it gives up).
    if valid && !plain.starts_with(['-', '+']) {
        let wide = digits
            .chars()
            .filter_map(|c| c.to_digit(radix))
            .fold(0f64, |acc, digit| acc * f64::from(radix) + f64::from(digit));
        return Some(Resolved::Wide(wide));
    }
    None
}

/// go-yaml's `yamlStyleFloat`: `^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$`.
fn yaml_style_float(text: &str) -> bool {
    let body = text.strip_prefix(['-', '+']).unwrap_or(text);
    let (mantissa, exponent) = match body.find(['e', 'E']) {
        Some(at) => (&body[..at], Some(&body[at + 1..])),
        None => (body, None),
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let mantissa_ok = match mantissa.split_once('.') {
        Some(("", fraction)) => digits(fraction),
        Some((whole, fraction)) => digits(whole) && fraction.bytes().all(|b| b.is_ascii_digit()),
        None => digits(mantissa),
    };
    let exponent_ok = exponent.is_none_or(|e| digits(e.strip_prefix(['-', '+']).unwrap_or(e)));
    mantissa_ok && exponent_ok
}

/// Go's `ParseFloat` for the decimal forms go-yaml hands it; out of range is no float (Go
/// returns an error, and go-yaml then keeps the string).
fn go_float(text: &str) -> Option<f64> {
    if !yaml_style_float(text) {
        return None;
    }
    text.parse::<f64>().ok().filter(|float| float.is_finite())
}

/// A resolved scalar as a JSON value, as kubectl then holds it: numbers the JSON encoder writes
/// without a fraction or exponent are integers to the JSON decoder; integers past `i64`
/// floats.
fn json_value(resolved: Resolved, text: &str) -> Result<Value, String> {
    Ok(match resolved {
        Resolved::Null => Value::Null,
        Resolved::Bool(flag) => Value::Bool(flag),
        Resolved::Int(int) => Value::Number(int.into()),
        Resolved::Str(string) => Value::String(string),
        Resolved::Wide(float) | Resolved::Float(float) => {
            if !float.is_finite() {
                return Err(format!(
                    "{text:?} is not a number JSON can hold, so kubectl cannot read this"
                ));
            }
            let integral = float.fract() == 0.0 && float.abs() < 1e21;
            match integral && float.abs() <= i64::MAX as f64 {
                true => Value::Number((float as i64).into()),
                false => Value::Number(float.into()),
            }
        }
    })
}

/// A scalar key as the JSON conversion writes it.
fn key_text(text: &str, style: TScalarStyle, tag: Option<&Tag>) -> Result<String, String> {
    match resolved(text, style, tag)? {
        Resolved::Str(string) => Ok(string),
        Resolved::Int(int) => Ok(int.to_string()),
        Resolved::Bool(flag) => Ok(flag.to_string()),
        Resolved::Float(float) => Ok(go_format_g32(float)),
        Resolved::Null => Err("a null mapping key, which JSON cannot hold".into()),
        Resolved::Wide(_) => Err(format!(
            "the mapping key {text} is too wide a number for kubectl"
        )),
    }
}

/// A key that came from an alias or a collection.
fn json_key(value: &Value) -> Result<String, String> {
    match value {
        Value::String(text) => Ok(text.clone()),
        Value::Bool(flag) => Ok(flag.to_string()),
        Value::Number(number) if number.is_f64() => {
            Ok(go_format_g32(number.as_f64().unwrap_or(0.0)))
        }
        Value::Number(number) => Ok(number.to_string()),
        Value::Null => Err("a null mapping key, which JSON cannot hold".into()),
        _ => Err("a mapping or sequence used as a mapping key, which JSON cannot hold".into()),
    }
}

/// Go's `strconv.FormatFloat(f, 'g', -1, 32)`, which the JSON conversion uses for float keys.
fn go_format_g32(float: f64) -> String {
    if float.is_nan() {
        return ".nan".into();
    }
    if float.is_infinite() {
        return if float > 0.0 { ".inf" } else { "-.inf" }.into();
    }
    let narrow = float as f32;
    // Shortest digits and exponent, as Rust writes them: `-1.2345e-7`.
    let scientific = format!("{narrow:e}");
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(rest) => ("-", rest),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    if !(-4..6).contains(&exponent) {
        let (head, tail) = digits.split_at(1);
        let dot = if tail.is_empty() { "" } else { "." };
        let exp_sign = if exponent < 0 { '-' } else { '+' };
        return format!("{sign}{head}{dot}{tail}e{exp_sign}{:02}", exponent.abs());
    }
    if exponent < 0 {
        let zeros = "0".repeat((-exponent - 1) as usize);
        return format!("{sign}0.{zeros}{digits}");
    }
    let whole = exponent as usize + 1;
    if digits.len() <= whole {
        format!("{sign}{digits}{}", "0".repeat(whole - digits.len()))
    } else {
        format!("{sign}{}.{}", &digits[..whole], &digits[whole..])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(yaml: &str) -> Value {
        let mut stream = stream(yaml).unwrap();
        assert_eq!(stream.documents.len(), 1, "{yaml}");
        stream.documents.remove(0).value
    }

    fn at(value: &Value, key: &str) -> Value {
        value
            .get(key)
            .cloned()
            .unwrap_or_else(|| panic!("{key} missing in {value:?}"))
    }

    #[test]
    fn plain_scalars_resolve_as_go_yaml_v2_resolves_them() {
        let value = one(
            "octal: 0640\nneg: -0640\nund: 1_000\nb60: 1:30\nyes: yes\nwhy: y\nno: No\non: on\n\
             ts: 2001-12-14\nhex: 0x1F\no: 0o17\nbin: 0b101\nfl: 1e3\nfl2: .5\nfl3: 1.\n\
             eight: 08\nplus: +12\nd: 2.5e-3\nnul: ~\nempty:\nhuge: 1e400\nwide: 18446744073709551616\n\
             q: '0640'\nstr: !!str 12\nint: !!int \"12\"\ncustom: !Thing 7\ndash: -x\nword: yesterday\n",
        );
        let expect = [
            ("octal", Value::from(416)),
            ("neg", Value::from(-416)),
            ("und", Value::from(1000)),
            ("b60", Value::from("1:30")),
            ("true", Value::Bool(true)),
            ("false", Value::Bool(false)),
            ("ts", Value::from("2001-12-14")),
            ("hex", Value::from(31)),
            ("o", Value::from(15)),
            ("bin", Value::from(5)),
            ("fl", Value::from(1000)),
            ("fl2", Value::from(0.5)),
            ("fl3", Value::from(1)),
            ("eight", Value::from(8)),
            ("plus", Value::from(12)),
            ("d", Value::from(0.0025)),
            ("nul", Value::Null),
            ("empty", Value::Null),
            ("huge", Value::from("1e400")),
            ("wide", Value::from(18446744073709551616f64)),
            ("q", Value::from("0640")),
            ("str", Value::from("12")),
            ("int", Value::from(12)),
            ("custom", Value::from("7")),
            ("dash", Value::from("-x")),
            ("word", Value::from("yesterday")),
        ];
        for (key, want) in expect {
            assert_eq!(at(&value, key), want, "{key}");
        }
        // `why: y` and `on: on` are keys `true` too; the last one wins.
        assert_eq!(at(&value, "true"), Value::Bool(true));
    }

    #[test]
    fn merge_keys_apply_where_they_stand_earlier_sources_first() {
        let value = one(
            "base: &base {a: 1, b: 2}\nother: &other {b: 20, c: 30}\nbefore: {a: 0, <<: *base}\n\
             after: {<<: *base, a: 9}\nlist: {<<: [*base, *other]}\nlist2: {<<: [*other, *base]}\n\
             seq:\n- <<: *base\n  name: x\nquoted: {\"<<\": *base}\ndup: {a: 1, a: 2}\n",
        );
        let map = |yaml: &str| one(yaml);
        assert_eq!(at(&value, "before"), map("{a: 1, b: 2}"));
        assert_eq!(at(&value, "after"), map("{a: 9, b: 2}"));
        assert_eq!(at(&value, "list"), map("{a: 1, b: 2, c: 30}"));
        assert_eq!(at(&value, "list2"), map("{b: 20, c: 30, a: 1}"));
        assert_eq!(at(&value, "seq"), map("[{a: 1, b: 2, name: x}]"));
        assert_eq!(at(&value, "quoted"), map("{'<<': {a: 1, b: 2}}"));
        assert_eq!(at(&value, "dup"), map("{a: 2}"));
        assert!(stream("a: {<<: [1]}\n").is_err());
    }

    #[test]
    fn keys_become_json_strings() {
        let value = one("1: a\n2.5: b\ntrue: c\n1e7: d\n0.1: e\n");
        for (key, want) in [
            ("1", "a"),
            ("2.5", "b"),
            ("true", "c"),
            ("1e+07", "d"),
            ("0.1", "e"),
        ] {
            assert_eq!(at(&value, key), Value::from(want), "{key}");
        }
        for bad in ["~: a\n", "[a]: b\n", "{a: 1}: b\n", "a: .nan\n"] {
            let error = stream(bad)
                .err()
                .unwrap_or_else(|| panic!("{bad:?} was read"));
            assert_eq!(error.line, 1, "{error}");
        }
    }

    #[test]
    fn a_block_scalar_at_the_end_keeps_its_line_break() {
        assert_eq!(
            at(&one("run.sh: |\n  echo hi"), "run.sh"),
            Value::from("echo hi\n")
        );
        assert_eq!(
            at(&one("run.sh: |-\n  echo hi"), "run.sh"),
            Value::from("echo hi")
        );
        assert_eq!(
            at(&one("run.sh: |+\n  echo hi\n\n"), "run.sh"),
            Value::from("echo hi\n\n")
        );
    }

    #[test]
    fn documents_know_their_bytes() {
        let input = "# head\na: 1\n...\n# mid\n---\nb: é\n---\n# nothing\n--- c\n";
        let stream = stream(input).unwrap();
        let sources: Vec<&str> = stream
            .documents
            .iter()
            .map(|document| &stream.text[document.source.clone()])
            .collect();
        assert_eq!(
            sources,
            [
                "# head\na: 1\n...\n# mid\n",
                "---\nb: é\n",
                "---\n# nothing\n",
                "--- c\n"
            ]
        );
        assert_eq!(stream.documents[2].value, Value::Null);
        assert_eq!(stream.documents[3].value, Value::from("c"));
    }

    #[test]
    fn hostile_input_is_refused_not_crashed_on() {
        let deep = "[".repeat(10_000);
        assert!(stream(&deep).is_err());
        let mut laughs = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
        for level in 1..9 {
            let prev = (b'a' + level - 1) as char;
            let name = (b'a' + level) as char;
            laughs.push_str(&format!("{name}: &{name} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]\n"));
        }
        let error = stream(&laughs).err().expect("a billion laughs was read");
        assert!(error.message.contains("aliasing"), "{error}");
        assert!(stream("a: *nowhere\n").is_err());
        assert!(stream("a: [\n").is_err());
    }

    #[test]
    fn go_float_keys_format_as_go_does() {
        for (float, want) in [
            (1000.0, "1000"),
            (123456.0, "123456"),
            (1e6, "1e+06"),
            (1234567.0, "1.234567e+06"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-2.5, "-2.5"),
            (0.0, "0"),
        ] {
            assert_eq!(go_format_g32(float), want, "{float}");
        }
    }
}
