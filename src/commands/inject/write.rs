//! Writes YAML that means the same to a YAML 1.1 reader (kubectl, Helm, Argo CD: every Go tool
//! of the Kubernetes ecosystem reads with go-yaml's 1.1 rules) and to a YAML 1.2 reader (our
//! own, serde_norway).
//!
//! serde_norway's writer quotes a string only when its own 1.2 reader would take it for
//! something else, so `"yes"` came out as a plain `yes`, which kubectl reads as `true` and then
//! refuses for an annotation or an env value. Here a string is written plain only when no
//! reader of either version can take it for anything but that string; everything else is
//! quoted. The layout is the one serde_norway (libyaml) writes, so that injected manifests diff
//! cleanly against earlier output: two spaces a level, a sequence under a key at the key's own
//! indentation, empty collections as `{}` and `[]`, multi-line strings as literal blocks.

use std::fmt::Write as _;

use serde_norway::Value;

/// A document that cannot be written as block YAML (a mapping or sequence used as a key).
#[derive(Debug)]
pub struct Unwritable(pub String);

/// One document, without the `---` separator, ending in a newline.
pub fn to_string(document: &Value) -> Result<String, Unwritable> {
    let mut out = String::new();
    match document {
        Value::Mapping(map) if !map.is_empty() => mapping(&mut out, map, 0, false)?,
        Value::Sequence(items) if !items.is_empty() => sequence(&mut out, items, 0, false)?,
        Value::Tagged(tagged) => {
            out.push_str(&tagged.tag.to_string());
            after_key(&mut out, &tagged.value, 0)?;
        }
        scalar => {
            value_inline(&mut out, scalar, 2);
            out.push('\n');
        }
    }
    Ok(out)
}

/// Writes a mapping's entries at `indent`; the first one on the current line when `inline`
/// (after a sequence's `- `).
fn mapping(
    out: &mut String,
    map: &serde_norway::Mapping,
    indent: usize,
    inline: bool,
) -> Result<(), Unwritable> {
    for (index, (key, value)) in map.iter().enumerate() {
        if index > 0 || !inline {
            pad(out, indent);
        }
        write_key(out, key)?;
        out.push(':');
        after_key(out, value, indent)?;
    }
    Ok(())
}

/// Writes a sequence's items at `indent`; the first one on the current line when `inline`.
fn sequence(
    out: &mut String,
    items: &[Value],
    indent: usize,
    inline: bool,
) -> Result<(), Unwritable> {
    for (index, item) in items.iter().enumerate() {
        if index > 0 || !inline {
            pad(out, indent);
        }
        out.push('-');
        match item {
            Value::Mapping(map) if !map.is_empty() => {
                out.push(' ');
                mapping(out, map, indent + 2, true)?;
            }
            Value::Sequence(inner) if !inner.is_empty() => {
                out.push(' ');
                sequence(out, inner, indent + 2, true)?;
            }
            Value::Tagged(tagged) => {
                out.push(' ');
                out.push_str(&tagged.tag.to_string());
                after_key(out, &tagged.value, indent + 2)?;
            }
            scalar => {
                out.push(' ');
                value_inline(out, scalar, indent + 2);
                out.push('\n');
            }
        }
    }
    Ok(())
}

/// Writes what follows `key:` (or a tag) at nesting level `indent`, newline included.
fn after_key(out: &mut String, value: &Value, indent: usize) -> Result<(), Unwritable> {
    match value {
        Value::Mapping(map) if !map.is_empty() => {
            out.push('\n');
            mapping(out, map, indent + 2, false)
        }
        Value::Sequence(items) if !items.is_empty() => {
            out.push('\n');
            sequence(out, items, indent, false)
        }
        Value::Tagged(tagged) => {
            out.push(' ');
            out.push_str(&tagged.tag.to_string());
            after_key(out, &tagged.value, indent)
        }
        scalar => {
            out.push(' ');
            value_inline(out, scalar, indent + 2);
            out.push('\n');
            Ok(())
        }
    }
}

