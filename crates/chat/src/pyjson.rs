//! Python's `json.dumps` and `repr` over template values, so that `tojson` and printed
//! containers come out byte for byte as they do under HF transformers.

use std::fmt::Write as _;

use minijinja::value::ValueKind;
use minijinja::{Error, ErrorKind, Value};

/// Options of Python's `json.dumps` that HF's `tojson` filter exposes.
#[derive(Debug, Clone, Default)]
pub(crate) struct DumpOptions {
    /// Escape every non-ASCII character as `\uXXXX` (HF's default is `false`).
    pub ensure_ascii: bool,
    /// Pretty-print with this indent string per level (Python: `indent=n` is `n` spaces).
    pub indent: Option<String>,
    /// `(item_separator, key_separator)`; defaults depend on `indent` as in Python.
    pub separators: Option<(String, String)>,
    /// Sort object keys.
    pub sort_keys: bool,
}

fn not_serializable(kind: &str) -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!("tojson: object of type {kind} is not JSON serializable"),
    )
}

/// `json.dumps(value, ...)`.
pub(crate) fn dumps(value: &Value, opts: &DumpOptions) -> Result<String, Error> {
    let (item_sep, key_sep) = match &opts.separators {
        Some((i, k)) => (i.clone(), k.clone()),
        None if opts.indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let mut out = String::new();
    let ctx = Dumper {
        opts,
        item_sep: &item_sep,
        key_sep: &key_sep,
    };
    ctx.write(&mut out, value, 0)?;
    Ok(out)
}

struct Dumper<'a> {
    opts: &'a DumpOptions,
    item_sep: &'a str,
    key_sep: &'a str,
}

impl Dumper<'_> {
    fn newline(&self, out: &mut String, level: usize) {
        if let Some(ind) = &self.opts.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    }

    fn write(&self, out: &mut String, value: &Value, level: usize) -> Result<(), Error> {
        match value.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => write_number(out, value),
            ValueKind::String => write_json_string(
                out,
                value.as_str().unwrap_or_default(),
                self.opts.ensure_ascii,
            ),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(self.item_sep);
                    }
                    self.newline(out, level + 1);
                    self.write(out, item, level + 1)?;
                }
                self.newline(out, level);
                out.push(']');
            }
            ValueKind::Map => {
                let mut entries = Vec::new();
                for key in value.try_iter()? {
                    let item = value.get_item(&key)?;
                    entries.push((json_key(&key)?, item));
                }
                if self.opts.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                if entries.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                out.push('{');
                for (i, (key, item)) in entries.iter().enumerate() {
                    if i > 0 {
                        out.push_str(self.item_sep);
                    }
                    self.newline(out, level + 1);
                    write_json_string(out, key, self.opts.ensure_ascii);
                    out.push_str(self.key_sep);
                    self.write(out, item, level + 1)?;
                }
                self.newline(out, level);
                out.push('}');
            }
            ValueKind::Undefined => return Err(not_serializable("Undefined")),
            ValueKind::Bytes => return Err(not_serializable("bytes")),
            ValueKind::Plain => return Err(not_serializable("object")),
            ValueKind::Invalid => return Err(not_serializable("invalid value")),
            _ => return Err(not_serializable("unknown")),
        }
        Ok(())
    }
}

/// Python converts `int`, `float`, `bool` and `None` keys to strings; anything else is a
/// `TypeError`.
fn json_key(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_string()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_string()),
        ValueKind::None => Ok("null".to_string()),
        ValueKind::Number => {
            let mut s = String::new();
            write_number(&mut s, key);
            Ok(s)
        }
        other => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: keys must be str, int, float, bool or None, not {other}"),
        )),
    }
}

fn write_number(out: &mut String, value: &Value) {
    if value.is_integer() {
        // Display of an integer value is its decimal digits.
        let _ = write!(out, "{value}");
    } else {
        let f = f64::try_from(value.clone()).unwrap_or(f64::NAN);
        out.push_str(&float_json(f));
    }
}

/// Python's `json` float encoding: `repr(f)`, with `NaN`, `Infinity`, `-Infinity`.
pub(crate) fn float_json(f: f64) -> String {
    if f.is_nan() {
        "NaN".to_string()
    } else if f.is_infinite() {
        if f > 0.0 { "Infinity" } else { "-Infinity" }.to_string()
    } else {
        float_repr(f)
    }
}

