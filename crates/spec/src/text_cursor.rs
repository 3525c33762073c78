//! The prompt cursor in text space: where in the prompt's *text* the output has copied up
//! to, so the next value can be proposed even when the output tokenizes it differently.
//!
//! Extraction under a grammar copies the prompt's values while the grammar writes the
//! syntax between them. A token-level cursor fails when the same text tokenizes one way
//! in the prompt and another in the output: in `…,London,…` the BPE pre-tokenizer glues
//! the comma to the word (`,L` `ondon`), while inside the JSON string `"London"` the model
//! writes `London`. This cursor works on bytes instead: it follows the output tokens over
//! the prompt text (a token that continues the text at the cursor moves it on; a value
//! token may first skip a few delimiter bytes; syntax tokens leave it alone; a run of value
//! bytes the cursor did not expect re-anchors it where that run occurs just ahead), and it
//! proposes the prompt text after the cursor re-encoded as a standalone text, which is how
//! a model writes a value it copies.

use std::sync::Arc;

use text::{EncodeOptions, Tokenizer};

use crate::drafter::Mirror;

/// Delimiter bytes the cursor skips before a value from the start (CSV, TSV, table
/// separators and line ends). More are learned per sequence.
const DEFAULT_DELIMITERS: &[u8] = b",;|\t\r\n";
/// Most delimiter bytes skipped between values.
const SKIP_BYTES: usize = 3;
/// How far ahead of the cursor (bytes) a run of unexpected value bytes may re-anchor it.
const SYNC_BYTES: usize = 96;
/// Shortest run of value bytes that may anchor the cursor.
const MIN_ANCHOR: usize = 3;
/// Longest run of value bytes kept for anchoring.
const MAX_RUN: usize = 48;
/// Bytes of prompt text re-encoded per proposal.
const WINDOW_BYTES: usize = 64;
/// Separator standing in for a special token in the prompt text (never valid UTF-8, so
/// no output text matches across it).
const SPECIAL: u8 = 0xFF;

/// Whether `b` can be part of a value (ASCII letters and digits, or any non-ASCII byte).
fn is_value_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b >= 0x80
}

/// Whether `bytes` hold a value byte (a letter, a digit, non-ASCII text).
pub(crate) fn has_value_byte(bytes: &[u8]) -> bool {
    bytes.iter().any(|&b| is_value_byte(b) && b != SPECIAL)
}

/// Where the cursor stands: a byte offset into the prompt text, plus the run of value
/// bytes the output wrote since the cursor last moved (for re-anchoring).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct CursorState {
    /// Byte offset into the prompt text just after the last copied byte.
    pub at: Option<usize>,
    /// Recent output value bytes that did not continue the cursor.
    run: Vec<u8>,
    /// While the output is inside a copied value (the last token continued the cursor):
    /// the index of the value's first token. A delimiter at the cursor then ends it.
    copied: Option<usize>,
}

/// A proposal the cursor made, remembered until the next observation so a rejected first
/// byte can be learned as a delimiter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PendingCopy {
    /// Committed length when the proposal was made (index of the first draft).
    base: usize,
    /// Prompt byte offset the proposal copied from.
    start: usize,
    /// The first proposed token.
    first: u32,
}

/// What the text cursor proposes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum TextProposal {
    /// Tokens copied from the prompt text (already pushed into the mirror).
    Copy(Vec<u32>),
    /// The output is inside a copied value and the prompt's value ends here: no more
    /// text (what closes the value is syntax, for the grammar and the lookup).
    ValueEnds {
        /// Index of the value's first token in the sequence.
        value_start: usize,
    },
    /// The cursor has nothing here (no anchor yet, or the grammar rejects the text).
    Nothing,
}