/// A scalar or an empty collection, on the current line; a literal block's lines at `indent`.
fn value_inline(out: &mut String, value: &Value, indent: usize) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(flag) => out.push_str(if *flag { "true" } else { "false" }),
        Value::Number(number) => {
            let _ = write!(out, "{number}");
        }
        Value::String(text) => string(out, text, Some(indent)),
        Value::Sequence(_) => out.push_str("[]"),
        Value::Mapping(_) => out.push_str("{}"),
        Value::Tagged(tagged) => {
            let _ = write!(out, "{} ", tagged.tag);
            value_inline(out, &tagged.value, indent);
        }
    }
}

fn write_key(out: &mut String, key: &Value) -> Result<(), Unwritable> {
    match key {
        Value::String(text) => string(out, text, None),
        Value::Sequence(_) | Value::Mapping(_) | Value::Tagged(_) => {
            return Err(Unwritable(format!(
                "a mapping key that is not a scalar ({key:?}) cannot be written"
            )));
        }
        scalar => value_inline(out, scalar, 0),
    }
    Ok(())
}

/// Writes a string plain, single-quoted, double-quoted or (when `block` gives the indentation
/// of its lines) as a literal block, whichever is the first that reads back as this string.
fn string(out: &mut String, text: &str, block: Option<usize>) {
    if is_plain_safe(text) {
        out.push_str(text);
    } else if let Some(indent) = block.filter(|_| is_literal_safe(text)) {
        literal(out, text, indent);
    } else if text.chars().all(|c| is_printable(c) && !is_break_or_tab(c)) {
        out.push('\'');
        out.push_str(&text.replace('\'', "''"));
        out.push('\'');
    } else {
        double_quoted(out, text);
    }
}

/// True when `text` written plain is read back as this same string by YAML 1.1 and YAML 1.2
/// readers: nothing that either resolves to a null, boolean, number, timestamp or merge key,
/// and nothing that the plain style cannot hold.
pub fn is_plain_safe(text: &str) -> bool {
    let Some(first) = text.chars().next() else {
        return false;
    };
    let second = text.chars().nth(1);
    !looks_typed(text)
        && text.chars().all(|c| is_printable(c) && !is_break_or_tab(c))
        && !text.starts_with(' ')
        && !text.ends_with(' ')
        && !text.ends_with(':')
        && !text.contains(": ")
        && !text.contains(" #")
        && !text.starts_with("---")
        && !text.starts_with("...")
        && match first {
            // `-x` stays plain (`--port=8080`, `-c`); `- x` and a lone `-` would be a sequence.
            '-' => second.is_some_and(|c| c != ' '),
            '?' | ':' | ',' | '[' | ']' | '{' | '}' | '#' | '&' | '*' | '!' | '|' | '>' | '\''
            | '"' | '%' | '@' | '`' => false,
            _ => true,
        }
}

/// Whether a plain scalar might resolve to something other than a string in YAML 1.1 or 1.2.
///
/// Booleans and nulls are matched in any case (YAML 1.1 lists `yes`, `Yes`, `YES`, `y`, `on`
/// …; no reader takes `yEs` for a boolean, but quoting it costs nothing). Every number and
/// timestamp form of either version (decimal, `0x1F`, `0o17`, `0b101`, octal `0755`, `1_000`,
/// base 60 `1:30`, floats such as `.5`, `1e3` or `1.2.3` for a strict 1.1 reader, `2001-12-14`,
/// `2001-12-14 21:59:43.10 -5`) starts with a digit, or with a sign or a dot before one, and
/// uses only digits, `_ : . + -`, spaces and the letters of hex digits, exponents, base
/// prefixes and timestamps. A string made of those alone is quoted; one with any other
/// character (`60s`, `20Mi`, `0.0.0.0:4143=127.0.0.1:8080`, `0 3 * * *`) is not a number or
/// a timestamp in any reader and stays plain.
fn looks_typed(text: &str) -> bool {
    const WORDS: [&str; 13] = [
        "y", "n", "yes", "no", "on", "off", "true", "false", "null", "~", "<<", "=", ".nan",
    ];
    let lower = text.to_ascii_lowercase();
    let unsigned = lower.strip_prefix(['-', '+']).unwrap_or(&lower);
    let mut chars = unsigned.chars();
    let starts_numeric = match chars.next() {
        Some(c) if c.is_ascii_digit() => true,
        Some('.') => chars.next().is_some_and(|c| c.is_ascii_digit()),
        _ => false,
    };
    let numeric_alphabet = |c: char| {
        c.is_ascii_hexdigit()
            || matches!(c, '_' | ':' | '.' | '+' | '-' | ' ' | 'x' | 'o' | 't' | 'z')
    };
    WORDS.contains(&lower.as_str())
        || unsigned == ".inf"
        || (starts_numeric && unsigned.chars().all(numeric_alphabet))
}

