//! Pre-tokenizers: split a text fragment into words before byte-level BPE.
//!
//! Hand-written matchers that reproduce llama.cpp's splitting exactly (tested equal to a
//! `fancy-regex` evaluation of the same regexes over the same character classes):
//!
//! - [`PreTokenizer::Gpt2`]: `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)`,
//!   as llama.cpp's custom GPT-2 splitter (a lone whitespace before a non-space is a word).
//! - [`PreTokenizer::DigitsThenGpt2`] (`smollm`, `starcoder`, ...): first every `\p{N}` becomes
//!   its own fragment, then the GPT-2 splitter runs inside each fragment.
//! - [`PreTokenizer::Llama3Like`] (`qwen2` with 1 digit per number, `llama3` with up to 3):
//!   `(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,k}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`.
//!
//! Look-aheads see only the fragment: its end counts as end of text.

use std::ops::Range;

use crate::unicode::{LETTER, NUMBER, WHITESPACE, class_of};

/// A pre-tokenizer variant (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PreTokenizer {
    /// The GPT-2 regex.
    Gpt2,
    /// Every number character alone, then the GPT-2 regex.
    DigitsThenGpt2,
    /// The llama3 regex with numbers in groups of at most `max_digits`.
    Llama3Like {
        /// 1 for qwen2, 3 for llama3.
        max_digits: usize,
    },
}

impl PreTokenizer {
    /// The variant for a `tokenizer.ggml.pre` name, and whether whole words found in the
    /// vocabulary skip the merges (llama.cpp's `ignore_merges`, set for llama3).
    pub(crate) fn from_name(pre: &str) -> Option<(PreTokenizer, bool)> {
        Some(match pre {
            "gpt-2" | "gpt2" | "phi-2" | "jina-es" | "jina-de" | "jina-v2-es" | "jina-v2-de"
            | "mpt" | "olmo" | "jais" => (PreTokenizer::Gpt2, false),
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone"
            | "minerva-7b" => (PreTokenizer::DigitsThenGpt2, false),
            "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "megrez" => {
                (PreTokenizer::Llama3Like { max_digits: 1 }, false)
            }
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" => {
                (PreTokenizer::Llama3Like { max_digits: 3 }, true)
            }
            "dbrx" | "smaug-bpe" => (PreTokenizer::Llama3Like { max_digits: 3 }, false),
            _ => return None,
        })
    }

    /// Splits `text` into words, appending their byte ranges (in order, covering `text`).
    pub(crate) fn split(self, text: &str, out: &mut Vec<Range<usize>>) {
        let chars: Vec<Cp> = text
            .char_indices()
            .map(|(off, c)| Cp {
                off,
                c,
                class: class_of(c),
            })
            .collect();
        let mut sink = Sink {
            chars: &chars,
            text_len: text.len(),
            out,
        };
        let n = chars.len();
        match self {
            PreTokenizer::Gpt2 => gpt2(&chars, 0, n, &mut sink),
            PreTokenizer::DigitsThenGpt2 => {
                let mut start = 0;
                for (i, cp) in chars.iter().enumerate() {
                    if cp.class == NUMBER {
                        gpt2(&chars, start, i, &mut sink);
                        sink.emit(i, i + 1);
                        start = i + 1;
                    }
                }
                gpt2(&chars, start, n, &mut sink);
            }
            PreTokenizer::Llama3Like { max_digits } => {
                llama3_like(&chars, n, max_digits.max(1), &mut sink)
            }
        }
    }
}

/// One code point with its byte offset and class.
#[derive(Debug, Clone, Copy)]
struct Cp {
    off: usize,
    c: char,
    class: u8,
}

/// Collects words as byte ranges from code point index ranges.
struct Sink<'a> {
    chars: &'a [Cp],
    text_len: usize,
    out: &'a mut Vec<Range<usize>>,
}

impl Sink<'_> {
    fn byte_at(&self, i: usize) -> usize {
        self.chars.get(i).map_or(self.text_len, |cp| cp.off)
    }

    fn emit(&mut self, a: usize, b: usize) {
        if b > a {
            let r = self.byte_at(a)..self.byte_at(b);
            self.out.push(r);
        }
    }
}