/// The text-space prompt cursor of one sequence.
#[derive(Clone, Debug)]
pub(crate) struct TextCursor {
    tok: Arc<Tokenizer>,
    /// The prompt as bytes (special tokens as [`SPECIAL`]); built on first use.
    prompt: Vec<u8>,
    /// Prompt tokens `prompt` was built from (0 = not built yet).
    prompt_tokens: usize,
    /// The state after the committed tokens observed so far.
    state: CursorState,
    /// Committed tokens folded into `state`.
    seen: usize,
    /// Delimiter bytes skipped before values.
    delimiters: Vec<u8>,
    pending: Option<PendingCopy>,
}

impl TextCursor {
    /// A cursor over the text of the prompt tokens of the sequence, decoded with `tok`.
    pub fn new(tok: Arc<Tokenizer>) -> TextCursor {
        TextCursor {
            tok,
            prompt: Vec::new(),
            prompt_tokens: 0,
            state: CursorState::default(),
            seen: 0,
            delimiters: DEFAULT_DELIMITERS.to_vec(),
            pending: None,
        }
    }

    /// The bytes a token stands for in text (empty for special tokens).
    pub fn bytes(&self, t: u32) -> &[u8] {
        if self.tok.is_special(t) {
            return &[];
        }
        self.tok.token_bytes(t).unwrap_or(&[])
    }

    fn ensure_prompt(&mut self, tokens: &[u32], prompt_len: usize) {
        let n = prompt_len.min(tokens.len());
        if self.prompt_tokens == n && n > 0 {
            return;
        }
        self.prompt.clear();
        for &t in &tokens[..n] {
            if self.tok.is_special(t) {
                self.prompt.push(SPECIAL);
            } else if let Some(b) = self.tok.token_bytes(t) {
                self.prompt.extend_from_slice(b);
            }
        }
        self.prompt_tokens = n;
        self.state = CursorState::default();
        self.seen = n;
    }

    /// Folds output token `t` (at index `i` of the sequence) into `s`.
    fn step(&self, s: &mut CursorState, i: usize, t: u32) {
        let b = self.bytes(t);
        let run_start = s.copied.take().unwrap_or(i);
        if b.is_empty() {
            s.run.clear();
            return;
        }
        let p = &self.prompt;
        if let Some(c) = s.at {
            if p.get(c..).is_some_and(|rest| rest.starts_with(b)) {
                s.at = Some(c + b.len());
                s.run.clear();
                s.copied = Some(run_start);
                return;
            }
            if has_value_byte(b) {
                for skip in 1..=SKIP_BYTES {
                    let Some(gap) = p.get(c..c + skip) else { break };
                    if has_value_byte(gap) || gap.contains(&SPECIAL) {
                        break;
                    }
                    if p[c + skip..].starts_with(b) {
                        s.at = Some(c + skip + b.len());
                        s.run.clear();
                        s.copied = Some(run_start);
                        return;
                    }
                }
            }
        }
        // Not a continuation: syntax leaves the cursor where it is; value bytes gather in
        // the run, which re-anchors the cursor once it is found just ahead (or, before the
        // first anchor, anywhere in the prompt: its first occurrence).
        if !has_value_byte(b) {
            s.run.clear();
            return;
        }
        s.run.extend_from_slice(b);
        if s.run.len() > MAX_RUN {
            let cut = s.run.len() - MAX_RUN;
            s.run.drain(..cut);
        }
        if s.run.len() < MIN_ANCHOR {
            return;
        }
        let (lo, hi) = match s.at {
            Some(c) => (c, (c + SYNC_BYTES + s.run.len()).min(p.len())),
            None => (0, p.len()),
        };
        if let Some(q) = find(&p[lo..hi], &s.run) {
            s.at = Some(lo + q + s.run.len());
            s.run.clear();
        }
    }

    /// The state after `tokens[self.seen..]` (drafts of this cycle included).
    fn state_after(&self, tokens: &[u32]) -> CursorState {
        let mut s = self.state.clone();
        for (i, &t) in tokens.iter().enumerate().skip(self.seen) {
            self.step(&mut s, i, t);
        }
        s
    }