/// A literal block (`|`) holds any multi-line string of printable characters whose first line
/// does not start with a space or a line break (those would need an indentation indicator,
/// which readers disagree on; they go double-quoted instead).
fn is_literal_safe(text: &str) -> bool {
    text.contains('\n')
        && !text.starts_with([' ', '\n'])
        && text
            .chars()
            .all(|c| c == '\n' || c == '\t' || (is_printable(c) && !is_break_or_tab(c)))
}

fn literal(out: &mut String, text: &str, indent: usize) {
    let trailing = text.len() - text.trim_end_matches('\n').len();
    out.push_str(match trailing {
        0 => "|-",
        1 => "|",
        _ => "|+",
    });
    let body = text.strip_suffix('\n').unwrap_or(text);
    for line in body.split('\n') {
        out.push('\n');
        if !line.is_empty() {
            pad(out, indent);
            out.push_str(line);
        }
    }
}

fn double_quoted(out: &mut String, text: &str) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            '\0' => out.push_str("\\0"),
            '\u{85}' => out.push_str("\\N"),
            '\u{2028}' => out.push_str("\\L"),
            '\u{2029}' => out.push_str("\\P"),
            c if is_printable(c) && c != '\u{feff}' => out.push(c),
            c if (c as u32) <= 0xff => {
                let _ = write!(out, "\\x{:02X}", c as u32);
            }
            c if (c as u32) <= 0xffff => {
                let _ = write!(out, "\\u{:04X}", c as u32);
            }
            c => {
                let _ = write!(out, "\\U{:08X}", c as u32);
            }
        }
    }
    out.push('"');
}

/// YAML's printable set (c-printable), less the byte-order mark.
fn is_printable(c: char) -> bool {
    matches!(c,
        '\t' | '\n' | '\r' | '\u{20}'..='\u{7e}' | '\u{85}' | '\u{a0}'..='\u{d7ff}'
        | '\u{e000}'..='\u{fffd}' | '\u{10000}'..='\u{10ffff}')
        && c != '\u{feff}'
}

/// Line breaks of YAML 1.2 and the extra ones of YAML 1.1 (NEL, LS, PS), and the tab.
fn is_break_or_tab(c: char) -> bool {
    matches!(c, '\n' | '\r' | '\t' | '\u{85}' | '\u{2028}' | '\u{2029}')
}

