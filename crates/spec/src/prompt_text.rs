//! Drafts for structured output from the prompt text, by the record layout learned per
//! JSON key path.
//!
//! Extraction (CSV, log lines, `key: value` text, an HTML table to JSON) writes the
//! prompt's values in order while the grammar writes the syntax. The [`PromptTextDrafter`]
//! follows the output with a small JSON scanner and, each time a value is complete, finds
//! it in the prompt text (a *location*). Keys are paths (`items/product`: a nested
//! record's fields are not the outer record's). Per key it learns the value's left context
//! (the bytes before it in the prompt, common to its locations: `,"` in CSV, `\nEmail: `,
//! `>` in a table; a first location's line start when other lines start alike) and its
//! right context, and per pair of consecutive located keys how many left contexts lie
//! between the end of the first value and the start of the second (a *relation*), or
//! where inside the value before it the second sits (`took 842ms` → 842). When the output
//! opens a value of key `K`, the value is predicted from the most recent location: after
//! the end of that value, the `n`-th occurrence of `K`'s left context starts it and its
//! right context ends it (a quoted CSV field: its closing quote; a number: where it stops).
//!
//! Values the prompt writes otherwise are drafted by the mapping an earlier record showed:
//! numbers without thousands separators (`$1,234.50` → `1234.50`), dates re-ordered and
//! padded from their words (`3 March 2024` → `2024-03-03`), and `true`/`false`/`null` for
//! the prompt word they stood for (`yes` → `true`).
//!
//! A draft runs on past the value: the scanner also keeps, per key path, the output
//! between the end of its value and the start of the next (the *gap*: closing quote,
//! separators, indentation, the next key, the next value's opening quote, as the model
//! wrote them in the previous record), so one proposal chains value, gap, value, … through
//! a whole record. In a first record (no gap learned yet) it drafts what followed keys so
//! far (`": "`) and, where a value's end is sure, the separator before the next key (the
//! grammar forces the key). Where nothing more is predicted (a first record), the ways
//! the output can go on by its layout (pretty-printed with its indent, or compact: a
//! key's colon and a value's opening, the next member or the closings after a value, the
//! first member after an opening), a first record's next number, and its date in the
//! format the request names are offered to the grammar mirror, which picks the first it
//! takes whole. The output's first value continues the first word of the request that
//! starts with what was written. The text is re-encoded on its own, which is
//! how a model writes what it copies, and every token passes the grammar mirror. It
//! drafts only under a constraint, inside JSON: free text is the other drafters' business.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use text::{EncodeOptions, Tokenizer};

use crate::drafter::{DraftContext, DraftProposal, Drafter, DrafterKind, Mirror};

/// Separator standing in for a special token in the prompt text.
const SPECIAL: u8 = 0xFF;
/// Longest left or right context kept.
const MAX_CONTEXT: usize = 16;
/// Longest value predicted, bytes.
const MAX_VALUE: usize = 160;
/// Shortest value located in the prompt (shorter ones are too ambiguous).
const MIN_LOCATED: usize = 2;
/// Locations kept per key for its contexts.
const KEEP: usize = 3;
/// Most bytes searched ahead of the reference point for a partly written value.
const RESYNC: usize = 512;
/// Longest syntax gap between two values kept (pretty-printed closings of nested records
/// included).
const MAX_GAP: usize = 96;
/// Most values and gaps chained into one proposal.
const MAX_PARTS: usize = 16;
/// Most text bytes drafted per proposal (the caps cut it to tokens).
const MAX_TEXT: usize = 256;

fn is_value_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || (b >= 0x80 && b != SPECIAL)
}

/// The word (value bytes) at `q`.
fn word_at(src: &[u8], q: usize) -> &[u8] {
    let rest = &src[q.min(src.len())..];
    let n = rest.iter().take_while(|&&b| is_value_byte(b)).count();
    &rest[..n]
}

/// A byte of a plain number (`-12.50`).
fn is_number_byte(b: u8) -> bool {
    b.is_ascii_digit() || matches!(b, b'.' | b'-')
}

/// A JSON container being written.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Frame {
    object: bool,
    /// An object's current key; an array inherits its parent's.
    key: Vec<u8>,
}

/// A value of the output found in the prompt text.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Located {
    key: Vec<u8>,
    start: usize,
    end: usize,
}

/// The scanner's state and what it learned (cloned per proposal, then advanced over the
/// drafts).
#[derive(Clone, Debug, Default)]
struct State {
    stack: Vec<Frame>,
    expect_key: bool,
    in_string: bool,
    string_is_key: bool,
    escape: bool,
    in_number: bool,
    /// The string or number being written (raw bytes).
    buf: Vec<u8>,
    /// Locations in output order (the last [`KEEP`] per key and the most recent one
    /// matter).
    located: Vec<Located>,
    /// (previous key, key) → (left context, occurrences from the previous value's end).
    relations: HashMap<KeyPair, (Vec<u8>, usize)>,
    /// (previous key, key) → the bytes after the key's value to the end of the previous
    /// value, when the key's value was found inside it.
    inside: HashMap<KeyPair, Vec<u8>>,
    /// Key paths whose last value was a number.
    numeric: HashSet<Vec<u8>>,
    /// Key path → the bytes between its key's closing quote and its value (`": "`).
    post: HashMap<Vec<u8>, Vec<u8>>,
    /// The bytes between the last key and its value.
    last_post: Option<Vec<u8>>,
    /// After a key, until its value starts: the bytes since the key's closing quote.
    post_buf: Option<Vec<u8>>,
    /// Depth → the separator between a value and the next key in one object (`,` or
    /// `,\n    ` after the closing quote).
    seps: HashMap<usize, Vec<u8>>,
    /// Key path → the templates its values were re-formatted from the prompt by.
    formats: HashMap<Vec<u8>, Vec<DateFormat>>,
    /// Key paths whose last value was `true`, `false` or `null`.
    literal: HashSet<Vec<u8>>,
    /// (key path, prompt word) → the literal written for it.
    mapped: HashMap<KeyPair, Vec<u8>>,
    /// Key paths with a value written (located or not).
    written: HashSet<Vec<u8>>,
    /// Writing `true`, `false` or `null`.
    in_literal: bool,
    /// Between two values: the key path of the value before and the output bytes since
    /// it ended (its closing quote, separators, the next key, the next value's opening
    /// quote).
    gap: Option<Gap>,
    /// Key path → the gap that followed its value the last time (the record's syntax up
    /// to the next value, as the model wrote it).
    gaps: HashMap<Vec<u8>, Vec<u8>>,
    /// The output's layout, as far as it has shown it.
    layout: Layout,
    /// Whitespace written outside strings since the last other byte.
    ws: Vec<u8>,
    /// The last byte outside strings that is not whitespace (a value string's closing
    /// quote included), 0 before the JSON.
    last_sig: u8,
}

/// How the output lays JSON out, learned from what it wrote: pretty-printed (a newline
/// and an indent of `indent` spaces per depth) or compact (a space after `,` or not).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Layout {
    /// `Some(true)`: newlines between members; `Some(false)`: none; `None`: not shown yet.
    pretty: Option<bool>,
    /// Spaces per depth of a pretty output.
    indent: Option<usize>,
    /// Compact: a space after `,`.
    comma_space: Option<bool>,
}

/// The output between the end of one value and the start of the next.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Gap {
    /// Key path of the value before.
    after: Vec<u8>,
    /// Bytes since it ended.
    bytes: Vec<u8>,
}

/// (previous key, key) of a relation.
type KeyPair = (Vec<u8>, Vec<u8>);

impl State {
    /// The key path of the value being written: the keys of the enclosing objects,
    /// joined by `/` (a nested record's `name` is not the outer record's).
    fn key(&self) -> Vec<u8> {
        let mut path = Vec::new();
        for f in self.stack.iter().filter(|f| f.object) {
            if !path.is_empty() {
                path.push(b'/');
            }
            path.extend_from_slice(&f.key);
        }
        path
    }

    /// The rest of the syntax up to the value of the key being written (inside the key
    /// or after it): what followed this key last time, else what followed the last key.
    fn post_rest(&self) -> Option<Vec<u8>> {
        let learned = |path: &[u8]| self.post.get(path).or(self.last_post.as_ref()).cloned();
        if self.in_string && self.string_is_key {
            let mut path = Vec::new();
            let n = self.stack.iter().filter(|f| f.object).count();
            for (i, f) in self.stack.iter().filter(|f| f.object).enumerate() {
                if i > 0 {
                    path.push(b'/');
                }
                path.extend_from_slice(if i + 1 == n { &self.buf } else { &f.key });
            }
            let mut rest = vec![b'"'];
            rest.extend(learned(&path)?);
            return Some(rest);
        }
        let done = self.post_buf.as_ref()?;
        learned(&self.key())?
            .strip_prefix(done.as_slice())
            .map(<[u8]>::to_vec)
    }

    /// A value ended: the gap after it starts.
    fn end_value(&mut self) {
        self.gap = Some(Gap {
            after: self.key(),
            bytes: Vec::new(),
        });
    }

    /// A value starts: the gap before it (if any) is learned for the value before.
    fn start_value(&mut self) {
        if let Some(g) = self.gap.take()
            && g.bytes.len() <= MAX_GAP
        {
            // Between two values of one object: the separator before the key.
            let body = g.bytes.strip_prefix(b"\"").unwrap_or(&g.bytes);
            if let Some(k) = body.iter().position(|&b| b == b'"')
                && !body.iter().any(|b| b"{}[]".contains(b))
            {
                self.seps.insert(self.stack.len(), body[..k].to_vec());
            }
            self.gaps.insert(g.after, g.bytes);
        }
    }

    /// A new line at `depth` as the layout writes it: pretty, a newline and the indent
    /// (2 spaces per depth until the output shows its own); compact, nothing (after a
    /// comma: the space it was followed by). `None` while the layout is unknown.
    fn newline(&self, depth: usize, after_comma: bool) -> Option<Vec<u8>> {
        if self.layout.pretty? {
            let mut v = vec![b'\n'];
            v.resize(1 + self.layout.indent.unwrap_or(2) * depth, b' ');
            Some(v)
        } else {
            Some(if after_comma && self.layout.comma_space == Some(true) {
                b" ".to_vec()
            } else {
                Vec::new()
            })
        }
    }

    /// An object opened at `depth` (containers open around it), up to its first key's
    /// opening quote.
    fn open_object(&self, depth: usize) -> Option<Vec<u8>> {
        let mut v = vec![b'{'];
        v.extend(self.newline(depth + 1, false)?);
        v.push(b'"');
        Some(v)
    }

