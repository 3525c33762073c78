//! Streaming detokenization: token ids in, UTF-8 text deltas out.
//!
//! A token can end in the middle of a character (byte-level BPE splits multi-byte
//! characters, `<0xNN>` byte fallback emits one byte at a time). The decoder keeps the
//! undecided tail and emits text only once it is complete, so a delta never splits a
//! character. A byte sequence that can no longer become valid UTF-8 is emitted as U+FFFD
//! as soon as that is certain, with exactly the replacements `String::from_utf8_lossy`
//! makes; [`StreamDecoder::finish`] flushes an incomplete tail the same way. So the
//! concatenated deltas always equal [`crate::Tokenizer::decode_lossy`] of the whole
//! sequence.

use crate::error::TextError;
use crate::tokenizer::{DecodeOptions, Tokenizer};

/// Decodes token ids one at a time into text deltas.
#[derive(Debug)]
pub struct StreamDecoder<'t> {
    tokenizer: &'t Tokenizer,
    opts: DecodeOptions,
    pending: Vec<u8>,
    first_id: Option<u32>,
}

impl<'t> StreamDecoder<'t> {
    /// A decoder at the start of a sequence.
    pub fn new(tokenizer: &'t Tokenizer, opts: DecodeOptions) -> StreamDecoder<'t> {
        StreamDecoder {
            tokenizer,
            opts,
            pending: Vec::new(),
            first_id: None,
        }
    }

    /// Feeds one token; returns the text that became complete (possibly empty).
    ///
    /// An id outside the vocabulary is an error and leaves the decoder unchanged.
    pub fn push(&mut self, id: u32) -> Result<String, TextError> {
        let first = self.first_id.is_none();
        let first_id = self.first_id.or(Some(id));
        let piece = self.tokenizer.piece(id, self.opts, first, first_id)?;
        self.first_id = first_id;
        self.pending.extend_from_slice(piece);
        Ok(self.take_complete())
    }

    /// Ends the sequence: returns the undecided tail, an incomplete character as U+FFFD.
    pub fn finish(&mut self) -> String {
        let tail = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        tail
    }

    /// Bytes held back because they may be the start of a character.
    pub fn pending_bytes(&self) -> usize {
        self.pending.len()
    }

    fn take_complete(&mut self) -> String {
        let mut out = String::new();
        let mut consumed = 0;
        loop {
            let rest = self.pending.get(consumed..).unwrap_or_default();
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    consumed = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    if let Some(s) = rest.get(..valid).and_then(|v| std::str::from_utf8(v).ok()) {
                        out.push_str(s);
                    }
                    consumed += valid;
                    match e.error_len() {
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            consumed += bad;
                        }
                        None => break, // an incomplete character: wait for more bytes
                    }
                }
            }
        }
        self.pending.drain(..consumed.min(self.pending.len()));
        out
    }
}