fn pad(out: &mut String, indent: usize) {
    out.extend(std::iter::repeat_n(' ', indent));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(yaml: &str) -> Value {
        serde_norway::from_str(yaml).unwrap()
    }

    fn roundtrip(text: &str) -> String {
        let mut map = serde_norway::Mapping::new();
        map.insert("k".into(), text.into());
        let value = Value::Mapping(map);
        let yaml = to_string(&value).unwrap();
        assert_eq!(read(&yaml), value, "{text:?} written as {yaml}");
        yaml
    }

    #[test]
    fn strings_that_a_yaml_1_1_reader_types_are_quoted() {
        for text in [
            "yes",
            "No",
            "ON",
            "off",
            "y",
            "N",
            "true",
            "False",
            "null",
            "~",
            "",
            "<<",
            "=",
            "1:30",
            "1_000",
            "0b101",
            "0755",
            "0x1F",
            "0o17",
            "2001-12-14",
            "1.5",
            ".5",
            "-1",
            "+.inf",
            ".NaN",
            "1e3",
            "10.0.0.1",
            "-.5",
            "1.2.3",
            "2001-12-14 21:59:43.10 -5",
            "2001-12-14t21:59:43.10-05:00",
            "0xDEAD_beef",
            "1d",
        ] {
            let yaml = roundtrip(text);
            assert!(
                yaml.starts_with("k: '") || yaml.starts_with("k: \""),
                "{text:?} written as {yaml}"
            );
        }
    }

    #[test]
    fn ordinary_strings_stay_plain() {
        for text in [
            "hello",
            "nginx:1.25",
            "/bin/sh",
            "--port=8080",
            "-c",
            "a yes b",
            "lameduck.io/inject",
            "http://x.test/a#b",
            "über",
            "60s",
            "20Mi",
            "0.0.0.0:4143=127.0.0.1:8080",
            "0 3 * * *",
            "1.25-alpine",
            "8080, 9090",
        ] {
            assert_eq!(roundtrip(text), format!("k: {text}\n"));
        }
    }

    #[test]
    fn syntax_that_plain_cannot_hold_is_quoted() {
        for text in [
            "a: b",
            "a #b",
            "x:",
            " lead",
            "trail ",
            "- x",
            "-",
            "#x",
            "*x",
            "&x",
            "!x",
            "|",
            ">",
            "'q'",
            "\"q\"",
            "%x",
            "@x",
            "`x",
            "---",
            "...",
            "?x",
            ":x",
            "{a}",
            "[a]",
            "tab\there",
            "bell\u{7}",
            "bom\u{feff}",
            "nel\u{85}",
            "cr\r",
        ] {
            let yaml = roundtrip(text);
            assert!(!yaml.starts_with(&format!("k: {text}")), "{text:?}: {yaml}");
        }
    }

    #[test]
    fn multi_line_strings_are_literal_blocks_that_read_back_exactly() {
        assert_eq!(roundtrip("a\nb"), "k: |-\n  a\n  b\n");
        assert_eq!(roundtrip("a\nb\n"), "k: |\n  a\n  b\n");
        assert_eq!(roundtrip("a\n\n  b\n\n"), "k: |+\n  a\n\n    b\n\n");
        for text in [" a\nb", "\na", "a\r\nb", "yes\n"] {
            roundtrip(text);
        }
    }

    #[test]
    fn layout_is_libyaml_s() {
        let yaml = "a:\n  b:\n  - c: 1\n    d:\n    - x\n    - - w\n      - z\n  e: {}\n  f: []\n  g: null\n";
        let value = read(yaml);
        assert_eq!(to_string(&value).unwrap(), yaml);
        let top = read("- a\n- b: c\n");
        assert_eq!(to_string(&top).unwrap(), "- a\n- b: c\n");
    }

    #[test]
    fn numbers_and_booleans_stay_typed() {
        let value = read("a: 1\nb: -2.5\nc: true\nd: null\ne: 18446744073709551615\n");
        let yaml = to_string(&value).unwrap();
        assert_eq!(read(&yaml), value);
        assert_eq!(
            yaml,
            "a: 1\nb: -2.5\nc: true\nd: null\ne: 18446744073709551615\n"
        );
    }

    #[test]
    fn tagged_values_and_odd_keys() {
        let value = read("a: !Thing x\nb: !Other\n  c: d\n1: one\n'yes': k\n");
        let yaml = to_string(&value).unwrap();
        assert_eq!(read(&yaml), value, "{yaml}");
        assert!(yaml.contains("'yes': k"), "{yaml}");
        let complex = read("? [a]\n: b\n");
        assert!(to_string(&complex).is_err());
    }
}