    /// The ways the output can go on after a value at the current depth ends, most
    /// likely first: the next member of its container, else the container closes and
    /// the next member of the one around it follows, and so on; last, everything
    /// closes. A next member of an array is an object (records).
    fn after_value(&self) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut closed = Vec::new();
        for d in (1..=self.stack.len()).rev() {
            let object = self.stack[d - 1].object;
            let (Some(nl), Some(back)) = (self.newline(d, true), self.newline(d - 1, false)) else {
                return out;
            };
            let mut next = closed.clone();
            next.push(b',');
            next.extend(nl);
            if object {
                next.push(b'"');
            } else {
                let Some(open) = self.open_object(d) else {
                    return out;
                };
                next.extend(open);
            }
            out.push(next);
            closed.extend(back);
            closed.push(if object { b'}' } else { b']' });
        }
        out.push(closed);
        out
    }

    /// The bytes between a key's closing quote and its value: as the last key was
    /// followed, else `: ` when pretty and `:` when compact.
    fn colon(&self) -> Option<Vec<u8>> {
        if let Some(p) = &self.last_post {
            return Some(p.strip_suffix(b"\"").unwrap_or(p).to_vec());
        }
        Some(if self.layout.pretty? {
            b": ".to_vec()
        } else {
            b":".to_vec()
        })
    }

    /// The ways a value can open after a key at the current depth: a string, an object,
    /// an array of objects.
    fn value_opens(&self) -> Vec<Vec<u8>> {
        let d = self.stack.len();
        let mut out = vec![b"\"".to_vec()];
        if let Some(o) = self.open_object(d) {
            out.push(o);
        }
        if let (Some(nl), Some(o)) = (self.newline(d + 1, false), self.open_object(d + 1)) {
            let mut a = vec![b'['];
            a.extend(nl);
            a.extend(o);
            out.push(a);
        }
        out
    }

    /// The rest of an unknown gap up to the next key's opening quote, by the separator
    /// between two values at this depth (a first record's `",\n    "`): the grammar
    /// then forces the key.
    fn sep_rest(&self) -> Option<Vec<u8>> {
        let g = self.gap.as_ref()?;
        let sep = self.seps.get(&self.stack.len())?;
        let mut full = Vec::new();
        if g.bytes.first() == Some(&b'"') {
            full.push(b'"');
        }
        full.extend_from_slice(sep);
        full.push(b'"');
        full.strip_prefix(g.bytes.as_slice())
            .filter(|r| !r.is_empty())
            .map(<[u8]>::to_vec)
    }

    fn feed(&mut self, src: &[u8], b: u8) {
        if self.in_string && !self.string_is_key {
            self.feed_value_string(src, b);
            return;
        }
        if self.in_literal {
            if b.is_ascii_lowercase() {
                self.buf.push(b);
                return;
            }
            self.in_literal = false;
            let v = std::mem::take(&mut self.buf);
            self.complete_literal(src, v);
            self.end_value();
        }
        if self.in_number {
            if b.is_ascii_digit() || matches!(b, b'.' | b'-' | b'+' | b'e' | b'E') {
                self.buf.push(b);
                return;
            }
            self.in_number = false;
            let v = std::mem::take(&mut self.buf);
            self.numeric.insert(self.key());
            self.complete(src, &v);
            self.end_value();
        }
        let value_string = b == b'"'
            && !self.in_string
            && !(self.expect_key && self.stack.last().is_some_and(|f| f.object));
        let starts = (b == b'-' || b.is_ascii_digit() || b.is_ascii_lowercase())
            && !self.in_string
            && !self.expect_key
            && !self.stack.is_empty();
        if !starts {
            if let Some(g) = self.gap.as_mut() {
                g.bytes.push(b);
            }
            if let Some(p) = self.post_buf.as_mut() {
                p.push(b);
            }
        }
        if starts || value_string {
            self.start_value();
            if let Some(p) = self.post_buf.take()
                && p.len() <= MAX_CONTEXT
            {
                self.post.insert(self.key(), p.clone());
                self.last_post = Some(p);
            }
        } else if matches!(b, b'{' | b'[')
            && !self.in_string
            && let Some(p) = self.post_buf.take()
            && p.len() <= MAX_CONTEXT
        {
            // A key's value is an object or an array: what followed the key ends at its
            // opening (not the colon other keys' values follow).
            self.post.insert(self.key(), p);
        }
        if !self.in_string {
            self.track_layout(b);
        }
        if self.in_string {
            // A key.
            if self.escape {
                self.escape = false;
                self.buf.push(b);
            } else if b == b'\\' {
                self.escape = true;
                self.buf.push(b);
            } else if b == b'"' {
                self.in_string = false;
                if let Some(f) = self.stack.last_mut() {
                    f.key = std::mem::take(&mut self.buf);
                }
                self.post_buf = Some(Vec::new());
            } else {
                self.buf.push(b);
            }
            return;
        }
        if self.stack.is_empty() && b != b'{' && b != b'[' {
            return; // text around the JSON
        }
        match b {
            b'{' | b'[' => {
                let key = self.key();
                self.stack.push(Frame {
                    object: b == b'{',
                    key,
                });
                self.expect_key = b == b'{';
            }
            b'}' | b']' => {
                self.stack.pop();
                self.expect_key = false;
            }
            b',' => self.expect_key = self.stack.last().is_some_and(|f| f.object),
            b':' => self.expect_key = false,
            b'"' => {
                self.in_string = true;
                self.string_is_key = self.expect_key && self.stack.last().is_some_and(|f| f.object);
                self.buf.clear();
            }
            b'-' | b'0'..=b'9' if !self.expect_key => {
                self.in_number = true;
                self.buf.clear();
                self.buf.push(b);
            }
            b'a'..=b'z' if !self.expect_key => {
                self.in_literal = true;
                self.buf.clear();
                self.buf.push(b);
            }
            _ => {}
        }
    }

    /// Learns the layout from a byte outside strings (before the scanner acts on it).
    fn track_layout(&mut self, b: u8) {
        if self.stack.is_empty() {
            if matches!(b, b'{' | b'[') {
                self.ws.clear();
                self.last_sig = b;
            }
            return;
        }
        if b.is_ascii_whitespace() {
            if b == b'\n' {
                self.layout.pretty.get_or_insert(true);
            }
            self.ws.push(b);
            return;
        }
        let opened = matches!(self.last_sig, b'[' | b'{' | b',');
        if let Some(nl) = self.ws.iter().rposition(|&b| b == b'\n') {
            let spaces = self.ws.len() - nl - 1;
            let depth = self.stack.len() - usize::from(matches!(b, b'}' | b']'));
            if self.layout.indent.is_none()
                && depth > 0
                && spaces > 0
                && spaces.is_multiple_of(depth)
                && self.ws[nl + 1..].iter().all(|&c| c == b' ')
            {
                self.layout.indent = Some(spaces / depth);
            }
        } else if opened {
            self.layout.pretty.get_or_insert(false);
            if self.last_sig == b',' && self.layout.comma_space.is_none() {
                self.layout.comma_space = Some(self.ws == b" ");
            }
        }
        self.ws.clear();
        self.last_sig = b;
    }

    /// A byte inside a string value.
    fn feed_value_string(&mut self, src: &[u8], b: u8) {
        if self.escape {
            self.escape = false;
            self.buf.push(b);
        } else if b == b'\\' {
            self.escape = true;
            self.buf.push(b);
        } else if b == b'"' {
            self.in_string = false;
            self.last_sig = b;
            self.ws.clear();
            let v = std::mem::take(&mut self.buf);
            self.numeric.remove(&self.key());
            self.complete(src, &v);
            self.end_value();
            if let Some(g) = self.gap.as_mut() {
                g.bytes.push(b);
            }
        } else {
            self.buf.push(b);
        }
    }

    /// Where the next value of `key` is predicted to start in `src`: after the most
    /// recent location, by the relation of its key to `key` (else `key`'s own previous
    /// location and relation). Also returns the reference end.
    fn predict(&self, src: &[u8], key: &[u8]) -> Option<(usize, usize)> {
        let last = self.located.last()?;
        let by_pair = self
            .relations
            .get(&(last.key.clone(), key.to_vec()))
            .map(|(l, n)| (last.end, l.clone(), *n));
        let by_self = || {
            let own = self.located.iter().rev().find(|l| l.key == key)?;
            let (l, n) = self.relations.get(&(key.to_vec(), key.to_vec()))?;
            Some((own.end, l.clone(), *n))
        };
        // With no relation yet: the next occurrence of the key's own left context.
        let next = || {
            let own: Vec<&Located> = self
                .located
                .iter()
                .rev()
                .filter(|l| l.key == key)
                .take(KEEP)
                .collect();
            let (first, rest) = own.split_first()?;
            let left = left_context(src, first.start, rest, self.floor(first));
            Some((last.end, left, 1))
        };
        // A key never located yet (the first record): the next field, by the left
        // context of the value before it.
        let next_field = || {
            if self.written.contains(key) {
                return None;
            }
            let own: Vec<&Located> = self
                .located
                .iter()
                .rev()
                .filter(|l| l.key == last.key)
                .take(KEEP)
                .collect();
            let (first, rest) = own.split_first()?;
            let left = left_context(src, first.start, rest, None);
            Some((last.end, left, 1))
        };
        // Inside the value before, at the same distance from its end (`took 842ms`: the
        // duration before `ms`).
        let inside = || {
            let tail = self.inside.get(&(last.key.clone(), key.to_vec()))?;
            let span = &src[last.start..last.end];
            if !span.ends_with(tail) {
                return None;
            }
            let end = last.end - tail.len();
            let numeric = self.numeric.contains(key);
            let mut q = end;
            while q > last.start
                && (is_value_byte(src[q - 1]) && (!numeric || is_number_byte(src[q - 1])))
            {
                q -= 1;
            }
            (q < end).then_some((q, last.start))
        };
        if let Some(p) = inside() {
            return Some(p);
        }
        let known = by_pair.or_else(by_self).or_else(next);
        if known.is_none() && !self.written.contains(key) && src[..last.start].ends_with(b"\n") {
            // A first record's field after one that starts a line: after the delimiters
            // that follow the value before (`,` in CSV).
            let n = src[last.end..]
                .iter()
                .take_while(|&&b| !is_value_byte(b) && b != SPECIAL && b != b'\n')
                .count();
            return (n > 0).then_some((last.end + n, last.end));
        }
        if known.is_none()
            && !self.written.contains(key)
            && let Some(q) = self.labelled(src, key, last.end)
        {
            return Some((q, last.end));
        }
        let guess = known.is_none();
        let (from, left, n) = known.or_else(next_field)?;
        if guess {
            // A first record's guess: the first place after the context where a value
            // can start (not `</td>` for `>`).
            let starts = |q: usize| {
                src.get(q)
                    .is_some_and(|&b| is_value_byte(b) || b"\"'+-$.#@(".contains(&b))
            };
            return (1..=8)
                .filter_map(|i| nth_after(src, from, &left, i))
                .find(|&q| starts(q))
                .map(|q| (q, from));
        }
        // The context, else its shorter ends (a first record's context may hold the
        // text before the records: `):\n`).
        (0..left.len())
            .find_map(|cut| nth_after(src, from, &left[cut..], n))
            .map(|q| (q, from))
    }

    /// A first record's field the prompt names (`customer: Maria Rossi`, `Unit price =
    /// 4`): within [`MAX_VALUE`] bytes after `from`, the start of the value after the
    /// key's name (its last part, or the enclosing object's name for its first field;
    /// case, `_` and `-` aside) and a `:` or `=`.
    fn labelled(&self, src: &[u8], key: &[u8], from: usize) -> Option<usize> {
        let mut parts = key.rsplit(|&b| b == b'/');
        let own = parts.next()?;
        let mut names = vec![own];
        if let Some(parent) = parts.next() {
            let prefix = &key[..key.len() - own.len()];
            if !self.written.iter().any(|w| w.starts_with(prefix)) {
                names.push(parent);
            }
        }
        let norm = |b: u8| match b.to_ascii_lowercase() {
            b'_' | b'-' => b' ',
            c => c,
        };
        let hi = (from.saturating_add(MAX_VALUE)).min(src.len());
        (from..hi).find_map(|q| {
            if q > 0 && is_value_byte(src[q - 1]) {
                return None;
            }
            let name = names.iter().find(|n| {
                n.len() >= 2
                    && src.len() >= q + n.len()
                    && src[q..q + n.len()]
                        .iter()
                        .zip(n.iter())
                        .all(|(&a, &b)| norm(a) == norm(b))
                    && !src.get(q + n.len()).is_some_and(|&b| is_value_byte(b))
            })?;
            let mut i = q + name.len();
            while src.get(i) == Some(&b' ') {
                i += 1;
            }
            if !matches!(src.get(i), Some(b':' | b'=')) {
                return None;
            }
            i += 1;
            while src.get(i) == Some(&b' ') {
                i += 1;
            }
            src.get(i)
                .is_some_and(|&b| is_value_byte(b) || b == b'"')
                .then_some(i)
        })
    }

    /// A `true`, `false` or `null` of the current key was completed: the prompt word at
    /// the predicted place is learned to map to it (`yes` → `true`), and located.
    fn complete_literal(&mut self, src: &[u8], v: Vec<u8>) {
        let key = self.key();
        let predicted = self.predict(src, &key);
        self.written.insert(key.clone());
        self.numeric.remove(&key);
        self.literal.insert(key.clone());
        let Some((q, _)) = predicted else {
            return;
        };
        let q = unquoted(src, q);
        let word = word_at(src, q);
        if word.is_empty() {
            return;
        }
        let end = q + word.len();
        self.mapped.insert((key.clone(), word.to_vec()), v);
        self.learn(src, key, q, end);
    }

    /// The end of the location before `loc` in the output, where it lies before `loc`
    /// in the prompt.
    fn floor(&self, loc: &Located) -> Option<usize> {
        let i = self.located.iter().position(|l| l == loc)?;
        Some(
            i.checked_sub(1)
                .map(|j| self.located[j].end)
                .filter(|&e| e <= loc.start)
                .unwrap_or(0),
        )
    }

    /// A value of the current key was completed: locate it in `src` and learn.
    fn complete(&mut self, src: &[u8], v: &[u8]) {
        let key = self.key();
        let predicted = self.predict(src, &key).map(|p| p.0);
        self.written.insert(key.clone());
        if v.is_empty() || v.contains(&b'\\') {
            return;
        }
        let after = self.located.last().map_or(0, |l| l.end);
        // A short value only where it was predicted, as a whole word.
        let whole = |q: usize| src.get(q + v.len()).is_none_or(|&b| !is_value_byte(b));
        let start = match predicted {
            Some(q) if src[unquoted(src, q)..].starts_with(v) && whole(unquoted(src, q)) => {
                Some(unquoted(src, q))
            }
            // The first occurrence standing on its own from the previous value on (a
            // number written inside the previous value: `took 12ms` → 12), else any.
            _ => find_bounded(src, self.located.last().map_or(0, |l| l.start), v).or_else(|| {
                if v.len() < MIN_LOCATED {
                    return None;
                }
                find(&src[after..], v)
                    .map(|p| after + p)
                    .or_else(|| find(src, v))
            }),
        };
        let from = self.located.last().map_or(0, |l| l.start);
        let Some(mut start) = start else {
            // Written differently: a number with thousands separators, a date.
            if let Some((q, e)) = find_number(src, from, v) {
                self.learn(src, key, q, e);
            } else if let Some((q, e, fs)) = DateFormat::find(src, predicted, after, v) {
                self.formats.insert(key.clone(), fs);
                self.learn(src, key, q, e);
            } else if let Some(fs) = self.formats.get_mut(&key) {
                // Keep the templates that explain this value where it was predicted.
                if let Some(q) = predicted {
                    fs.retain(|f| f.apply(src, q).as_deref() == Some(v));
                    if let Some(f) = fs.first() {
                        let e = q + f.span(src, q).unwrap_or(0);
                        self.learn(src, key, q, e);
                    }
                }
            }
            return;
        };
        let mut end = start + v.len();
        // A quoted field (`"Sales, EMEA"` in CSV): the field is the location, quotes
        // included, so its contexts are the delimiters around it.
        if start > 0 && src[start - 1] == b'"' && src.get(end) == Some(&b'"') {
            start -= 1;
            end += 1;
        }
        self.learn(src, key, start, end);
    }

    /// The value of `key` was found at `start..end` of `src`: learn its contexts and
    /// relations, and remember the location.
    fn learn(&mut self, src: &[u8], key: Vec<u8>, start: usize, end: usize) {
        let loc = Located {
            key: key.clone(),
            start,
            end,
        };
        let own: Vec<&Located> = self
            .located
            .iter()
            .rev()
            .filter(|l| l.key == key)
            .take(KEEP - 1)
            .collect();
        let left = left_context(
            src,
            start,
            &own,
            Some(self.located.last().map_or(0, |l| l.end)),
        );
        if let Some(p) = self.located.last()
            && p.start <= start
            && end < p.end
            && p.end - end <= MAX_CONTEXT
        {
            self.inside
                .insert((p.key.clone(), key.clone()), src[end..p.end].to_vec());
        }
        if !left.is_empty() {
            // Relations to the previous location and to this key's own previous one.
            let prev = self.located.last().cloned();
            for p in prev.iter().chain(own.first().copied()) {
                if p.end <= start
                    && let Some(n) = count_to(src, p.end, &left, start)
                {
                    self.relations
                        .insert((p.key.clone(), key.clone()), (left.clone(), n));
                }
            }
        }
        self.located.push(loc);
        // Keep the list short: the last KEEP per key.
        if self.located.len() > 64 {
            let mut seen: HashMap<Vec<u8>, usize> = HashMap::new();
            let mut keep: Vec<Located> = Vec::new();
            for l in self.located.iter().rev() {
                let c = seen.entry(l.key.clone()).or_default();
                if *c < KEEP {
                    *c += 1;
                    keep.push(l.clone());
                }
            }
            keep.reverse();
            self.located = keep;
        }
    }
}

