//! Tokenizer rules on small hand-made vocabularies, and malformed metadata.

use gguf::{GgufFile, GgufWriter};
use lockstep_text::{
    DecodeOptions, EncodeOptions, TextError, TokenKind, Tokenizer, TokenizerKind, VocabSpec,
};

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

/// A byte-level vocabulary: the 256 byte tokens, then `extra`.
fn byte_level(extra: &[&str]) -> Vec<String> {
    (0..=255u8)
        .map(|b| byte_char(b).to_string())
        .chain(extra.iter().map(|s| s.to_string()))
        .collect()
}

fn bpe(tokens: &[String], types: &[i32], merges: &[&str]) -> Tokenizer {
    let merges: Vec<String> = merges.iter().map(|s| s.to_string()).collect();
    Tokenizer::from_spec(&VocabSpec {
        model: "gpt2",
        pre: "qwen2",
        tokens,
        token_types: types,
        merges: &merges,
        ..VocabSpec::default()
    })
    .expect("builds")
}

fn ids(tok: &Tokenizer, texts: &[&str]) -> Vec<u32> {
    texts
        .iter()
        .map(|t| tok.token_to_id(t).expect("in vocab"))
        .collect()
}

const PLAIN: EncodeOptions = EncodeOptions {
    add_special: false,
    parse_special: false,
};
const PARSE: EncodeOptions = EncodeOptions {
    add_special: false,
    parse_special: true,
};

#[test]
fn bpe_merges_lowest_rank_first() {
    let tokens = byte_level(&["ab", "bc"]);
    let t = bpe(&tokens, &[], &["b c", "a b"]);
    assert_eq!(t.encode("abc", PLAIN), ids(&t, &["a", "bc"]));
    let t = bpe(&tokens, &[], &["a b", "b c"]);
    assert_eq!(t.encode("abc", PLAIN), ids(&t, &["ab", "c"]));
}

#[test]
fn bpe_merges_leftmost_first_among_equal_ranks() {
    let t = bpe(&byte_level(&["aa", "aaaa"]), &[], &["a a", "aa aa"]);
    assert_eq!(t.encode("aaa", PLAIN), ids(&t, &["aa", "a"]));
    assert_eq!(t.encode("aaaaa", PLAIN), ids(&t, &["aaaa", "a"]));
    // Words never merge across pre-tokenizer boundaries.
    assert_eq!(t.encode("a a", PLAIN), ids(&t, &["a", "Ġ", "a"]));
}

#[test]
fn bpe_never_forms_a_control_token_from_plain_text() {
    let mut tokens = byte_level(&["xy", "xyz", "<|x|>", "<tool>"]);
    let n = tokens.len();
    let mut types = vec![1; n];
    types[n - 3] = 3; // "xyz" is a control token that the merges would build
    types[n - 2] = 3; // "<|x|>" is a control token
    types[n - 1] = 4; // "<tool>" is user-defined
    tokens.push("zz".to_string());
    types.push(1);
    let t = bpe(&tokens, &types, &["x y", "xy z"]);
    let xyz = t.token_to_id("xyz").expect("control");
    let plain = t.encode("xyz", PLAIN);
    assert_eq!(plain, ids(&t, &["xy", "z"]));
    assert_eq!(t.decode(&plain).expect("decodes"), b"xyz");
    assert_eq!(t.encode("xyz", PARSE), [xyz]);

    let control = t.token_to_id("<|x|>").expect("control");
    let plain = t.encode("a<|x|>b", PLAIN);
    assert!(!plain.contains(&control));
    assert_eq!(t.decode(&plain).expect("decodes"), b"a<|x|>b");
    let parsed = t.encode("a<|x|>b", PARSE);
    assert_eq!(parsed, ids(&t, &["a", "<|x|>", "b"]));
    let skipped = t
        .decode_with(&parsed, DecodeOptions { skip_special: true })
        .expect("decodes");
    assert_eq!(skipped, b"ab");

    // User-defined tokens are matched even in plain text, and decode as their text.
    let tool = t.token_to_id("<tool>").expect("user-defined");
    assert_eq!(t.token_kind(tool), Some(TokenKind::UserDefined));
    assert_eq!(t.encode("x<tool>y", PLAIN), ids(&t, &["x", "<tool>", "y"]));
    assert!(!t.is_special(tool));
}

