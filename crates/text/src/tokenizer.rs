//! The tokenizer: construction from a [`VocabSpec`], encoding, decoding and token facts.

use std::ops::Range;

use crate::bpe::{Bpe, BpeScratch};
use crate::error::TextError;
use crate::pretokenize::PreTokenizer;
use crate::special::{Fragment, SpecialTokens};
use crate::spm::{Spm, SpmScratch};
use crate::stream::StreamDecoder;
use crate::unicode::char_to_byte;
use crate::vocab::{TokenKind, Vocab, VocabSpec};

/// SentencePiece's escaped space, U+2581.
const SPM_SPACE: char = '\u{2581}';

/// Control-token texts that end a turn or a document. A control token with one of these
/// texts is an end-of-generation id besides the metadata's EOS/EOT/EOM (see
/// [`Tokenizer::eos_ids`]).
const END_OF_GENERATION_TEXTS: &[&str] = &[
    "<|im_end|>",
    "<|endoftext|>",
    "<end_of_turn>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<|end_of_text|>",
    "<eos>",
    "</s>",
    "<EOT>",
];

/// Which algorithm a tokenizer uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerKind {
    /// GPT-2-style byte-level BPE (`tokenizer.ggml.model = "gpt2"`).
    ByteLevelBpe,
    /// SentencePiece-style BPE over scores (`tokenizer.ggml.model = "llama"`).
    SentencePiece,
}

/// How to encode a text.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EncodeOptions {
    /// Add BOS/EOS as the metadata says (`add_bos_token`, `add_eos_token`).
    pub add_special: bool,
    /// Recognise control-token texts (such as `<|im_start|>`) in the text as the control
    /// tokens. Off for user-supplied text: there they are plain text.
    pub parse_special: bool,
}

impl EncodeOptions {
    /// A raw prompt or a rendered chat template: BOS per metadata, control texts parsed.
    pub fn raw_prompt() -> EncodeOptions {
        EncodeOptions {
            add_special: true,
            parse_special: true,
        }
    }

    /// Text from a user or a message body: no BOS, control texts stay text.
    pub fn plain_text() -> EncodeOptions {
        EncodeOptions {
            add_special: false,
            parse_special: false,
        }
    }
}

/// How to decode token ids.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeOptions {
    /// Leave out control, unknown and unused tokens instead of rendering their text.
    pub skip_special: bool,
}

#[derive(Debug)]
enum Model {
    Bpe(Bpe),
    Spm(Spm),
}

/// A tokenizer built from GGUF tokenizer metadata. Immutable and `Sync`; one per model.
#[derive(Debug)]
pub struct Tokenizer {
    vocab: Vocab,
    model: Model,
    specials: SpecialTokens,
    /// `bytes[offsets[id]..offsets[id + 1]]` is what token `id` stands for.
    bytes: Vec<u8>,
    offsets: Vec<usize>,
    bos: Option<u32>,
    eos: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    eos_ids: Vec<u32>,
    never_sample: Vec<u32>,
    never_sample_mask: Vec<bool>,
}

impl Tokenizer {
    /// Builds a tokenizer from a plain-data vocabulary description.
    pub fn from_spec(spec: &VocabSpec<'_>) -> Result<Tokenizer, TextError> {
        let vocab = Vocab::new(spec)?;
        let n = vocab.len();
        let check = |what: &'static str, id: Option<u32>| -> Result<Option<u32>, TextError> {
            match id {
                Some(id) if id as usize >= n => Err(TextError::SpecialIdOutOfRange {
                    what,
                    id,
                    vocab_size: n,
                }),
                other => Ok(other),
            }
        };
        let bos = check("BOS", spec.bos_id)?;
        let eos = check("EOS", spec.eos_id)?;
        let eot = check("EOT", spec.eot_id)?;
        let eom = check("EOM", spec.eom_id)?;
        let unk = check("UNK", spec.unk_id)?;
        let pad = check("PAD", spec.pad_id)?;