/// The left context of a value at `start`: with earlier locations of the key, the bytes
/// before all of them in common (at most [`MAX_CONTEXT`]); with none, the line up to it
/// when other lines start alike (`\nEmail: `, `\n<tr><td>`), else the run of non-value
/// bytes just before it. Empty when there is none.
///
/// A first location's line prefix counts only from `floor` on (the end of the value
/// before it: a prefix holding another value, `- 2 x `, is no layout); `None`: only the
/// delimiters (the next field of a first record is on the same line).
fn left_context(src: &[u8], start: usize, own: &[&Located], floor: Option<usize>) -> Vec<u8> {
    let before = |s: usize| &src[s.saturating_sub(MAX_CONTEXT)..s];
    let mine = before(start);
    let mut n = if own.is_empty() {
        // The line up to the value when other lines start alike (`\nEmail: `,
        // `\n<tr><td>`), else the delimiters just before it.
        let line = mine
            .iter()
            .rposition(|&b| b == b'\n')
            .map(|p| mine.len() - p)
            .filter(|&n| {
                floor.is_some_and(|f| start - n >= f) && {
                    let pat = &mine[mine.len() - n..];
                    src.windows(n).filter(|w| *w == pat).take(2).count() == 2
                }
            });
        line.unwrap_or_else(|| {
            mine.iter()
                .rev()
                .take_while(|&&b| !is_value_byte(b) && b != SPECIAL)
                .count()
                .min(8)
        })
    } else {
        own.iter()
            .map(|l| {
                let other = before(l.start);
                mine.iter()
                    .rev()
                    .zip(other.iter().rev())
                    .take_while(|(a, b)| a == b)
                    .count()
            })
            .min()
            .unwrap_or(0)
    };
    if let Some(p) = mine[mine.len() - n..].iter().rposition(|&b| b == SPECIAL) {
        n -= p + 1;
    }
    // Never from the middle of a word (`m\n` of two values ending alike).
    let c = &mine[mine.len() - n..];
    if n < mine.len() && is_value_byte(mine[mine.len() - n - 1]) {
        n -= c.iter().take_while(|&&b| is_value_byte(b)).count();
    }
    mine[mine.len() - n..].to_vec()
}

/// The right context of a value ending at `end` (as [`left_context`], after the value).
fn right_context(src: &[u8], end: usize, own: &[&Located]) -> Vec<u8> {
    let after = |e: usize| &src[e..(e + MAX_CONTEXT).min(src.len())];
    let mine = after(end);
    let n = if own.len() < 2 {
        mine.iter()
            .take_while(|&&b| !is_value_byte(b) && b != SPECIAL)
            .count()
            .clamp(usize::from(!mine.is_empty()), 8)
    } else {
        own.iter()
            .filter(|l| l.end != end)
            .map(|l| {
                mine.iter()
                    .zip(after(l.end))
                    .take_while(|(a, b)| a == b)
                    .count()
            })
            .min()
            .unwrap_or(0)
    };
    let mut n = n.min(mine.len());
    // Never into the middle of a word (`\nEmail: a` of two values followed alike).
    if n < mine.len() && is_value_byte(mine[n]) {
        n -= mine[..n]
            .iter()
            .rev()
            .take_while(|&&b| is_value_byte(b))
            .count();
    }
    mine[..n].to_vec()
}

/// Where the value of a field starting at `q` starts: after its opening quote when the
/// field is quoted.
fn unquoted(src: &[u8], q: usize) -> usize {
    if src.get(q) == Some(&b'"') { q + 1 } else { q }
}

/// How many occurrences of `left` end in `(from, to]`, if one ends exactly at `to`.
fn count_to(src: &[u8], from: usize, left: &[u8], to: usize) -> Option<usize> {
    if !src[..to].ends_with(left) {
        return None;
    }
    Some(
        (from + 1..=to)
            .filter(|&q| q >= left.len() && src[q - left.len()..q] == *left)
            .count(),
    )
}

/// The position just after the `n`-th occurrence of `left` ending after `from`.
fn nth_after(src: &[u8], from: usize, left: &[u8], n: usize) -> Option<usize> {
    if left.is_empty() || n == 0 {
        return None;
    }
    let mut seen = 0;
    for q in from + 1..=src.len() {
        if q >= left.len() && src[q - left.len()..q] == *left {
            seen += 1;
            if seen == n {
                return Some(q);
            }
        }
    }
    None
}