#[test]
fn longest_special_text_wins() {
    let mut tokens = byte_level(&["<a>", "<a><b>", "<b>"]);
    let mut types = vec![1; tokens.len()];
    let n = types.len();
    types[n - 3..].fill(3);
    tokens.push("zz".to_string());
    types.push(1);
    let t = bpe(&tokens, &types, &[]);
    assert_eq!(t.encode("<a><b>", PARSE), ids(&t, &["<a><b>"]));
    assert_eq!(
        t.encode("<b><a><b><a>", PARSE),
        ids(&t, &["<b>", "<a><b>", "<a>"])
    );
    assert_eq!(t.encode("x<a>y", PARSE), ids(&t, &["x", "<a>", "y"]));
}

/// A SentencePiece vocabulary: unk, bos, eos, the 256 byte tokens, then scored pieces.
fn spm(pieces: &[(&str, f32)], add_space_prefix: bool) -> Tokenizer {
    let mut tokens = vec!["<unk>".to_string(), "<s>".to_string(), "</s>".to_string()];
    let mut types = vec![2, 3, 3];
    let mut scores = vec![0.0, 0.0, 0.0];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    for &(p, s) in pieces {
        tokens.push(p.to_string());
        types.push(1);
        scores.push(s);
    }
    Tokenizer::from_spec(&VocabSpec {
        model: "llama",
        tokens: &tokens,
        token_types: &types,
        scores: Some(&scores),
        unk_id: Some(0),
        bos_id: Some(1),
        eos_id: Some(2),
        add_space_prefix: Some(add_space_prefix),
        ..VocabSpec::default()
    })
    .expect("builds")
}

const PIECES: &[(&str, f32)] = &[
    ("▁", -10.0),
    ("a", -5.0),
    ("b", -5.0),
    ("ab", -1.0),
    ("▁a", -2.0),
    ("▁ab", -3.0),
    ("<0", -4.0),
];

#[test]
fn spm_merges_highest_score_first_and_escapes_spaces() {
    let t = spm(PIECES, false);
    assert_eq!(t.kind(), TokenizerKind::SentencePiece);
    assert_eq!(t.encode("ab ab", PLAIN), ids(&t, &["ab", "▁ab"]));
    assert_eq!(
        t.decode(&t.encode("ab ab", PLAIN)).expect("decodes"),
        b"ab ab"
    );
    // BOS per metadata (SentencePiece default: add BOS).
    assert_eq!(t.encode("ab", EncodeOptions::raw_prompt())[0], 1);
}

#[test]
fn spm_falls_back_to_bytes_and_never_forms_byte_tokens_from_text() {
    let t = spm(PIECES, false);
    assert_eq!(t.encode("é", PLAIN), ids(&t, &["<0xC3>", "<0xA9>"]));
    let literal = t.encode("<0x41>", PLAIN);
    assert!(!literal.contains(&t.token_to_id("<0x41>").expect("byte")));
    assert_eq!(t.decode(&literal).expect("decodes"), b"<0x41>");
}

#[test]
fn spm_space_prefix_is_added_at_the_start_and_after_special_tokens() {
    let t = spm(PIECES, true);
    assert!(t.add_space_prefix());
    assert_eq!(t.encode("ab", PLAIN), ids(&t, &["▁ab"]));
    assert_eq!(t.encode("a</s>ab", PARSE), ids(&t, &["▁a", "</s>", "▁ab"]));
    // Decoding removes the prefix space again.
    assert_eq!(t.decode(&t.encode("ab", PLAIN)).expect("decodes"), b"ab");
    let mut s = t.stream_decoder(DecodeOptions::default());
    let first = s.push(t.token_to_id("▁ab").expect("piece")).expect("ok");
    assert_eq!(first, "ab");
}