/// llama.cpp's custom GPT-2 splitter over `chars[ini..end]`.
fn gpt2(chars: &[Cp], ini: usize, end: usize, sink: &mut Sink<'_>) {
    let cp = |i: usize| (i < end).then(|| chars.get(i)).flatten();
    let class = |i: usize| cp(i).map(|c| c.class);
    let mut pos = ini;
    while pos < end {
        let start = pos;
        let Some(&Cp { c, class: cls, .. }) = cp(pos) else {
            break;
        };
        // 's|'t|'re|'ve|'m|'ll|'d
        if c == '\'' {
            let next = cp(pos + 1).map(|x| x.c);
            if matches!(next, Some('s' | 't' | 'm' | 'd')) {
                sink.emit(start, pos + 2);
                pos += 2;
                continue;
            }
            let next2 = cp(pos + 2).map(|x| x.c);
            if matches!(
                (next, next2),
                (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l'))
            ) {
                sink.emit(start, pos + 3);
                pos += 3;
                continue;
            }
        }
        let class2 = if c == ' ' { class(pos + 1) } else { Some(cls) };
        // <space>?\p{L}+ | <space>?\p{N}+ | <space>?[^\s\p{L}\p{N}]+
        for want in [LETTER, NUMBER, 0] {
            if class2 == Some(want) {
                if c == ' ' {
                    pos += 1;
                }
                while class(pos) == Some(want) {
                    pos += 1;
                }
                break;
            }
        }
        if pos > start {
            sink.emit(start, pos);
            continue;
        }
        let mut n_ws = 0;
        while class(pos + n_ws) == Some(WHITESPACE) {
            n_ws += 1;
        }
        if n_ws > 1 && pos + n_ws < end {
            // \s+(?!\S): all but the last whitespace before a non-space.
            pos += n_ws - 1;
        } else if n_ws > 0 {
            pos += n_ws;
        } else {
            pos += 1;
        }
        sink.emit(start, pos);
    }
}

/// The llama3-family regex over `chars[..end]`.
fn llama3_like(chars: &[Cp], end: usize, max_digits: usize, sink: &mut Sink<'_>) {
    let cp = |i: usize| (i < end).then(|| chars.get(i)).flatten();
    let class = |i: usize| cp(i).map(|c| c.class);
    let lower = |i: usize| cp(i).map(|x| x.c.to_ascii_lowercase());
    let is_newline = |i: usize| matches!(cp(i).map(|x| x.c), Some('\r' | '\n'));
    let mut pos = 0;
    while pos < end {
        let start = pos;
        let Some(&Cp { c, class: cls, .. }) = cp(pos) else {
            break;
        };
        // (?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])
        if c == '\'' {
            if matches!(lower(pos + 1), Some('s' | 't' | 'm' | 'd')) {
                sink.emit(start, pos + 2);
                pos += 2;
                continue;
            }
            if matches!(
                (lower(pos + 1), lower(pos + 2)),
                (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l'))
            ) {
                sink.emit(start, pos + 3);
                pos += 3;
                continue;
            }
        }
        // [^\r\n\p{L}\p{N}]?\p{L}+
        if !(c == '\r' || c == '\n' || cls == NUMBER)
            && (cls == LETTER || class(pos + 1) == Some(LETTER))
        {
            pos += 1;
            while class(pos) == Some(LETTER) {
                pos += 1;
            }
            sink.emit(start, pos);
            continue;
        }
        // \p{N}{1,k}
        if cls == NUMBER {
            while pos - start < max_digits && class(pos) == Some(NUMBER) {
                pos += 1;
            }
            sink.emit(start, pos);
            continue;
        }
        // <space>?[^\s\p{L}\p{N}]+[\r\n]*
        let class2 = if c == ' ' { class(pos + 1) } else { Some(cls) };
        if class2 == Some(0) {
            if c == ' ' {
                pos += 1;
            }
            while class(pos) == Some(0) {
                pos += 1;
            }
            while is_newline(pos) {
                pos += 1;
            }
            sink.emit(start, pos);
            continue;
        }
        // \s*[\r\n]+ | \s+(?!\S) | \s+
        let mut n_ws = 0;
        let mut after_last_newline = None;
        while class(pos + n_ws) == Some(WHITESPACE) {
            if is_newline(pos + n_ws) {
                after_last_newline = Some(pos + n_ws + 1);
            }
            n_ws += 1;
        }
        if let Some(e) = after_last_newline {
            pos = e;
        } else if n_ws > 1 && pos + n_ws < end {
            pos += n_ws - 1;
        } else if n_ws > 0 {
            pos += n_ws;
        } else {
            pos += 1;
        }
        sink.emit(start, pos);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GPT2_RE: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
    const QWEN2_RE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const LLAMA3_RE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

    /// Replaces every non-ASCII character by a representative of its class, as llama.cpp
    /// does before running `std::regex`, so the regex engine's Unicode tables cannot
    /// disagree with ours.
    fn collapse(s: &str) -> Vec<char> {
        s.chars()
            .map(|c| {
                if c.is_ascii() {
                    c
                } else {
                    match class_of(c) {
                        LETTER => 'é',
                        NUMBER => '٣',
                        WHITESPACE => '\u{0B}',
                        _ => '§',
                    }
                }
            })
            .collect()
    }

    /// Splits `chars` with `re` the way llama.cpp's regex path does: matches and the gaps
    /// between them are all fragments. Returns char-index ranges.
    fn regex_split(re: &fancy_regex::Regex, chars: &[char]) -> Vec<Range<usize>> {
        let s: String = chars.iter().collect();
        let char_index = |byte: usize| s[..byte].chars().count();
        let mut out = Vec::new();
        let mut last = 0;
        for m in re.find_iter(&s) {
            let m = m.expect("regex evaluation");
            let (a, b) = (char_index(m.start()), char_index(m.end()));
            if a > last {
                out.push(last..a);
            }
            out.push(a..b);
            last = b;
        }
        if last < chars.len() {
            out.push(last..chars.len());
        }
        out
    }

    fn reference(pre: PreTokenizer, text: &str) -> Vec<String> {
        let chars = collapse(text);
        let orig: Vec<char> = text.chars().collect();
        let piece = |r: &Range<usize>| orig[r.clone()].iter().collect::<String>();
        match pre {
            PreTokenizer::Gpt2 => {
                let re = fancy_regex::Regex::new(GPT2_RE).expect("regex");
                regex_split(&re, &chars).iter().map(piece).collect()
            }
            PreTokenizer::DigitsThenGpt2 => {
                let digits = fancy_regex::Regex::new(r"\p{N}").expect("regex");
                let re = fancy_regex::Regex::new(GPT2_RE).expect("regex");
                let mut out = Vec::new();
                for frag in regex_split(&digits, &chars) {
                    for r in regex_split(&re, &chars[frag.clone()]) {
                        out.push(piece(&(frag.start + r.start..frag.start + r.end)));
                    }
                }
                out
            }
            PreTokenizer::Llama3Like { max_digits } => {
                let re = if max_digits == 1 { QWEN2_RE } else { LLAMA3_RE };
                let re = fancy_regex::Regex::new(re).expect("regex");
                regex_split(&re, &chars).iter().map(piece).collect()
            }
        }
    }

    fn ours(pre: PreTokenizer, text: &str) -> Vec<String> {
        let mut out = Vec::new();
        pre.split(text, &mut out);
        out.into_iter().map(|r| text[r].to_string()).collect()
    }

    const VARIANTS: [PreTokenizer; 4] = [
        PreTokenizer::Gpt2,
        PreTokenizer::DigitsThenGpt2,
        PreTokenizer::Llama3Like { max_digits: 1 },
        PreTokenizer::Llama3Like { max_digits: 3 },
    ];

    const PIECES: &[&str] = &[
        "a", "Z", "s", "t", "re", "ll", "ve", "D", "M", "'", "'", " ", " ", " ", "  ", "\t", "\n",
        "\r", "\r\n", "1", "42", "٣", "²", "é", "中", "ß", "\u{301}", "!", ".", ",", "(", "-", "_",
        "$", "\u{A0}", "\u{3000}", "\u{85}", "\u{1C}", "\u{200B}", "😀", "\u{B}", "\u{C}", "Ǆ",
    ];

    fn text_strategy() -> impl Strategy<Value = String> {
        prop::collection::vec(prop::sample::select(PIECES), 0..24).prop_map(|v| v.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(600))]
        #[test]
        fn hand_written_splitters_equal_the_regexes(text in text_strategy()) {
            for pre in VARIANTS {
                prop_assert_eq!(ours(pre, &text), reference(pre, &text), "{:?} on {:?}", pre, text);
            }
        }

        #[test]
        fn words_cover_the_text_in_order(text in any::<String>()) {
            for pre in VARIANTS {
                prop_assert_eq!(ours(pre, &text).concat(), text.clone());
            }
        }
    }

    #[test]
    fn known_splits() {
        let q = PreTokenizer::Llama3Like { max_digits: 1 };
        assert_eq!(
            ours(q, "Hello world's 123  x\n\n  y"),
            [
                "Hello", " world", "'s", " ", "1", "2", "3", " ", " x", "\n\n", " ", " y"
            ]
        );
        let l3 = PreTokenizer::Llama3Like { max_digits: 3 };
        assert_eq!(ours(l3, "12345"), ["123", "45"]);
        let s = PreTokenizer::DigitsThenGpt2;
        assert_eq!(ours(s, "ab12 cd  ef"), ["ab", "1", "2", " cd", " ", " ef"]);
        assert_eq!(
            ours(PreTokenizer::Gpt2, "I'm  here\t\tok  "),
            ["I", "'m", " ", " here", "\t", "\t", "ok", "  "]
        );
    }
}