/// The first occurrence of `v` in `src` from `from` on that stands on its own: a number
/// not inside a longer number, other text not inside a word.
fn find_bounded(src: &[u8], from: usize, v: &[u8]) -> Option<usize> {
    let numeric = v
        .iter()
        .all(|b| b.is_ascii_digit() || matches!(b, b'.' | b'-'));
    let inner = |b: u8| {
        if numeric {
            b.is_ascii_digit()
        } else {
            is_value_byte(b)
        }
    };
    let mut at = from;
    while let Some(p) = find(&src[at.min(src.len())..], v) {
        let q = at + p;
        let before = q.checked_sub(1).map(|i| src[i]);
        let after = src.get(q + v.len()).copied();
        let decimal = numeric
            && after == Some(b'.')
            && src.get(q + v.len() + 1).is_some_and(|b| b.is_ascii_digit());
        if !before.is_some_and(inner) && !after.is_some_and(inner) && !decimal {
            return Some(q);
        }
        at = q + 1;
    }
    None
}

/// The number at `q` (digits, one `.`, a leading `-`; `,` only as a thousands
/// separator, dropped): its end and its plain text.
fn number_at(src: &[u8], q: usize) -> Option<(usize, Vec<u8>)> {
    let mut out = Vec::new();
    let mut i = q;
    let mut dot = false;
    while let Some(&b) = src.get(i) {
        let digits_after = |n: usize| {
            (1..=n).all(|k| src.get(i + k).is_some_and(u8::is_ascii_digit))
                && !src.get(i + n + 1).is_some_and(u8::is_ascii_digit)
        };
        if b.is_ascii_digit() || (b == b'-' && i == q) {
            out.push(b);
        } else if b == b'.' && !dot && src.get(i + 1).is_some_and(u8::is_ascii_digit) {
            dot = true;
            out.push(b);
        } else if b == b',' && !dot && !out.is_empty() && digits_after(3) {
            // A thousands separator.
        } else {
            break;
        }
        i += 1;
    }
    out.iter().any(u8::is_ascii_digit).then_some((i, out))
}

/// A number in `src` from `from` on (not inside a longer number) whose plain text is
/// `v` while the prompt writes it otherwise (`$1,234.50` for `1234.50`): its span.
fn find_number(src: &[u8], from: usize, v: &[u8]) -> Option<(usize, usize)> {
    if v.is_empty() || !v.iter().all(|&b| is_number_byte(b)) {
        return None;
    }
    (from..src.len())
        .filter(|&q| src[q].is_ascii_digit() && (q == 0 || !is_number_byte(src[q - 1])))
        .find_map(|q| {
            let (e, digits) = number_at(src, q)?;
            (digits == v).then_some((q, e))
        })
}

/// Month names, for dates written with them.
const MONTHS: [&str; 12] = [
    "january",
    "february",
    "march",
    "april",
    "may",
    "june",
    "july",
    "august",
    "september",
    "october",
    "november",
    "december",
];

/// The words of a date in the prompt from `q` on (up to `n`, on one line, apart by at
/// most 3 delimiters): each word's number (a month name's number) and the span's end.
fn date_words(src: &[u8], q: usize, n: usize) -> Option<(Vec<u64>, usize)> {
    let mut vals = Vec::new();
    let mut i = q;
    while vals.len() < n {
        if vals.is_empty() {
            if !src.get(i)?.is_ascii_alphanumeric() {
                return None;
            }
        } else {
            let gap = src[i..]
                .iter()
                .take_while(|b| !b.is_ascii_alphanumeric() && **b != b'\n' && **b != SPECIAL)
                .count();
            if gap == 0 || gap > 3 {
                return None;
            }
            i += gap;
        }
        let w = src[i..]
            .iter()
            .take_while(|b| b.is_ascii_alphanumeric())
            .count();
        let word = &src[i..i + w];
        let val = if word.iter().all(u8::is_ascii_digit) && w <= 4 {
            std::str::from_utf8(word).ok()?.parse().ok()?
        } else {
            let lower = word.to_ascii_lowercase();
            let m = MONTHS
                .iter()
                .position(|m| lower.len() >= 3 && m.as_bytes().starts_with(&lower))?;
            m as u64 + 1
        };
        vals.push(val);
        i += w;
    }
    Some((vals, i))
}

/// An output date's number groups (value, width) and the separators around them.
type DateParts = (Vec<(u64, usize)>, Vec<Vec<u8>>);

/// A value re-formatted from prompt words (a date: `3 March 2024` → `2024-03-03`): each
/// number group of the output is one of the words, zero-padded to a width, between
/// fixed separators.
#[derive(Clone, Debug, PartialEq, Eq)]
struct DateFormat {
    /// Per output group: (the word it comes from, its width).
    groups: Vec<(usize, usize)>,
    /// The text before each group and after the last one.
    seps: Vec<Vec<u8>>,
}

impl DateFormat {
    /// The output `v` split into digit groups and separators (2 to 3 groups, no letters).
    fn parse(v: &[u8]) -> Option<DateParts> {
        if v.iter().any(u8::is_ascii_alphabetic) || v.len() > 32 {
            return None;
        }
        let mut groups = Vec::new();
        let mut seps = vec![Vec::new()];
        let mut i = 0;
        while i < v.len() {
            if v[i].is_ascii_digit() {
                let w = v[i..].iter().take_while(|b| b.is_ascii_digit()).count();
                let n = std::str::from_utf8(&v[i..i + w]).ok()?.parse().ok()?;
                groups.push((n, w));
                seps.push(Vec::new());
                i += w;
            } else {
                seps.last_mut()?.push(v[i]);
                i += 1;
            }
        }
        (2..=3).contains(&groups.len()).then_some((groups, seps))
    }

    /// Where `v` is written otherwise in `src`: at the predicted place `at`, else the
    /// first place after `after`; the span and the templates that explain it (a month
    /// name's group first).
    fn find(
        src: &[u8],
        at: Option<usize>,
        after: usize,
        v: &[u8],
    ) -> Option<(usize, usize, Vec<DateFormat>)> {
        let (groups, seps) = DateFormat::parse(v)?;
        let n = groups.len();
        let try_at = |q: usize| -> Option<(usize, usize, Vec<DateFormat>)> {
            let (vals, end) = date_words(src, q, n)?;
            let mut out = Vec::new();
            for perm in permutations(n) {
                if perm.iter().zip(&groups).all(|(&w, &(g, _))| vals[w] == g) {
                    out.push(DateFormat {
                        groups: perm
                            .iter()
                            .zip(&groups)
                            .map(|(&w, &(_, wd))| (w, wd))
                            .collect(),
                        seps: seps.clone(),
                    });
                }
            }
            // A word that is a month name most likely fills the middle group.
            let month_word = (0..n).find(|&k| word_is_month(src, q, k));
            if let Some(m) = month_word {
                out.sort_by_key(|f| usize::from(f.groups.get(1).map(|g| g.0) != Some(m)));
            }
            (!out.is_empty()).then_some((q, end, out))
        };
        if let Some(q) = at
            && let Some(found) = try_at(q)
        {
            return Some(found);
        }
        let hi = (after + RESYNC).min(src.len());
        (after..hi)
            .filter(|&q| {
                src[q].is_ascii_alphanumeric() && (q == 0 || !src[q - 1].is_ascii_alphanumeric())
            })
            .find_map(try_at)
    }

    /// The value the prompt's words at `q` give.
    fn apply(&self, src: &[u8], q: usize) -> Option<Vec<u8>> {
        let (vals, _) = date_words(src, q, self.groups.len())?;
        let mut out = self.seps[0].clone();
        for (i, &(w, width)) in self.groups.iter().enumerate() {
            out.extend(format!("{:0width$}", vals[w]).bytes());
            out.extend_from_slice(&self.seps[i + 1]);
        }
        Some(out)
    }

    /// The length of the prompt words at `q`.
    fn span(&self, src: &[u8], q: usize) -> Option<usize> {
        date_words(src, q, self.groups.len()).map(|(_, e)| e - q)
    }
}

/// Whether the `k`-th date word at `q` is a month name.
fn word_is_month(src: &[u8], q: usize, k: usize) -> bool {
    let mut i = q;
    for j in 0..=k {
        if j > 0 {
            i += src[i..]
                .iter()
                .take_while(|b| !b.is_ascii_alphanumeric())
                .count();
        }
        let w = src[i..]
            .iter()
            .take_while(|b| b.is_ascii_alphanumeric())
            .count();
        if j == k {
            return src[i..i + w].iter().any(u8::is_ascii_alphabetic);
        }
        i += w;
    }
    false
}

/// The orders of `0..n` (n ≤ 3).
fn permutations(n: usize) -> Vec<Vec<usize>> {
    match n {
        2 => vec![vec![0, 1], vec![1, 0]],
        3 => vec![
            vec![0, 1, 2],
            vec![0, 2, 1],
            vec![1, 0, 2],
            vec![1, 2, 0],
            vec![2, 0, 1],
            vec![2, 1, 0],
        ],
        _ => vec![(0..n).collect()],
    }
}

/// A first record's number: the first number in `src` from `from` on (within
/// [`RESYNC`] bytes) that stands on its own (not inside a word or a longer number, not
/// followed by a letter: `1kg` is a product's name) and whose plain text starts with
/// `done`; its plain text (thousands separators dropped).
fn first_number(src: &[u8], from: usize, done: &[u8]) -> Option<Vec<u8>> {
    let hi = (from.saturating_add(RESYNC)).min(src.len());
    (from..hi)
        .filter(|&q| {
            let b = src[q];
            (b.is_ascii_digit() || (b == b'-' && src.get(q + 1).is_some_and(u8::is_ascii_digit)))
                && (q == 0 || !(is_value_byte(src[q - 1]) || is_number_byte(src[q - 1])))
        })
        .find_map(|q| {
            let (e, digits) = number_at(src, q)?;
            let alone = src.get(e).is_none_or(|&b| !b.is_ascii_alphabetic());
            (alone && digits.starts_with(done)).then_some(digits)
        })
}

/// The date format the request asks for (`dates as YYYY-MM-DD`, `DD/MM/YYYY`): per
/// output group, which part (`b'Y'`, `b'M'`, `b'D'`) and its width, and the separators
/// between them; ISO 8601 (`YYYY-MM-DD`) when the request names none.
fn requested_date_format(src: &[u8]) -> (Vec<(u8, usize)>, Vec<Vec<u8>>) {
    let iso = || {
        (
            vec![(b'Y', 4), (b'M', 2), (b'D', 2)],
            vec![Vec::new(), b"-".to_vec(), b"-".to_vec(), Vec::new()],
        )
    };
    let upper = src.to_ascii_uppercase();
    let Some(at) = find(&upper, b"YYYY") else {
        return iso();
    };
    let part = |b: u8| matches!(b, b'Y' | b'M' | b'D');
    let sep = |b: u8| matches!(b, b'-' | b'/' | b'.');
    let mut lo = at;
    while lo > 0 && (part(upper[lo - 1]) || sep(upper[lo - 1])) {
        lo -= 1;
    }
    let mut hi = at;
    while hi < upper.len() && (part(upper[hi]) || sep(upper[hi])) {
        hi += 1;
    }
    let spec = &upper[lo..hi];
    let mut groups: Vec<(u8, usize)> = Vec::new();
    let mut seps = vec![Vec::new()];
    for &b in spec {
        if part(b) {
            match groups.last_mut() {
                Some((p, w)) if *p == b && seps.last().is_some_and(Vec::is_empty) => *w += 1,
                _ => {
                    groups.push((b, 1));
                    seps.push(Vec::new());
                }
            }
        } else if let Some(s) = seps.last_mut() {
            s.push(b);
        }
    }
    // Punctuation after the format (`YYYY-MM-DD.`) is the sentence's.
    if let Some(last) = seps.last_mut() {
        last.clear();
    }
    let mut parts: Vec<u8> = groups.iter().map(|g| g.0).collect();
    parts.sort_unstable();
    if parts != b"DMY" || seps.first().is_some_and(|s| !s.is_empty()) {
        return iso();
    }
    (groups, seps)
}