/// Writes a GGUF file with the given metadata and opens it.
fn gguf_with(f: impl FnOnce(&mut GgufWriter) -> Result<(), gguf::WriteError>) -> GgufFile {
    let mut w = GgufWriter::new();
    f(&mut w).expect("metadata");
    GgufFile::from_bytes(w.to_bytes()).expect("opens")
}

fn byte_level_strs() -> Vec<String> {
    byte_level(&["ab"])
}

fn minimal_gpt2(w: &mut GgufWriter) -> Result<(), gguf::WriteError> {
    w.add("tokenizer.ggml.model", "gpt2")?;
    w.add("tokenizer.ggml.pre", "qwen2")?;
    w.add("tokenizer.ggml.tokens", byte_level_strs())?;
    w.add("tokenizer.ggml.merges", vec!["a b"])?;
    Ok(())
}

#[test]
fn from_gguf_reads_a_minimal_byte_level_vocabulary() {
    let file = gguf_with(|w| {
        minimal_gpt2(w)?;
        w.add("tokenizer.ggml.eos_token_id", 10u32)?;
        w.add("tokenizer.ggml.bos_token_id", 100_000u32)?; // out of range: ignored
        Ok(())
    });
    let t = Tokenizer::from_gguf(&file).expect("builds");
    assert_eq!(t.encode("ab", PLAIN), [256]);
    assert_eq!(t.eos_id(), Some(10));
    assert_eq!(t.bos_id(), None);
}

/// A byte-level vocabulary with every byte token and no `tokenizer.ggml.merges` (the DeepSeek
/// V4 reference fixtures) encodes byte by byte; without every byte token the merges are
/// still required.
#[test]
fn from_gguf_takes_a_complete_byte_vocabulary_without_merges() {
    let file = gguf_with(|w| {
        w.add("tokenizer.ggml.model", "gpt2")?;
        w.add("tokenizer.ggml.pre", "gpt2")?;
        let mut tokens = vec!["<s>".to_string(), "</s>".to_string()];
        tokens.extend(byte_level(&[]));
        w.add("tokenizer.ggml.tokens", tokens)?;
        let mut types = vec![3i32, 3];
        types.extend([1i32; 256]);
        w.add("tokenizer.ggml.token_type", types)?;
        w.add("tokenizer.ggml.bos_token_id", 0u32)?;
        w.add("tokenizer.ggml.eos_token_id", 1u32)?;
        Ok(())
    });
    let t = Tokenizer::from_gguf(&file).expect("builds");
    let text = "Hé, 1+1";
    let want: Vec<u32> = text
        .bytes()
        .map(|b| t.token_to_id(&byte_char(b).to_string()).unwrap())
        .collect();
    assert_eq!(want.len(), text.len());
    assert_eq!(t.encode(text, PLAIN), want);
    assert_eq!(t.decode(&want).unwrap(), text.as_bytes());
    assert_eq!(t.eos_id(), Some(1));
    let partial = gguf_with(|w| {
        w.add("tokenizer.ggml.model", "gpt2")?;
        w.add("tokenizer.ggml.pre", "gpt2")?;
        let mut tokens = byte_level(&[]);
        tokens.pop();
        w.add("tokenizer.ggml.tokens", tokens)?;
        Ok(())
    });
    assert!(matches!(
        Tokenizer::from_gguf(&partial),
        Err(TextError::Gguf(_))
    ));
}

#[test]
fn from_gguf_reads_integer_scores_and_sentencepiece() {
    let file = gguf_with(|w| {
        w.add("tokenizer.ggml.model", "llama")?;
        let mut tokens = vec!["<unk>".to_string()];
        tokens.extend(["a", "b", "ab"].map(String::from));
        w.add("tokenizer.ggml.tokens", tokens)?;
        w.add("tokenizer.ggml.scores", vec![0i32, -5, -5, -1])?;
        w.add("tokenizer.ggml.token_type", vec![2i32, 1, 1, 1])?;
        w.add("tokenizer.ggml.unknown_token_id", 0u32)?;
        w.add("tokenizer.ggml.add_bos_token", false)?;
        Ok(())
    });
    let t = Tokenizer::from_gguf(&file).expect("builds");
    // add_space_prefix defaults to true for SentencePiece. "▁" is no piece and there are
    // no byte tokens: each of its three bytes becomes <unk>.
    assert_eq!(t.encode("ab", PLAIN), [0, 0, 0, 3]);
}