    /// The committed tokens after a cycle: folds them into the state and learns a
    /// delimiter when the target skipped a proposal's first byte for the text after it.
    pub fn observe(&mut self, committed: &[u32]) {
        if self.prompt_tokens == 0 {
            return;
        }
        if let Some(pc) = self.pending.take()
            && let Some(&got) = committed.get(pc.base)
            && got != pc.first
        {
            let d = self.prompt.get(pc.start).copied();
            let b = self.bytes(got);
            if let Some(d) = d
                && !is_value_byte(d)
                && d != SPECIAL
                && !b.is_empty()
                && has_value_byte(b)
                && self.prompt[pc.start + 1..].starts_with(b)
                && !self.delimiters.contains(&d)
            {
                self.delimiters.push(d);
            }
        }
        let s = self.state_after(committed);
        self.state = s;
        self.seen = committed.len().max(self.seen);
    }

    /// Proposes up to `k` tokens ([`TextProposal::Copy`]): the prompt text after the cursor (known delimiters
    /// skipped) re-encoded on its own, up to the next delimiter, each token pushed into
    /// `mirror` (the grammar's speculative mirror). When the first token is not allowed,
    /// up to [`SKIP_BYTES`] further non-value bytes are skipped. Empty when there is no
    /// cursor or nothing is allowed.
    pub fn propose(
        &mut self,
        tokens: &[u32],
        prompt_len: usize,
        k: usize,
        mirror: &mut Mirror<'_>,
    ) -> TextProposal {
        self.ensure_prompt(tokens, prompt_len);
        let st = self.state_after(tokens);
        let Some(mut c) = st.at else {
            return TextProposal::Nothing;
        };
        let p = &self.prompt;
        // Inside a copied value a delimiter ends it: what closes the value is the
        // grammar's and the target's business.
        if let Some(value_start) = st.copied
            && p.get(c).is_some_and(|b| self.delimiters.contains(b))
        {
            return TextProposal::ValueEnds { value_start };
        }
        let mut skipped = 0;
        while skipped < SKIP_BYTES && p.get(c).is_some_and(|b| self.delimiters.contains(b)) {
            c += 1;
            skipped += 1;
        }
        let mut start = c;
        loop {
            if start >= p.len() || p[start] == SPECIAL {
                return TextProposal::Nothing;
            }
            let window = self.window(start);
            if let Some(&first) = window.first()
                && mirror.accepts(first)
            {
                let mut out = Vec::new();
                for t in window {
                    let ends_value = !out.is_empty()
                        && self.bytes(t).iter().any(|b| self.delimiters.contains(b));
                    if out.len() >= k || ends_value || !mirror.try_push(t) {
                        break;
                    }
                    out.push(t);
                }
                if let Some(&first) = out.first() {
                    self.pending = Some(PendingCopy {
                        base: tokens.len(),
                        start,
                        first,
                    });
                    return TextProposal::Copy(out);
                }
                return TextProposal::Nothing;
            }
            if start - c >= SKIP_BYTES || is_value_byte(p[start]) {
                return TextProposal::Nothing;
            }
            start += 1;
        }
    }

    /// The prompt text from `start`, re-encoded: up to [`WINDOW_BYTES`] bytes, cut at a
    /// special token and at UTF-8 boundaries; the last token is dropped when the window
    /// was cut inside the text (it may be a word's prefix).
    fn window(&self, start: usize) -> Vec<u32> {
        // A SentencePiece vocabulary that prefixes a space to every encoded text would
        // put one before the value; such a window is not what the model writes.
        if self.tok.add_space_prefix() {
            return Vec::new();
        }
        let p = &self.prompt;
        let mut end = (start + WINDOW_BYTES).min(p.len());
        if let Some(s) = p[start..end].iter().position(|&b| b == SPECIAL) {
            end = start + s;
        }
        let cut = end < p.len() && p[end] != SPECIAL;
        let mut lo = start;
        while lo < end && (p[lo] & 0xC0) == 0x80 {
            lo += 1;
        }
        let text = match std::str::from_utf8(&p[lo..end]) {
            Ok(t) => t,
            Err(e) => match std::str::from_utf8(&p[lo..lo + e.valid_up_to()]) {
                Ok(t) => t,
                Err(_) => return Vec::new(),
            },
        };
        let mut toks = self.tok.encode(text, EncodeOptions::plain_text());
        if cut && toks.len() > 1 {
            toks.pop();
        }
        toks
    }
}