/// A first record's date: the first date in `src` from `from` on (within [`RESYNC`]
/// bytes) written in words (`3 March 2024`, `March 3, 2024`: a month name and a 4-digit
/// year), in the format the request asks for ([`requested_date_format`]).
fn first_date(src: &[u8], from: usize) -> Option<Vec<u8>> {
    let hi = (from.saturating_add(RESYNC)).min(src.len());
    let (year, month, day) = (from..hi)
        .filter(|&q| {
            src[q].is_ascii_alphanumeric() && (q == 0 || !src[q - 1].is_ascii_alphanumeric())
        })
        .find_map(|q| {
            let (vals, _) = date_words(src, q, 3)?;
            let m = (0..3).find(|&k| word_is_month(src, q, k))?;
            let y = (0..3).find(|&k| k != m && (1000..=9999).contains(&vals[k]))?;
            let d = (0..3).find(|&k| k != m && k != y)?;
            (1..=31)
                .contains(&vals[d])
                .then_some((vals[y], vals[m], vals[d]))
        })?;
    let (groups, seps) = requested_date_format(src);
    let mut out = seps[0].clone();
    for (i, &(p, w)) in groups.iter().enumerate() {
        let v = match p {
            b'Y' => year,
            b'M' => month,
            _ => day,
        };
        out.extend(format!("{v:0w$}").bytes());
        out.extend_from_slice(&seps[i + 1]);
    }
    Some(out)
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || needle.len() > hay.len() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Drafts JSON values from the prompt text by the record layout: see the module docs.
#[derive(Clone, Debug)]
pub struct PromptTextDrafter {
    tok: Arc<Tokenizer>,
    /// The prompt as bytes (special tokens as [`SPECIAL`]); built on first use.
    src: Vec<u8>,
    built: bool,
    /// The scanner after the committed output.
    state: State,
    /// Committed tokens folded into `state`.
    seen: usize,
}

impl PromptTextDrafter {
    /// A drafter decoding the prompt and re-encoding values with `tok`.
    pub fn new(tok: Arc<Tokenizer>) -> PromptTextDrafter {
        PromptTextDrafter {
            tok,
            src: Vec::new(),
            built: false,
            state: State::default(),
            seen: 0,
        }
    }

    fn bytes(&self, t: u32) -> &[u8] {
        if self.tok.is_special(t) {
            return &[];
        }
        self.tok.token_bytes(t).unwrap_or(&[])
    }

    fn ensure_prompt(&mut self, tokens: &[u32], prompt_len: usize) {
        if self.built {
            return;
        }
        let n = prompt_len.min(tokens.len());
        for &t in &tokens[..n] {
            if self.tok.is_special(t) {
                self.src.push(SPECIAL);
            } else if let Some(b) = self.tok.token_bytes(t) {
                self.src.extend_from_slice(b);
            }
        }
        self.built = true;
        self.seen = n;
    }

    fn advance(&self, st: &mut State, tokens: &[u32]) {
        for &t in tokens {
            for &b in self.bytes(t) {
                st.feed(&self.src, b);
            }
        }
    }

    /// The text the value being written continues with, from the prompt: `None` when
    /// there is no prediction; empty when the value written so far is the whole
    /// predicted value.
    fn predict_text(&self, st: &State) -> Option<Vec<u8>> {
        let key = st.key();
        let writing = st.in_string && !st.string_is_key;
        let at_value = !st.in_string
            && !st.in_number
            && !st.in_literal
            && !st.expect_key
            && st.stack.last().is_some_and(|f| f.object);
        if !(writing || st.in_number || st.in_literal || at_value) || st.escape {
            return None;
        }
        if st.located.is_empty() && (writing || st.in_number) {
            return self.first_value(&st.buf);
        }
        if st.in_number
            && !st.written.contains(&key)
            && let Some(last) = st.located.last()
        {
            // A first record's number: the next one in the prompt.
            let digits = first_number(&self.src, last.end, &st.buf)?;
            return digits.strip_prefix(st.buf.as_slice()).map(<[u8]>::to_vec);
        }
        let (field, from) = st.predict(&self.src, &key)?;
        let src = &self.src;
        let q = unquoted(src, field);
        let quoted = q > field;
        let done = &st.buf;
        if st.in_number || (at_value && st.numeric.contains(&key)) {
            // The number there, thousands separators dropped (`1,234.50` → `1234.50`).
            let (_, digits) = number_at(src, q)?;
            let rest = digits.strip_prefix(done.as_slice())?;
            return (!rest.is_empty() || !done.is_empty()).then(|| rest.to_vec());
        }
        if let Some(formats) = st.formats.get(&key) {
            // A re-formatted value (a date): the first template that reads the prompt.
            let text = formats.iter().find_map(|f| f.apply(src, q))?;
            let rest = text.strip_prefix(done.as_slice())?;
            return (!rest.is_empty() || !done.is_empty()).then(|| rest.to_vec());
        }
        if st.in_literal || (at_value && st.literal.contains(&key)) {
            // The literal this prompt word was written as before.
            let lit = st.mapped.get(&(key, word_at(src, q).to_vec()))?;
            return lit.strip_prefix(done.as_slice()).map(<[u8]>::to_vec);
        }
        let start = if src[q..].starts_with(done) {
            q + done.len()
        } else if done.len() >= 3 {
            let hi = (from + RESYNC).min(src.len());
            from + find(&src[from..hi], done)? + done.len()
        } else {
            return None;
        };
        let mut own: Vec<&Located> = st
            .located
            .iter()
            .rev()
            .filter(|l| l.key == key)
            .take(KEEP)
            .collect();
        let first = own.is_empty();
        if own.is_empty()
            && let Some(last) = st.located.last()
        {
            // The first record: the right context of the value before it.
            own.push(last);
        }
        let right = match own.first() {
            Some(l) => right_context(src, l.end, &own),
            None => return None,
        };
        let hi = (start + MAX_VALUE).min(src.len());
        let window = &src[start..hi];
        // The right context, else its first byte (the last record), else the text's end.
        // A quoted field ends at its closing quote.
        let right = if quoted { b"\"".to_vec() } else { right };
        let end = start
            + right
                .first()
                .and_then(|&b0| find(window, &right).or_else(|| find(window, &[b0])))
                .or_else(|| window.iter().position(|&b| b == SPECIAL))
                .unwrap_or(window.len());
        // A first record's unquoted value ends no later than a delimiter that unquoted
        // values do not hold (`Maria Rossi, maria@…`).
        let in_quotes = quoted || (q > 0 && src[q - 1] == b'"');
        let end = if first && !in_quotes {
            src[start..end]
                .iter()
                .position(|b| b",;)\n\t|<".contains(b))
                .map_or(end, |p| start + p)
        } else {
            end
        };
        let text = &src[start..end];
        if text.contains(&SPECIAL) || (text.is_empty() && done.is_empty()) {
            return None;
        }
        Some(text.to_vec())
    }

    /// `text` as the model would write it: re-encoded on its own (a cut inside a
    /// character leaves the valid part).
    fn encode(&self, text: &[u8]) -> Vec<u32> {
        let text = match std::str::from_utf8(text) {
            Ok(t) => t,
            Err(e) => std::str::from_utf8(&text[..e.valid_up_to()]).unwrap_or_default(),
        };
        if text.is_empty() {
            return Vec::new();
        }
        self.tok.encode(text, EncodeOptions::plain_text())
    }

    /// Drafts `tokens` while the mirror takes them and `out` holds fewer than `k`;
    /// returns how many it took.
    fn push(
        &self,
        tokens: &[u32],
        k: usize,
        mirror: &mut Mirror<'_>,
        out: &mut DraftProposal,
    ) -> usize {
        let mut n = 0;
        for &t in tokens {
            if out.tokens.len() >= k || !mirror.try_push(t) {
                break;
            }
            out.tokens.push(t);
            n += 1;
        }
        n
    }

    /// The rest of the output's first value (nothing located yet) once it has begun:
    /// the first word of the request's text (the longest part of the prompt between
    /// special tokens, after the instructions) that starts with what was written, up to
    /// a space or a delimiter.
    fn first_value(&self, done: &[u8]) -> Option<Vec<u8>> {
        if done.is_empty() {
            return None;
        }
        let src = &self.src;
        let mut lo = 0;
        let mut best = (0, 0);
        for (i, &b) in src
            .iter()
            .enumerate()
            .chain(std::iter::once((src.len(), &SPECIAL)))
        {
            if b == SPECIAL {
                if i - lo > best.1 - best.0 {
                    best = (lo, i);
                }
                lo = i + 1;
            }
        }
        let (lo, hi) = best;
        let at = (lo..hi)
            .find(|&q| src[q..hi].starts_with(done) && (q == lo || !is_value_byte(src[q - 1])))?;
        let start = at + done.len();
        let n = src[start..hi]
            .iter()
            .take_while(|&&b| is_value_byte(b) || b"-:./@+_".contains(&b))
            .count();
        (n > 0).then(|| src[start..start + n].to_vec())
    }

    /// Whether a predicted value of `key` ends where predicted: a number, a mapped value,
    /// a key located before, or (a first record) a delimiter after the value before that
    /// is more than a space.
    fn sure_end(&self, st: &State, key: &[u8]) -> bool {
        st.in_number
            || st.numeric.contains(key)
            || st.literal.contains(key)
            || st.formats.contains_key(key)
            || st.located.iter().any(|l| l.key == key)
            || st.located.last().is_some_and(|l| {
                right_context(&self.src, l.end, &[l])
                    .iter()
                    .any(|&b| b != b' ')
            })
    }

    /// Texts the output may go on with where the prompt text predicts nothing (more), most
    /// likely first, for the grammar mirror to choose among: a first record's syntax by
    /// the layout the output showed (after a key: its colon and a string, an object, an
    /// array of objects, or a number; after a value: the next member, else closings;
    /// after an opening: the first member), the end of a value written whole, and a first
    /// record's date in the requested format.
    fn fallbacks(&self, st: &State) -> Vec<Vec<u8>> {
        if st.stack.is_empty() || st.escape {
            return Vec::new();
        }
        let src = &self.src;
        let from = st.located.last().map_or(0, |l| l.end);
        let joined = |head: &[u8], tails: Vec<Vec<u8>>| -> Vec<Vec<u8>> {
            tails
                .into_iter()
                .map(|t| [head, t.as_slice()].concat())
                .collect()
        };
        let rest = |done: &[u8], all: Vec<Vec<u8>>| -> Vec<Vec<u8>> {
            all.into_iter()
                .filter_map(|v| {
                    v.strip_prefix(done)
                        .filter(|r| !r.is_empty())
                        .map(<[u8]>::to_vec)
                })
                .collect()
        };
        // After a key's closing quote: its colon and the value's opening.
        let after_key = || -> Vec<Vec<u8>> {
            let Some(colon) = st.colon() else {
                return Vec::new();
            };
            let mut all = joined(&colon, st.value_opens());
            if let Some(n) = first_number(src, from, b"") {
                all.push([colon.as_slice(), &n].concat());
            }
            all.push(colon);
            all
        };
        if st.in_string && st.string_is_key {
            // The key's end (the grammar refuses it before the key is whole).
            if st.buf.is_empty() {
                return Vec::new();
            }
            return joined(b"\"", after_key());
        }
        if let Some(p) = &st.post_buf {
            return rest(p, after_key());
        }
        let whole =
            || self.predict_text(st).is_some_and(|t| t.is_empty()) && self.sure_end(st, &st.key());
        if st.in_string {
            let mut all = Vec::new();
            if whole() {
                all = joined(b"\"", st.after_value());
            }
            if !st.written.contains(&st.key())
                && let Some(date) = first_date(src, from)
            {
                all.extend(rest(&st.buf, vec![date]));
            }
            return all;
        }
        if st.in_number || st.in_literal {
            return if whole() {
                st.after_value()
            } else {
                Vec::new()
            };
        }
        let d = st.stack.len();
        let object = st.stack.last().is_some_and(|f| f.object);
        let first = |after_comma: bool| -> Vec<Vec<u8>> {
            let Some(nl) = st.newline(d, after_comma) else {
                return Vec::new();
            };
            let open = if object {
                Some(b"\"".to_vec())
            } else {
                st.open_object(d)
            };
            open.map(|o| vec![[nl.as_slice(), &o].concat()])
                .unwrap_or_default()
        };
        let all = match st.last_sig {
            b'[' | b'{' => first(false),
            b',' => first(true),
            b':' => Vec::new(),
            _ => st.after_value(),
        };
        rest(&st.ws, all)
    }

    /// The text the output continues with: the rest of the value being written (from
    /// the prompt), the syntax after it up to the next value (the gap its key path was
    /// followed by last time), the next value, and so on, while both are predicted.
    /// `st` is advanced over the text.
    fn draft_text(&self, st: &mut State) -> Vec<u8> {
        let mut text = Vec::new();
        let push = |st: &mut State, part: &[u8], text: &mut Vec<u8>| {
            for &b in part {
                st.feed(&self.src, b);
            }
            text.extend_from_slice(part);
        };
        for _ in 0..MAX_PARTS {
            let before = text.len();
            // Between two values: the rest of the gap.
            if let Some(g) = &st.gap {
                let rest = st
                    .gaps
                    .get(&g.after)
                    .and_then(|full| full.strip_prefix(g.bytes.as_slice()))
                    .map(<[u8]>::to_vec)
                    // An unknown gap: from its key on, what follows keys.
                    .or_else(|| st.post_rest());
                let Some(rest) = rest else {
                    // Before the key: the separator, for the grammar to force the key.
                    if let Some(sep) = st.sep_rest() {
                        push(st, &sep, &mut text);
                    }
                    break;
                };
                push(st, &rest, &mut text);
            }
            let Some(value) = self.predict_text(st) else {
                break;
            };
            let key = st.key();
            // Whether the value ends where predicted: a number, a mapped value, a key
            // located before, or (a first record) a delimiter after the value before
            // that is more than a space.
            let sure_end = self.sure_end(st, &key);
            push(st, &value, &mut text);
            let Some(gap) = st.gaps.get(&st.key()).cloned() else {
                // No gap learned after this key yet (a first record): the value ends
                // there and the separator at this depth follows, for the grammar to
                // force the next key.
                if sure_end && let Some(sep) = st.seps.get(&st.stack.len()).cloned() {
                    let mut rest = Vec::new();
                    if st.in_string {
                        rest.push(b'"');
                    }
                    rest.extend_from_slice(&sep);
                    rest.push(b'"');
                    push(st, &rest, &mut text);
                }
                break;
            };
            push(st, &gap, &mut text);
            if text.len() == before || text.len() >= MAX_TEXT {
                break;
            }
        }
        text
    }
}

impl Drafter for PromptTextDrafter {
    fn kind(&self) -> DrafterKind {
        DrafterKind::PromptText
    }

    fn propose(&mut self, ctx: &DraftContext<'_>, mirror: &mut Mirror<'_>) -> DraftProposal {
        let mut out = DraftProposal::default();
        let k = ctx.max_draft.min(ctx.max_tokens);
        if k == 0 || !mirror.is_constrained() || mirror.is_stopped() || self.tok.add_space_prefix()
        {
            return out;
        }
        self.ensure_prompt(ctx.tokens, ctx.prompt_len);
        let mut st = self.state.clone();
        self.advance(&mut st, &ctx.tokens[self.seen.min(ctx.tokens.len())..]);
        for round in 0..MAX_PARTS {
            // A key just opened: the grammar forces it (the chain drafts the forced tokens,
            // then asks again).
            if round > 0 && st.in_string && st.string_is_key && st.buf.is_empty() {
                break;
            }
            let before = out.tokens.len();
            // What the prompt text predicts; where the mirror refuses a token, the state
            // goes back to the tokens it took.
            let base = st.clone();
            let text = self.draft_text(&mut st);
            let tokens = self.encode(&text);
            let took = self.push(&tokens, k, mirror, &mut out);
            if took < tokens.len() {
                st = base;
                self.advance(&mut st, &out.tokens[before..]);
            }
            if out.tokens.len() >= k || mirror.is_stopped() {
                break;
            }
            // Then the likeliest way on the grammar allows whole, else the one it allows
            // furthest.
            let mut best: Option<(Vec<u32>, usize)> = None;
            for c in self.fallbacks(&st) {
                let tokens = self.encode(&c);
                let n = mirror.accepted_prefix(&tokens);
                if n == tokens.len() && n > 0 {
                    best = Some((tokens, n));
                    break;
                }
                if n > best.as_ref().map_or(0, |b| b.1) {
                    best = Some((tokens, n));
                }
            }
            let from = out.tokens.len();
            if let Some((tokens, n)) = best {
                self.push(&tokens[..n], k, mirror, &mut out);
                self.advance(&mut st, &out.tokens[from..]);
            }
            if out.tokens.len() == before || out.tokens.len() >= k || mirror.is_stopped() {
                break;
            }
        }
        if !out.tokens.is_empty() {
            out.source = Some(DrafterKind::PromptText);
        }
        out
    }

    fn observe(&mut self, committed: &[u32]) {
        if !self.built {
            return;
        }
        let from = self.seen.min(committed.len());
        let mut st = std::mem::take(&mut self.state);
        self.advance(&mut st, &committed[from..]);
        self.state = st;
        self.seen = committed.len().max(self.seen);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sampling::{SamplingParams, TokenMask};

    /// A byte-level tokenizer (one token per byte), so text and tokens map one to one;
    /// byte 0 is a control token (it stands for the chat template's markers).
    fn tokenizer() -> Arc<Tokenizer> {
        let printable = |b: u8| matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
        let tokens: Vec<String> = (0..=255u8)
            .map(|b| {
                if printable(b) {
                    char::from(b).to_string()
                } else {
                    let k = (0..b).filter(|&x| !printable(x)).count() as u32;
                    char::from_u32(256 + k).expect("valid").to_string()
                }
            })
            .collect();
        let types: Vec<i32> = (0..256).map(|i| if i == 0 { 3 } else { 1 }).collect();
        Arc::new(
            Tokenizer::from_spec(&text::VocabSpec {
                model: "gpt2",
                pre: "qwen2",
                tokens: &tokens,
                token_types: &types,
                merges: &[],
                ..text::VocabSpec::default()
            })
            .expect("tokenizer"),
        )
    }

    /// A constraint that allows everything but counts as a grammar (the drafter only
    /// works under one).
    struct AnyJson;
    impl sampling::TokenConstraint for AnyJson {
        fn compute_mask(&mut self, mask: &mut TokenMask) -> Result<(), sampling::ConstraintError> {
            mask.fill_words(256, |_| u64::MAX);
            Ok(())
        }
        fn accepts(&mut self, _: u32) -> bool {
            true
        }
        fn consume(&mut self, _: u32) -> Result<(), sampling::ConstraintError> {
            Ok(())
        }
        fn rollback(&mut self, _: usize) -> Result<(), sampling::ConstraintError> {
            Ok(())
        }
        fn fork(&self) -> Box<dyn sampling::TokenConstraint> {
            Box::new(AnyJson)
        }
        fn is_finished(&self) -> bool {
            false
        }
    }

    /// A constraint that refuses some bytes (the byte tokenizer's ids) and allows the rest:
    /// a stand-in for a grammar that, say, closes an object here (no `,`) or wants a
    /// number (no `"`).
    struct Refuse(&'static [u8]);
    impl sampling::TokenConstraint for Refuse {
        fn compute_mask(&mut self, mask: &mut TokenMask) -> Result<(), sampling::ConstraintError> {
            mask.fill_words(256, |_| u64::MAX);
            Ok(())
        }
        fn accepts(&mut self, t: u32) -> bool {
            !self.0.iter().any(|&b| u32::from(b) == t)
        }
        fn consume(&mut self, t: u32) -> Result<(), sampling::ConstraintError> {
            if self.accepts(t) {
                Ok(())
            } else {
                Err(sampling::ConstraintError::TokenRejected {
                    token: t,
                    text: String::new(),
                    position: 0,
                })
            }
        }
        fn rollback(&mut self, _: usize) -> Result<(), sampling::ConstraintError> {
            Ok(())
        }
        fn fork(&self) -> Box<dyn sampling::TokenConstraint> {
            Box::new(Refuse(self.0))
        }
        fn is_finished(&self) -> bool {
            false
        }
    }

    /// The draft under a constraint that refuses `refused`.
    fn draft_refusing(
        d: &mut PromptTextDrafter,
        tokens: &[u32],
        prompt_len: usize,
        refused: &'static [u8],
    ) -> String {
        draft_under(d, tokens, prompt_len, &mut Refuse(refused))
    }

    fn draft(d: &mut PromptTextDrafter, tokens: &[u32], prompt_len: usize) -> String {
        draft_under(d, tokens, prompt_len, &mut AnyJson)
    }

    /// The draft (as text) of `d` after `tokens` under the constraint `g`.
    fn draft_under(
        d: &mut PromptTextDrafter,
        tokens: &[u32],
        prompt_len: usize,
        g: &mut dyn sampling::TokenConstraint,
    ) -> String {
        let params = SamplingParams::greedy();
        let never = TokenMask::new(256);
        let ctx = DraftContext {
            tokens,
            prompt_len,
            params: &params,
            never: &never,
            max_tokens: 64,
            max_draft: 64,
            kind_caps: &[],
            allow_costly: true,
            bars: &[],
            eos_ends: false,
            eos: &[],
            target: None,
        };
        let mut m = Mirror::new(g, 256);
        let p = d.propose(&ctx, &mut m);
        let b: Vec<u8> = p.tokens.iter().map(|&t| t as u8).collect();
        String::from_utf8_lossy(&b).into_owned()
    }

    /// A draft's first value: the text up to its closing quote.
    fn value(draft: &str) -> &str {
        draft.split('"').next().unwrap_or_default()
    }

    fn enc(tok: &Tokenizer, s: &str) -> Vec<u32> {
        tok.encode(s, EncodeOptions::plain_text())
    }

    const CSV: &str = "name,city,email\nAda Lovelace,London,ada@example.com\n\
                       Alan Turing,Wilmslow,alan@example.org\n\
                       Grace Hopper,Arlington,grace@example.net\n";

    #[test]
    fn predicts_the_next_records_value_of_a_csv_to_json_extraction() {
        let tok = tokenizer();
        let prompt = enc(&tok, CSV);
        let mut d = PromptTextDrafter::new(tok.clone());
        let mut toks = prompt.clone();
        // The first record is written by the target: the layout is learned from it.
        toks.extend(enc(
            &tok,
            "[{\"name\":\"Ada Lovelace\",\"city\":\"London\",\"email\":\"ada@example.com\"},",
        ));
        d.observe(&toks);
        // The second record's name: after the previous email, one line further.
        toks.extend(enc(&tok, "{\"name\":\""));
        // One location per key: the left context is the run of delimiters before it
        // (`\n` for the name), counted once from the previous value.
        assert_eq!(value(&draft(&mut d, &toks, prompt.len())), "Alan Turing");
        toks.extend(enc(&tok, "Alan Turing\",\"city\":\""));
        assert_eq!(value(&draft(&mut d, &toks, prompt.len())), "Wilmslow");
        toks.extend(enc(&tok, "Wilmslow\",\"email\":\""));
        d.observe(&toks);
        assert_eq!(
            value(&draft(&mut d, &toks, prompt.len())),
            "alan@example.org"
        );
        // Partly written: the rest of the value.
        toks.extend(enc(&tok, "alan@"));
        assert_eq!(value(&draft(&mut d, &toks, prompt.len())), "example.org");
        toks.extend(enc(&tok, "example.org\"},{\"name\":\""));
        d.observe(&toks);
        assert_eq!(value(&draft(&mut d, &toks, prompt.len())), "Grace Hopper");
    }

    #[test]
    fn drafts_whole_records_values_and_syntax_between_them() {
        // Pretty-printed output: after one record the gaps (closing quote, `,\n`, the
        // indentation, the next key, its opening quote) are known per key, so a draft
        // runs through the next record's fields.
        let tok = tokenizer();
        let prompt = enc(&tok, CSV);
        let mut d = PromptTextDrafter::new(tok.clone());
        let mut toks = prompt.clone();
        toks.extend(enc(
            &tok,
            "[\n  {\n    \"name\": \"Ada Lovelace\",\n    \"city\": \"London\",\n    \
             \"email\": \"ada@example.com\"\n  },\n  {\n    \"name\": \"Alan Turing\",\n",
        ));
        d.observe(&toks);
        // Mid-gap: the rest of it, the value, the next gap...
        assert_eq!(
            draft(&mut d, &toks, prompt.len()),
            "    \"city\": \"Wilmslow\",\n    \"email\": \"alan@example.org\"\n  },\n  {"
        );
        // (64 bytes: the cap.) Then the next record.
        toks.extend(enc(
            &tok,
            "    \"city\": \"Wilmslow\",\n    \"email\": \"alan@example.org\"\n  },\n  {\n",
        ));
        d.observe(&toks);
        assert_eq!(
            draft(&mut d, &toks, prompt.len()),
            "    \"name\": \"Grace Hopper\",\n    \"city\": \"Arlington\",\n    \"email\""
        );
    }

    #[test]
    fn a_quoted_csv_field_is_drafted_without_its_quotes_and_whole() {
        let tok = tokenizer();
        let text = "id,name,dept\n1,\"Okafor, Chidi\",Engineering\n\
                    2,\"van der Berg, Anneke\",\"Sales, EMEA\"\n3,\"Smith, Jo\",Support\n";
        let prompt = enc(&tok, text);
        let mut d = PromptTextDrafter::new(tok.clone());
        let mut toks = prompt.clone();
        toks.extend(enc(
            &tok,
            "[{\"id\":1,\"name\":\"Okafor, Chidi\",\"dept\":\"Engineering\"},\
             {\"id\":2,\"name\":\"van der Berg, Anneke\",\"dept\":\"",
        ));
        d.observe(&toks);
        assert_eq!(
            draft(&mut d, &toks, prompt.len()),
            "Sales, EMEA\"},{\"id\":3,\"name\":\"Smith, Jo\",\"dept\":\"Support\"},{\"id\""
        );
    }

    const ORDERS: &str = "Order A-1001 (customer: Maria Rossi, maria@example.com)\n\
                          - 2 x Espresso Beans 1kg @ 18.50\n\
                          - 1 x Milk Frother @ 34.00\n\
                          Order A-1002 (customer: Kenji Sato, kenji@example.com)\n\
                          - 3 x Green Tea 250g @ 7.25\n\
                          - 1 x Glass Teapot @ 22.90\n\
                          - 2 x Bamboo Tray @ 12.00\n";

    #[test]
    fn nested_items_follow_their_lines() {
        let tok = tokenizer();
        let prompt = enc(&tok, ORDERS);
        let mut d = PromptTextDrafter::new(tok.clone());
        let mut toks = prompt.clone();
        toks.extend(enc(
            &tok,
            "[{\"order_id\":\"A-1001\",\"customer\":{\"name\":\"Maria Rossi\",\
             \"email\":\"maria@example.com\"},\"items\":[{\"quantity\":2,\
             \"product\":\"Espresso Beans 1kg\",\"unit_price\":18.50},{\"quantity\":1,\
             \"product\":\"",
        ));
        d.observe(&toks);
        // The item on the next line (not the later `- 2 x ` line: its prefix holds a
        // value), then the next item's syntax and the line after (the drafter does not
        // know the order ends there; the target decides).
        assert_eq!(
            draft(&mut d, &toks, prompt.len()),
            "Milk Frother\",\"unit_price\":34.00},{\"quantity\":3,\"product\":\"Green"
        );
        toks.extend(enc(&tok, "Milk"));
        assert_eq!(value(&draft(&mut d, &toks, prompt.len())), " Frother");
    }

    #[test]
    fn a_literal_is_drafted_for_the_prompt_word_it_stood_for_before() {
        // An HTML table: `yes`/`no` become `true`/`false`; once `yes` was written as
        // `true`, the next `yes` row drafts `true`, and the first-record guess skips
        // `</td>` for the next cell.
        let tok = tokenizer();
        let text = "<tr><td>Mouse</td><td>24.99</td><td>yes</td></tr>\n\
                    <tr><td>Keyboard</td><td>89.00</td><td>no</td></tr>\n\
                    <tr><td>Hub</td><td>39.50</td><td>yes</td></tr>\n";
        let prompt = enc(&tok, text);
        let mut d = PromptTextDrafter::new(tok.clone());
        let mut toks = prompt.clone();
        toks.extend(enc(&tok, "[{\"p\":\"Mouse\",\"price\":2"));
        // (Then the separator before the next key, as between the first two fields.)
        assert_eq!(draft(&mut d, &toks, prompt.len()), "4.99,\"");
        toks.extend(enc(
            &tok,
            "4.99,\"ok\":true},{\"p\":\"Keyboard\",\"price\":89.00,\"ok\":false},{\"p\":\"",
        ));
        d.observe(&toks);
        assert_eq!(
            draft(&mut d, &toks, prompt.len()),
            "Hub\",\"price\":39.50,\"ok\":true},{\"p\":\""
        );
    }

    #[test]
    fn re_formatted_dates_and_numbers_are_drafted_by_the_mapping_a_record_showed() {
        let tok = tokenizer();
        let text = "Invoice INV-1 was issued on 3 March 2024 for a total of $1,234.50, due soon.\n\
                    Invoice INV-2 was issued on 17 April 2024 for a total of $12,000.00, due soon.\n";
        let prompt = enc(&tok, text);
        let mut d = PromptTextDrafter::new(tok.clone());
        let mut toks = prompt.clone();
        toks.extend(enc(
            &tok,
            "[{\"id\":\"INV-1\",\"issued\":\"2024-03-03\",\"total\":1234.50},{\"id\":\"INV-2\",\
             \"issued\":\"",
        ));
        d.observe(&toks);
        // The date's words in the prompt, re-ordered and padded as the first record did;
        // then the total without its separator.
        let got = draft(&mut d, &toks, prompt.len());
        assert!(
            got.starts_with("2024-04-17\",\"total\":12000.00},{\"id\":\""),
            "{got:?}"
        );
        // The parts of it.
        assert_eq!(
            number_at(b"$1,234.50, due", 1),
            Some((9, b"1234.50".to_vec()))
        );
        assert_eq!(
            number_at(b"98500.50,2019", 0),
            Some((8, b"98500.50".to_vec()))
        );
        let (q, _, fs) =
            DateFormat::find(b"on 03/04/2025 x", None, 0, b"2025-03-04").expect("found");
        assert_eq!(q, 3);
        assert_eq!(
            fs[0].apply(b"on 11/12/2026 x", 3),
            Some(b"2026-11-12".to_vec())
        );
    }

    #[test]
    fn the_first_value_continues_the_first_word_of_the_request_it_starts() {
        let tok = tokenizer();
        // Special tokens around the request (byte 0 stands for one here).
        let mut prompt = enc(&tok, "system: be exact 2");
        prompt.push(0);
        prompt.extend(enc(
            &tok,
            "Turn each line into JSON (timestamp, level):\n\
             2024-05-01T12:00:03Z INFO started\n2024-05-01T12:00:04Z WARN slow\n",
        ));
        prompt.push(0);
        let mut d = PromptTextDrafter::new(tok.clone());
        let mut toks = prompt.clone();
        toks.extend(enc(&tok, "[{\"timestamp\":\"2"));
        assert_eq!(draft(&mut d, &toks, prompt.len()), "024-05-01T12:00:03Z");
        // Nothing written yet: nothing to go by.
        let mut toks = prompt.clone();
        toks.extend(enc(&tok, "[{\"timestamp\":\""));
        assert_eq!(draft(&mut d, &toks, prompt.len()), "");
    }

    #[test]
    fn arbitrary_prompts_and_outputs_never_panic() {
        // Prompt and output bytes drawn from JSON syntax, delimiters, digits, letters,
        // quotes and a special token; the drafter proposes after every output token.
        let tok = tokenizer();
        let alphabet = b"{}[]\":,. -+$/\\\n0123456789aetrunfls yesnoMarch\x00\xc3\xa9";
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        for _ in 0..400 {
            let plen = next(200);
            let prompt: Vec<u32> = (0..plen)
                .map(|_| u32::from(alphabet[next(alphabet.len())]))
                .collect();
            let mut d = PromptTextDrafter::new(tok.clone());
            let mut toks = prompt.clone();
            for _ in 0..next(150) {
                toks.push(u32::from(alphabet[next(alphabet.len())]));
                let _ = draft(&mut d, &toks, prompt.len());
                if next(3) == 0 {
                    d.observe(&toks);
                }
            }
        }
    }

    #[test]
    fn the_layout_skips_fields_the_output_does_not_copy() {
        // key: value records; the output keeps name and plan only, so the relation
        // from one record's plan to the next record's name spans the skipped fields.
        let tok = tokenizer();
        let text = "Name: Ada\nEmail: ada@x.com\nPlan: premium\n\n\
                    Name: Alan\nEmail: alan@y.org\nPlan: team\n\n\
                    Name: Grace\nEmail: g@z.net\nPlan: free\n";
        let prompt = enc(&tok, text);
        let mut d = PromptTextDrafter::new(tok.clone());
        let mut toks = prompt.clone();
        toks.extend(enc(
            &tok,
            "[{\"n\":\"Ada\",\"p\":\"premium\"},{\"n\":\"Alan\",\"p\":\"team\"},{\"n\":\"",
        ));
        d.observe(&toks);
        assert_eq!(value(&draft(&mut d, &toks, prompt.len())), "Grace");
        toks.extend(enc(&tok, "Grace\",\"p\":\""));
        assert_eq!(value(&draft(&mut d, &toks, prompt.len())), "free");
    }

    #[test]
    fn nothing_without_a_grammar_a_layout_or_inside_a_key() {
        let tok = tokenizer();
        let prompt = enc(&tok, CSV);
        let mut d = PromptTextDrafter::new(tok.clone());
        let mut toks = prompt.clone();
        // No record written yet: no layout.
        toks.extend(enc(&tok, "[{\"name\":\""));
        assert_eq!(draft(&mut d, &toks, prompt.len()), "");
        // Unconstrained: nothing either.
        toks.extend(enc(
            &tok,
            "Ada Lovelace\",\"city\":\"London\"},{\"name\":\"",
        ));
        let params = SamplingParams::greedy();
        let never = TokenMask::new(256);
        let ctx = DraftContext {
            tokens: &toks,
            prompt_len: prompt.len(),
            params: &params,
            never: &never,
            max_tokens: 8,
            max_draft: 8,
            kind_caps: &[],
            allow_costly: true,
            bars: &[],
            eos_ends: false,
            eos: &[],
            target: None,
        };
        assert!(d.propose(&ctx, &mut Mirror::unconstrained()).is_empty());
        // Inside a key of the first record: the end of the key as keys ended so far, the
        // field after the one before in the prompt (it ends at a `,`, so the separator
        // between fields follows: the grammar forces the next key).
        let mut first = prompt.clone();
        first.extend(enc(&tok, "[{\"name\":\"Ada Lovelace\",\"ci"));
        let mut d = PromptTextDrafter::new(tok.clone());
        assert_eq!(draft(&mut d, &first, prompt.len()), "\":\"London\",\"");
        // A field after a space-delimited one: its end is not sure, no separator.
        let spaced = enc(&tok, "people:\nAda Lovelace London\n");
        let mut first = spaced.clone();
        first.extend(enc(&tok, "[{\"first\":\"Ada\",\"last\":\""));
        let mut d = PromptTextDrafter::new(tok.clone());
        assert_eq!(draft(&mut d, &first, spaced.len()), "Lovelace");
        // Inside an object key before any value: only the key's end by the layout
        // (compact: `":`) and a value's opening, which a grammar refuses while the key
        // goes on.
        let mut d = PromptTextDrafter::new(tok.clone());
        assert_eq!(draft(&mut d, &enc(&tok, "[{\"na"), 0), "\":\"");
        let mut d = PromptTextDrafter::new(tok.clone());
        assert_eq!(draft_refusing(&mut d, &enc(&tok, "[{\"na"), 0, b"\""), "");
    }

    #[test]
    fn a_first_records_field_named_in_the_prompt_is_drafted_after_its_name() {
        let tok = tokenizer();
        let text = "Order A-1 (customer: Maria Rossi, maria@example.com)\n\
                    Order A-2 (customer: Kenji Sato, kenji@example.com)\n";
        let prompt = enc(&tok, text);
        let mut d = PromptTextDrafter::new(tok.clone());
        let mut toks = prompt.clone();
        // `name` of `customer`: the enclosing object's name labels its first field.
        toks.extend(enc(&tok, "[{\"id\":\"A-1\",\"customer\":{\"name\":\""));
        assert_eq!(value(&draft(&mut d, &toks, prompt.len())), "Maria Rossi");
        // Not its later fields, and not a name the prompt does not write.
        toks.extend(enc(&tok, "Maria Rossi\",\"email\":\""));
        let mut st = d.state.clone();
        d.advance(&mut st, &toks[d.seen..]);
        let at = |w: &str| text.find(w);
        assert_eq!(st.labelled(&d.src, b"customer/email", 0), None);
        assert_eq!(st.labelled(&d.src, b"customer", 0), at("Maria"));
        assert_eq!(st.labelled(&d.src, b"Customer", 30), at("Kenji"));
    }

    #[test]
    fn the_layout_is_learned_from_the_output() {
        let feed = |text: &str| {
            let mut st = State::default();
            for &b in text.as_bytes() {
                st.feed(b"", b);
            }
            st.layout
        };
        let pretty = feed("[\n   {\n      \"a\": 1");
        assert_eq!((pretty.pretty, pretty.indent), (Some(true), Some(3)));
        let compact = feed("[{\"a\": 1, \"b\"");
        assert_eq!(compact.pretty, Some(false));
        assert_eq!(compact.comma_space, Some(true));
        let tight = feed("[{\"a\":1,\"b\"");
        assert_eq!(tight.comma_space, Some(false));
        assert_eq!(feed("[").pretty, None);
    }

    #[test]
    fn a_first_records_syntax_follows_the_layout_where_the_grammar_allows_it() {
        let tok = tokenizer();
        let prompt = enc(&tok, "Ada,12,London\nAlan,7,Wilmslow\n");
        let mut d = PromptTextDrafter::new(tok.clone());
        let draft_after = |d: &mut PromptTextDrafter, out: &str, refused: &'static [u8]| {
            let mut toks = prompt.clone();
            toks.extend(enc(&tok, out));
            draft_refusing(d, &toks, prompt.len(), refused)
        };
        // A pretty output's first record opens at 2 spaces a depth until it shows its
        // own indent (the grammar forces the key after the quote).
        assert_eq!(draft_after(&mut d, "[\n", b""), "  {\n    \"");
        let mut d = PromptTextDrafter::new(tok.clone());
        assert_eq!(draft_after(&mut d, "[\n   {\n", b""), "      \"");
        // After a key: its colon and a string's opening quote; a grammar that refuses the
        // quote (a number) gets the next number of the prompt.
        let mut d = PromptTextDrafter::new(tok.clone());
        assert_eq!(draft_after(&mut d, "[\n  {\n    \"name\"", b""), ": \"");
        let mut d = PromptTextDrafter::new(tok.clone());
        assert_eq!(draft_after(&mut d, "[\n  {\n    \"name\"", b"\"{["), ": 12");
        let mut d = PromptTextDrafter::new(tok.clone());
        let out = "[\n  {\n    \"name\": \"Ada\",\n    \"n\"";
        assert_eq!(draft_after(&mut d, out, b"\"{["), ": 12,\n    ");
        // After a number that is whole: the next member, else (the grammar refuses `,`:
        // the object is complete) the closings.
        let mut d = PromptTextDrafter::new(tok.clone());
        let out = "[\n  {\n    \"name\": \"Ada\",\n    \"n\": 12";
        assert_eq!(draft_after(&mut d, out, b""), ",\n    \"");
        let mut d = PromptTextDrafter::new(tok.clone());
        assert_eq!(draft_after(&mut d, out, b","), "\n  }\n]");
        // A compact output: no newlines.
        let mut d = PromptTextDrafter::new(tok.clone());
        assert_eq!(
            draft_after(&mut d, "[{\"name\":\"Ada\",\"n\":12", b""),
            ",\""
        );
    }

    #[test]
    fn a_first_records_date_takes_the_requested_format() {
        assert_eq!(
            first_date(b"issued on 3 March 2024 for", 0).as_deref(),
            Some(&b"2024-03-03"[..])
        );
        assert_eq!(
            first_date(b"Dates as DD/MM/YYYY. Paid Sept 9, 2023.", 0).as_deref(),
            Some(&b"09/09/2023"[..])
        );
        // Only from `from` on; no month name or no year: no date.
        assert_eq!(first_date(b"3 March 2024, then", 5), None);
        assert_eq!(first_date(b"on 3 4 2024", 0), None);
        assert_eq!(first_date(b"on 3 March", 0), None);
        let tok = tokenizer();
        let prompt = enc(&tok, "Invoice INV-7 was issued on 17 April 2024.\n");
        let mut d = PromptTextDrafter::new(tok.clone());
        let mut toks = prompt.clone();
        toks.extend(enc(&tok, "[{\"invoice\":\"INV-7\",\"issued\":\""));
        // The grammar wants digits (a date pattern): the prompt's words are refused.
        let letters: &'static [u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ";
        assert_eq!(
            draft_refusing(&mut d, &toks, prompt.len(), letters),
            "2024-04-17"
        );
    }

    #[test]
    fn a_first_records_number_is_the_next_one_standing_alone() {
        assert_eq!(
            first_number(b"- 2 x Beans 1kg @ 18.50", 4, b"").as_deref(),
            Some(&b"18.50"[..])
        );
        assert_eq!(
            first_number(b"total of $1,234.50, due in 30 days", 0, b"").as_deref(),
            Some(&b"1234.50"[..])
        );
        assert_eq!(
            first_number(b"total of $1,234.50, due in 30 days", 0, b"3").as_deref(),
            Some(&b"30"[..])
        );
        assert_eq!(first_number(b"v1 and 2kg", 0, b""), None);
    }

    #[test]
    fn the_mirror_counts_the_tokens_it_would_take_without_taking_them() {
        let mut g = Refuse(b",");
        let mut m = Mirror::new(&mut g, 256);
        assert_eq!(m.accepted_prefix(&[u32::from(b'a'), u32::from(b','), 0]), 1);
        assert_eq!(m.advanced(), 0);
        assert!(m.try_push(u32::from(b'a')));
        assert_eq!(Mirror::unconstrained().accepted_prefix(&[1, 2, 3]), 3);
    }

    #[test]
    fn the_scanner_tracks_keys_through_nesting() {
        let mut st = State::default();
        for &b in b"{\"a\":{\"b\":[1,{\"c\":\"x" {
            st.feed(b"", b);
        }
        assert!(st.in_string && !st.string_is_key);
        assert_eq!(st.key(), b"a/b/c");
        for &b in b"\"}],\"d\":" {
            st.feed(b"", b);
        }
        assert_eq!(st.key(), b"a/d");
        // Values and the gaps between them: `1` (path `a/b`) was followed by `,{"c":"`.
        assert_eq!(
            st.gaps.get(b"a/b".as_slice()),
            Some(&b",{\"c\":\"".to_vec())
        );
        // The gap after `x` is still open.
        assert_eq!(
            st.gap,
            Some(Gap {
                after: b"a/b/c".to_vec(),
                bytes: b"\"}],\"d\":".to_vec()
            })
        );
        assert!(!st.expect_key);
    }
}