#[test]
fn malformed_metadata_is_an_error() {
    let err = |f: fn(&mut GgufWriter) -> Result<(), gguf::WriteError>| {
        Tokenizer::from_gguf(&gguf_with(f)).expect_err("rejected")
    };
    assert!(matches!(
        err(|w| {
            w.add("tokenizer.ggml.model", "gpt2")?;
            Ok(())
        }),
        TextError::Gguf(_)
    ));
    assert!(matches!(
        err(|w| {
            w.add("tokenizer.ggml.model", "gpt2")?;
            w.add("tokenizer.ggml.tokens", vec![1i32, 2])?;
            Ok(())
        }),
        TextError::WrongType { .. }
    ));
    assert!(matches!(
        err(|w| {
            minimal_gpt2(w)?;
            w.add("tokenizer.ggml.token_type", vec![1i32; 3])?;
            Ok(())
        }),
        TextError::LengthMismatch { .. }
    ));
    assert!(matches!(
        err(|w| {
            w.add("tokenizer.ggml.model", "bert")?;
            w.add("tokenizer.ggml.tokens", vec!["a"])?;
            Ok(())
        }),
        TextError::UnsupportedModel(_)
    ));
    assert!(matches!(
        err(|w| {
            w.add("tokenizer.ggml.model", "gpt2")?;
            w.add("tokenizer.ggml.pre", "default")?;
            w.add("tokenizer.ggml.tokens", vec!["a"])?;
            w.add("tokenizer.ggml.merges", Vec::<String>::new())?;
            Ok(())
        }),
        TextError::UnsupportedPreTokenizer(_)
    ));
    assert!(matches!(
        err(|w| {
            w.add("tokenizer.ggml.model", "gpt2")?;
            w.add("tokenizer.ggml.pre", "qwen2")?;
            w.add("tokenizer.ggml.tokens", vec!["a"])?;
            Ok(())
        }),
        TextError::Gguf(_)
    ));
    assert!(matches!(
        err(|w| {
            minimal_gpt2(w)?;
            w.add("tokenizer.ggml.add_bos_token", true)?;
            Ok(())
        }),
        TextError::MissingSpecialToken(_)
    ));
    assert!(matches!(
        err(|w| {
            minimal_gpt2(w)?;
            w.add("tokenizer.ggml.add_bos_token", 1u32)?;
            Ok(())
        }),
        TextError::WrongType { .. }
    ));
    assert!(matches!(
        err(|w| {
            w.add("tokenizer.ggml.model", "llama")?;
            w.add("tokenizer.ggml.tokens", vec!["a", "b"])?;
            Ok(())
        }),
        TextError::MissingByteFallback(_)
    ));
    assert!(matches!(
        err(|w| {
            w.add("tokenizer.ggml.model", "gpt2")?;
            w.add("tokenizer.ggml.pre", "qwen2")?;
            w.add("tokenizer.ggml.tokens", vec!["a", "b", "a"])?;
            w.add("tokenizer.ggml.merges", Vec::<String>::new())?;
            Ok(())
        }),
        TextError::DuplicateToken {
            first: 0,
            second: 2,
            ..
        }
    ));
    assert!(matches!(
        err(|w| {
            w.add("tokenizer.ggml.model", "gpt2")?;
            w.add("tokenizer.ggml.tokens", Vec::<String>::new())?;
            w.add("tokenizer.ggml.merges", Vec::<String>::new())?;
            Ok(())
        }),
        TextError::EmptyVocab
    ));
}

#[test]
fn from_spec_rejects_special_ids_outside_the_vocabulary() {
    let tokens = byte_level(&[]);
    let r = Tokenizer::from_spec(&VocabSpec {
        model: "gpt2",
        pre: "qwen2",
        tokens: &tokens,
        eos_id: Some(256),
        ..VocabSpec::default()
    });
    assert!(matches!(
        r,
        Err(TextError::SpecialIdOutOfRange { id: 256, .. })
    ));
}