/// First occurrence of `needle` in `hay`.
fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || needle.len() > hay.len() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sampling::{ConstraintError, TokenConstraint, TokenMask};
    use text::VocabSpec;

    /// GPT-2's byte-to-unicode character for a byte.
    fn byte_char(b: u8) -> char {
        let printable = |b: u8| matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
        if printable(b) {
            char::from(b)
        } else {
            let k = (0..b).filter(|&x| !printable(x)).count() as u32;
            char::from_u32(256 + k).expect("valid")
        }
    }

    /// Byte tokens plus merges that tokenize `,London` as `,L` `ondon` but `London` on its
    /// own as one token (as Qwen's pre-tokenizer glues punctuation to the next word).
    fn tokenizer() -> Arc<Tokenizer> {
        let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_char(b).to_string()).collect();
        for t in [",L", "on", "ond", "ondon", "London"] {
            tokens.push(t.to_string());
        }
        let merges: Vec<String> = [", L", "o n", "on d", "ond on", "L ondon"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        Arc::new(
            Tokenizer::from_spec(&VocabSpec {
                model: "gpt2",
                pre: "qwen2",
                tokens: &tokens,
                merges: &merges,
                ..VocabSpec::default()
            })
            .expect("tokenizer"),
        )
    }

    fn enc(tok: &Tokenizer, s: &str) -> Vec<u32> {
        tok.encode(s, EncodeOptions::plain_text())
    }

    fn propose(c: &mut TextCursor, tokens: &[u32], prompt_len: usize) -> TextProposal {
        c.propose(tokens, prompt_len, 8, &mut Mirror::unconstrained())
    }

    #[test]
    fn copies_a_value_the_prompt_tokenizes_differently() {
        let tok = tokenizer();
        let prompt = enc(&tok, "rows: Ada,London;Bob,Paris\n");
        let london = tok.token_to_id("London").expect("token");
        // In the prompt the value is `,L` `ondon`: a token-level copy cannot produce it.
        assert!(!prompt.contains(&london));
        let mut c = TextCursor::new(tok.clone());
        let mut toks = prompt.clone();
        // The output writes the first value itself, then syntax.
        toks.extend(enc(&tok, "{\"n\":\"Ada\",\"c\":\""));
        assert_eq!(
            propose(&mut c, &toks, prompt.len()),
            TextProposal::Copy(vec![london]),
            "the value after the delimiter, encoded on its own, up to the next delimiter"
        );
    }

    #[test]
    fn a_delimiter_inside_a_copied_value_ends_it_and_the_next_value_follows() {
        let tok = tokenizer();
        let prompt = enc(&tok, "rows: Ada,London;Bob,Paris\n");
        let mut c = TextCursor::new(tok.clone());
        let mut toks = prompt.clone();
        // `Ada` anchors the cursor, `London` continues it: at `;` the value ends.
        toks.extend(enc(&tok, "[\"Ada\",\""));
        let value_start = toks.len();
        toks.push(tok.token_to_id("London").expect("token"));
        assert_eq!(
            propose(&mut c, &toks, prompt.len()),
            TextProposal::ValueEnds { value_start }
        );
        // After the syntax that closes it, the next record's first value.
        toks.extend(enc(&tok, "\"],[\""));
        assert_eq!(
            propose(&mut c, &toks, prompt.len()),
            TextProposal::Copy(enc(&tok, "Bob"))
        );
    }

    #[test]
    fn the_grammar_decides_what_may_be_copied() {
        struct OnlyDigits(Arc<Tokenizer>);
        impl OnlyDigits {
            fn digits(&self, t: u32) -> bool {
                self.0
                    .token_bytes(t)
                    .is_some_and(|b| !b.is_empty() && b.iter().all(u8::is_ascii_digit))
            }
        }
        impl TokenConstraint for OnlyDigits {
            fn compute_mask(&mut self, mask: &mut TokenMask) -> Result<(), ConstraintError> {
                let n = self.0.vocab_size();
                mask.fill_words(n, |i| {
                    (0..64u32)
                        .filter(|b| self.digits(i as u32 * 64 + b))
                        .fold(0u64, |w, b| w | 1 << b)
                });
                Ok(())
            }
            fn accepts(&mut self, t: u32) -> bool {
                self.digits(t)
            }
            fn consume(&mut self, t: u32) -> Result<(), ConstraintError> {
                if self.digits(t) {
                    Ok(())
                } else {
                    Err(ConstraintError::TokenRejected {
                        token: t,
                        text: String::new(),
                        position: 0,
                    })
                }
            }
            fn rollback(&mut self, _: usize) -> Result<(), ConstraintError> {
                Ok(())
            }
            fn fork(&self) -> Box<dyn TokenConstraint> {
                Box::new(OnlyDigits(self.0.clone()))
            }
            fn is_finished(&self) -> bool {
                false
            }
        }
        let tok = tokenizer();
        let prompt = enc(&tok, "Ada,36x,London\n");
        let mut c = TextCursor::new(tok.clone());
        let mut toks = prompt.clone();
        toks.extend(enc(&tok, "{\"n\":\"Ada\",\"a\":"));
        let mut g = OnlyDigits(tok.clone());
        let mut m = Mirror::new(&mut g, tok.vocab_size());
        // `36` is copied; `x` is not a delimiter but the grammar stops it.
        assert_eq!(
            c.propose(&toks, prompt.len(), 8, &mut m),
            TextProposal::Copy(enc(&tok, "36"))
        );
        // A cursor on text the grammar rejects has nothing.
        toks.extend(enc(&tok, "36"));
        let mut g = OnlyDigits(tok.clone());
        let mut m = Mirror::new(&mut g, tok.vocab_size());
        assert_eq!(
            c.propose(&toks, prompt.len(), 8, &mut m),
            TextProposal::Nothing
        );
    }

    #[test]
    fn a_skipped_first_byte_is_learned_as_a_delimiter() {
        let tok = tokenizer();
        let prompt = enc(&tok, "Ada:London:Paris\n");
        let mut c = TextCursor::new(tok.clone());
        let mut toks = prompt.clone();
        toks.extend(enc(&tok, "[\"Ada\",\""));
        let base = toks.len();
        // `:` is not a known delimiter: the cursor proposes it with the value.
        let TextProposal::Copy(p) = propose(&mut c, &toks, prompt.len()) else {
            panic!("a proposal");
        };
        assert_eq!(p.first(), enc(&tok, ":").first());
        // The target skipped it and wrote the value: `:` is learned.
        toks.push(tok.token_to_id("London").expect("token"));
        c.observe(&toks);
        assert_eq!(c.delimiters.last(), Some(&b':'));
        assert_eq!(toks[base], tok.token_to_id("London").expect("token"));
        toks.extend(enc(&tok, "\",\""));
        assert_eq!(
            propose(&mut c, &toks, prompt.len()),
            TextProposal::Copy(enc(&tok, "Paris")),
            "the learned delimiter is skipped"
        );
    }

    #[test]
    fn without_an_anchor_there_is_no_proposal() {
        let tok = tokenizer();
        let prompt = enc(&tok, "alpha beta");
        let mut c = TextCursor::new(tok.clone());
        let mut toks = prompt.clone();
        toks.extend(enc(&tok, "{\"x\":\""));
        assert_eq!(propose(&mut c, &toks, prompt.len()), TextProposal::Nothing);
        // An empty prompt is fine too.
        let mut c = TextCursor::new(tok.clone());
        assert_eq!(propose(&mut c, &enc(&tok, "zzz"), 0), TextProposal::Nothing);
    }
}