/// Python's `repr(float)`: the shortest round-tripping digits, in fixed notation when the
/// decimal exponent is in `-4..16`, else scientific with a signed, two-digit-minimum exponent.
pub(crate) fn float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".to_string();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf" } else { "-inf" }.to_string();
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "-1.2345e-7", "1e16", "0e0".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let mut out = String::from(sign);
    if (-4..16).contains(&exp) {
        if exp < 0 {
            out.push_str("0.");
            for _ in 0..(-exp - 1) {
                out.push('0');
            }
            out.push_str(&digits);
        } else {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                for _ in digits.len()..int_len {
                    out.push('0');
                }
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(
            out,
            "e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.unsigned_abs()
        );
    }
    out
}

/// A JSON string literal as Python's `json` encoder writes it.
pub(crate) fn write_json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{u:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A JSON string literal (HF defaults: non-ASCII kept).
pub(crate) fn json_string(s: &str) -> String {
    let mut out = String::new();
    write_json_string(&mut out, s, false);
    out
}

/// Python's `repr` of a value, used when a template prints a list or dict directly.
pub(crate) fn python_repr(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::String => python_str_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Number if !value.is_integer() => out.push_str(&float_repr(
            f64::try_from(value.clone()).unwrap_or(f64::NAN),
        )),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            if let Ok(iter) = value.try_iter() {
                for (i, item) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    python_repr(out, &item);
                }
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(iter) = value.try_iter() {
                for (i, key) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    python_repr(out, &key);
                    out.push_str(": ");
                    python_repr(out, &value.get_item(&key).unwrap_or_default());
                }
            }
            out.push('}');
        }
        // None, booleans, integers: minijinja's Display already matches Python's str().
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

/// Python's `repr(str)`: single quotes unless the text has `'` and no `"`.
fn python_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if is_python_unprintable(c) => {
                let n = c as u32;
                let _ = if n <= 0xff {
                    write!(out, "\\x{n:02x}")
                } else if n <= 0xffff {
                    write!(out, "\\u{n:04x}")
                } else {
                    write!(out, "\\U{n:08x}")
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Python's `str.isprintable()` is false for control, format, separator (other than
/// space) and unassigned characters; this covers the control and common separator/format
/// characters (an approximation: no full Unicode tables).
fn is_python_unprintable(c: char) -> bool {
    matches!(c as u32,
        0x00..=0x1f | 0x7f..=0xa0 | 0xad | 0x1680 | 0x2000..=0x200f | 0x2028..=0x202f
        | 0x205f..=0x2064 | 0x3000 | 0xfeff | 0xd800..=0xdfff)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python_for_reference_values() {
        // Values and strings from CPython 3 `repr`.
        let cases: &[(f64, &str)] = &[
            (1.0, "1.0"),
            (-0.0, "-0.0"),
            (0.0, "0.0"),
            (0.1, "0.1"),
            (1.5, "1.5"),
            (100.0, "100.0"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.2345e16, "1.2345e+16"),
            (123456789012345678.0, "1.2345678901234568e+17"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1e-100, "1e-100"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (5e-324, "5e-324"),
            (std::f64::consts::PI, "3.141592653589793"),
            (-2.5, "-2.5"),
            (0.30000000000000004, "0.30000000000000004"),
            (9999999999999998.0, "9999999999999998.0"),
        ];
        for (f, want) in cases {
            assert_eq!(float_repr(*f), *want, "repr({f:?})");
        }
        assert_eq!(float_json(f64::NAN), "NaN");
        assert_eq!(float_json(f64::INFINITY), "Infinity");
        assert_eq!(float_json(f64::NEG_INFINITY), "-Infinity");
    }

    #[test]
    fn python_repr_of_containers_uses_python_quoting() {
        let v = Value::from_serialize(serde_json::json!({"a": [1, 2.0, "it's", true, null]}));
        let mut s = String::new();
        python_repr(&mut s, &v);
        assert_eq!(s, r#"{'a': [1, 2.0, "it's", True, None]}"#);
    }
}