        let (model, default_add_bos, default_space_prefix) = match spec.model {
            "gpt2" => {
                let (pre, ignore_merges) = PreTokenizer::from_name(spec.pre)
                    .ok_or_else(|| TextError::UnsupportedPreTokenizer(spec.pre.to_string()))?;
                let add_bos =
                    matches!(pre, PreTokenizer::Llama3Like { max_digits: 3 }) && ignore_merges;
                let bpe = Bpe::new(&vocab, spec.merges, pre, ignore_merges);
                (Model::Bpe(bpe), add_bos, false)
            }
            "llama" => (Model::Spm(Spm::new(&vocab, unk)?), true, true),
            other => return Err(TextError::UnsupportedModel(other.to_string())),
        };
        let add_bos = spec.add_bos.unwrap_or(default_add_bos);
        let add_eos = spec.add_eos.unwrap_or(false);
        let add_space_prefix = match model {
            Model::Bpe(_) => false,
            Model::Spm(_) => spec.add_space_prefix.unwrap_or(default_space_prefix),
        };
        if add_bos && bos.is_none() {
            return Err(TextError::MissingSpecialToken("add_bos_token"));
        }
        if add_eos && eos.is_none() {
            return Err(TextError::MissingSpecialToken("add_eos_token"));
        }

        let is_spm = matches!(model, Model::Spm(_));
        let mut bytes = Vec::new();
        let mut offsets = Vec::with_capacity(n + 1);
        offsets.push(0);
        for (text, &kind) in vocab.texts().zip(&vocab.kinds) {
            token_bytes_into(text, kind, is_spm, &mut bytes);
            offsets.push(bytes.len());
        }

        let mut eos_ids: Vec<u32> = [eos, eot, eom].into_iter().flatten().collect();
        for (id, (text, &kind)) in vocab.texts().zip(&vocab.kinds).enumerate() {
            if kind == TokenKind::Control && END_OF_GENERATION_TEXTS.contains(&text) {
                eos_ids.push(id as u32);
            }
        }
        eos_ids.sort_unstable();
        eos_ids.dedup();

        let mut never_sample_mask: Vec<bool> = vocab
            .texts()
            .zip(&vocab.kinds)
            .map(|(text, &kind)| {
                kind == TokenKind::Unused || (kind == TokenKind::Control && text.contains("unused"))
            })
            .collect();
        if let Some(p) = pad
            && Some(p) != bos
            && eos_ids.binary_search(&p).is_err()
            && let Some(slot) = never_sample_mask.get_mut(p as usize)
        {
            *slot = true;
        }
        let never_sample = never_sample_mask
            .iter()
            .enumerate()
            .filter_map(|(i, &m)| m.then_some(i as u32))
            .collect();

        let specials = SpecialTokens::new(&vocab);
        Ok(Tokenizer {
            vocab,
            model,
            specials,
            bytes,
            offsets,
            bos,
            eos,
            unk,
            pad,
            add_bos,
            add_eos,
            add_space_prefix,
            eos_ids,
            never_sample,
            never_sample_mask,
        })
    }

    /// Encodes `text` into token ids.
    pub fn encode(&self, text: &str, opts: EncodeOptions) -> Vec<u32> {
        let frags = self
            .specials
            .partition(&self.vocab, text, opts.parse_special);
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if opts.add_special
            && self.add_bos
            && let Some(b) = self.bos
        {
            out.push(b);
        }
        match &self.model {
            Model::Bpe(bpe) => {
                let mut words: Vec<Range<usize>> = Vec::new();
                let mut scratch = BpeScratch::default();
                for f in frags {
                    match f {
                        Fragment::Token(id) => out.push(id),
                        Fragment::Text(a, b) => {
                            let Some(frag) = text.get(a..b) else { continue };
                            words.clear();
                            bpe.pre.split(frag, &mut words);
                            for w in &words {
                                if let Some(word) = frag.as_bytes().get(w.clone()) {
                                    bpe.encode_word(&self.vocab, word, &mut out, &mut scratch);
                                }
                            }
                        }
                    }
                }
            }
            Model::Spm(spm) => {
                let mut scratch = SpmScratch::default();
                let mut escaped = String::new();
                let mut prev_special = true;
                for f in frags {
                    match f {
                        Fragment::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                        Fragment::Text(a, b) => {
                            let Some(frag) = text.get(a..b) else { continue };
                            escaped.clear();
                            if self.add_space_prefix && prev_special {
                                escaped.push(SPM_SPACE);
                            }
                            for c in frag.chars() {
                                escaped.push(if c == ' ' { SPM_SPACE } else { c });
                            }
                            spm.encode(&self.vocab, &escaped, &mut out, &mut scratch);
                            prev_special = false;
                        }
                    }
                }
            }
        }
        if opts.add_special
            && self.add_eos
            && let Some(e) = self.eos
        {
            out.push(e);
        }
        out
    }

    /// Decodes ids to bytes, rendering special tokens as their text.
    pub fn decode(&self, ids: &[u32]) -> Result<Vec<u8>, TextError> {
        self.decode_with(ids, DecodeOptions::default())
    }

    /// Decodes ids to bytes.
    ///
    /// The result is the concatenation of the tokens' bytes, except that special tokens
    /// are left out with `skip_special`, and that for a SentencePiece vocabulary with
    /// `add_space_prefix` the first token loses one leading space (llama.cpp's rule).
    pub fn decode_with(&self, ids: &[u32], opts: DecodeOptions) -> Result<Vec<u8>, TextError> {
        let mut out = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            out.extend_from_slice(self.piece(id, opts, i == 0, ids.first().copied())?);
        }
        Ok(out)
    }

    /// Decodes ids to a string, invalid UTF-8 replaced by U+FFFD.
    pub fn decode_lossy(&self, ids: &[u32], opts: DecodeOptions) -> Result<String, TextError> {
        let bytes = self.decode_with(ids, opts)?;
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    /// A streaming decoder over this tokenizer.
    pub fn stream_decoder(&self, opts: DecodeOptions) -> StreamDecoder<'_> {
        StreamDecoder::new(self, opts)
    }

    /// The bytes token `id` contributes at position `first` of a decode that starts with
    /// `first_id`.
    pub(crate) fn piece(
        &self,
        id: u32,
        opts: DecodeOptions,
        first: bool,
        first_id: Option<u32>,
    ) -> Result<&[u8], TextError> {
        let bytes = self.token_bytes(id).ok_or(TextError::UnknownTokenId {
            id,
            vocab_size: self.vocab.len(),
        })?;
        if opts.skip_special && self.is_special(id) {
            return Ok(&[]);
        }
        let bos_first_skipped =
            opts.skip_special && self.add_bos && first_id.is_some() && first_id == self.bos;
        if first && self.add_space_prefix && !bos_first_skipped {
            return Ok(bytes.strip_prefix(b" ").unwrap_or(bytes));
        }
        Ok(bytes)
    }

    /// The bytes token `id` stands for: GPT-2 byte mapping undone, `▁` as space, `<0xNN>`
    /// as its byte; control, unknown, unused and user-defined tokens give their literal text
    /// (check [`Tokenizer::is_special`]). `None` outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        let i = id as usize;
        let (a, b) = (*self.offsets.get(i)?, *self.offsets.get(i + 1)?);
        self.bytes.get(a..b)
    }

    /// The token's text as stored in the vocabulary (byte-level or `▁`-escaped form).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.vocab.text(id)
    }

    /// The id of the token whose vocabulary text is exactly `text`.
    pub fn token_to_id(&self, text: &str) -> Option<u32> {
        self.vocab.id_of(text)
    }

    /// What kind of entry token `id` is.
    pub fn token_kind(&self, id: u32) -> Option<TokenKind> {
        self.vocab.kind(id)
    }

    /// Whether token `id` is a marker rather than text: control, unknown or unused.
    /// User-defined tokens are text. Ids outside the vocabulary are not special.
    pub fn is_special(&self, id: u32) -> bool {
        self.vocab.kind(id).is_some_and(TokenKind::is_special)
    }

    /// Ids that must never be sampled, ascending: unused/padding entries (such as Qwen's
    /// `[PAD151665]`…), control tokens named `unused` (gemma's `<unused0>`…), and the padding
    /// token when it is not also BOS or an end-of-generation token. Logit rows wider than
    /// [`Tokenizer::vocab_size`] must also exclude the ids past the vocabulary.
    pub fn never_sample_ids(&self) -> &[u32] {
        &self.never_sample
    }

    /// Whether `id` must never be sampled (ids past the vocabulary included).
    pub fn is_never_sample(&self, id: u32) -> bool {
        self.never_sample_mask
            .get(id as usize)
            .copied()
            .unwrap_or(true)
    }

    /// Ids that end generation, ascending: the metadata's EOS (and EOT/EOM when given),
    /// plus every *control* token whose text marks the end of a turn or document
    /// (`<|im_end|>`, `<|endoftext|>`, `<end_of_turn>`, `<|eot_id|>`, `<eos>`, `</s>`, …).
    ///
    /// Why the extra ones: chat models end a reply with their end-of-turn marker, which the
    /// GGUF often does not name as EOS (gemma: EOS `<eos>`, turns end with
    /// `<end_of_turn>`), and a base model ends a document with `<|endoftext|>` even when EOS
    /// is `<|im_end|>` (Qwen, SmolLM2). llama.cpp stops on the same tokens. Requiring the
    /// control type keeps look-alike text tokens out (gemma's user-defined `</s>` is an
    /// HTML tag). Unlike llama.cpp, FIM markers (`<|file_sep|>`…) are not included: they end
    /// generation only in fill-in-the-middle use, which a caller can add.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Whether `id` ends generation.
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_ids.binary_search(&id).is_ok()
    }

    /// The BOS id from the metadata.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// The EOS id from the metadata.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// The unknown-token id from the metadata.
    pub fn unk_id(&self) -> Option<u32> {
        self.unk
    }

    /// The padding id from the metadata.
    pub fn pad_id(&self) -> Option<u32> {
        self.pad
    }

    /// Whether encoding with `add_special` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether encoding with `add_special` appends EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// Whether SentencePiece encoding prefixes a space to text at the start and after
    /// special tokens (always false for byte-level BPE).
    pub fn add_space_prefix(&self) -> bool {
        self.add_space_prefix
    }

    /// Bytes that no token stands for, ascending. Byte-level BPE vocabularies may lack
    /// some (SmolLM2 has no token for 0x04, 0x06, 0x13, 0x14, 0x16, 0x1D and some bytes
    /// that never occur in UTF-8); encoding drops them, as llama.cpp does, so text with
    /// them does not round-trip. Empty for SentencePiece (byte fallback).
    pub fn bytes_without_token(&self) -> &[u8] {
        match &self.model {
            Model::Bpe(bpe) => &bpe.missing_bytes,
            Model::Spm(_) => &[],
        }
    }

    /// The number of vocabulary entries (logit rows may be as wide or wider).
    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// The algorithm this tokenizer uses.
    pub fn kind(&self) -> TokenizerKind {
        match self.model {
            Model::Bpe(_) => TokenizerKind::ByteLevelBpe,
            Model::Spm(_) => TokenizerKind::SentencePiece,
        }
    }
}

/// Appends what a vocabulary entry stands for.
fn token_bytes_into(text: &str, kind: TokenKind, is_spm: bool, out: &mut Vec<u8>) {
    match kind {
        TokenKind::Normal if is_spm => {
            for c in text.chars() {
                let c = if c == SPM_SPACE { ' ' } else { c };
                out.extend_from_slice(c.encode_utf8(&mut [0u8; 4]).as_bytes());
            }
        }
        TokenKind::Normal => {
            for c in text.chars() {
                match char_to_byte(c) {
                    Some(b) => out.push(b),
                    None => out.extend_from_slice(c.encode_utf8(&mut [0u8; 4]).as_bytes()),
                }
            }
        }
        TokenKind::Byte => match parse_byte_token(text) {
            Some(b) => out.push(b),
            None => out.extend_from_slice(text.as_bytes()),
        },
        _ => out.extend_from_slice(text.as_bytes()),
    }
}

/// The byte of a `<0xNN>` token.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}
