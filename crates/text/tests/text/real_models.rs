//! The tokenizers of the real models, loaded through `Tokenizer::from_gguf`, against
//! llama.cpp's reference tokenizations and the encode/decode contracts.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use lockstep_text::{DecodeOptions, EncodeOptions, TokenKind, Tokenizer, TokenizerKind};
use proptest::prelude::*;

const SMOLLM: &str = "smollm2-135m";
const QWEN: &str = "qwen2.5-coder-0.5b";
const QWEN_LARGE: &str = "qwen2.5-coder-1.5b";
const GEMMA: &str = "gemma3-270m";

/// CPU time this thread has run (from `/proc/thread-self/schedstat`; zero where absent):
/// the tests share two cores with other work, so wall time alone overstates costs.
fn thread_cpu_time() -> Duration {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .map_or(Duration::ZERO, Duration::from_nanos)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn load_timed(name: &str) -> Tokenizer {
    let path = hub::ensure_model(name).expect("model in cache");
    let (w0, c0) = (Instant::now(), thread_cpu_time());
    let file = gguf::GgufFile::open(&path).expect("GGUF opens");
    let (w1, c1) = (Instant::now(), thread_cpu_time());
    let tok = Tokenizer::from_gguf(&file).expect("tokenizer builds");
    let (w2, c2) = (Instant::now(), thread_cpu_time());
    println!(
        "[timing] {name}: {} tokens; GgufFile::open {:.1} ms wall / {:.1} ms cpu; \
         Tokenizer::from_gguf {:.1} ms wall / {:.1} ms cpu",
        tok.vocab_size(),
        ms(w1 - w0),
        ms(c1 - c0),
        ms(w2 - w1),
        ms(c2 - c1),
    );
    tok
}

fn tokenizer(name: &str) -> &'static Tokenizer {
    static SMOLLM_T: OnceLock<Tokenizer> = OnceLock::new();
    static QWEN_T: OnceLock<Tokenizer> = OnceLock::new();
    static GEMMA_T: OnceLock<Tokenizer> = OnceLock::new();
    let cell = match name {
        SMOLLM => &SMOLLM_T,
        QWEN => &QWEN_T,
        GEMMA => &GEMMA_T,
        other => panic!("no shared tokenizer for {other}"),
    };
    cell.get_or_init(|| load_timed(name))
}

/// This crate's `tests/data/golden` (made by `tools/golden/make.py`).
const GOLDEN_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/golden");

fn read_json(file: &str) -> serde_json::Value {
    let path = PathBuf::from(GOLDEN_DIR).join(file);
    let raw = std::fs::read_to_string(&path).expect("golden file readable");
    serde_json::from_str(&raw).expect("golden JSON")
}

/// `(text, reference ids)` pairs: the strings of `strings.json` and, in the same order, the
/// reference tokenization of each in `<reference>.json`.
fn golden(reference: &str) -> Vec<(String, Vec<u32>)> {
    let strings = read_json("strings.json");
    let strings = strings.as_array().expect("a list of strings");
    let tokens = read_json(&format!("{reference}.json"));
    let tokens = tokens["tokens"]
        .as_array()
        .expect("a list of tokenizations");
    assert_eq!(strings.len(), tokens.len(), "one tokenization per string");
    strings
        .iter()
        .zip(tokens)
        .map(|(text, ids)| {
            let text = text.as_str().expect("text").to_string();
            let ids = ids
                .as_array()
                .expect("ids")
                .iter()
                .map(|t| t.as_u64().expect("id") as u32)
                .collect();
            (text, ids)
        })
        .collect()
}

/// Encodes every golden string as llama.cpp did (no BOS, control texts parsed) and
/// reports mismatches.
fn check_golden(model: &str, reference: &str) {
    let tok = tokenizer(model);
    let cases = golden(reference);
    assert!(cases.len() > 1900, "golden set is complete");
    let opts = EncodeOptions {
        add_special: false,
        parse_special: true,
    };
    let (w0, c0) = (Instant::now(), thread_cpu_time());
    let ours: Vec<Vec<u32>> = cases
        .iter()
        .map(|(text, _)| tok.encode(text, opts))
        .collect();
    let (wall, cpu) = (w0.elapsed(), thread_cpu_time() - c0);
    let mut mismatches = Vec::new();
    for ((text, want), got) in cases.iter().zip(&ours) {
        if got != want {
            mismatches.push(format!("{text:?}\n  want {want:?}\n  got  {got:?}"));
        }
    }
    println!(
        "[golden] {model} vs {reference}: {}/{} match; encoding all took {:.1} ms wall / {:.1} ms cpu",
        cases.len() - mismatches.len(),
        cases.len(),
        ms(wall),
        ms(cpu),
    );
    assert!(
        mismatches.is_empty(),
        "{} mismatches, first ones:\n{}",
        mismatches.len(),
        mismatches
            .iter()
            .take(5)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn smollm2_encodes_every_golden_string_like_llama_cpp() {
    check_golden(SMOLLM, "smollm2-135m");
}

#[test]
fn qwen_coder_0_5b_encodes_every_golden_string_like_the_1_5b_reference() {
    check_golden(QWEN, "qwen2.5-coder-1.5b");
}

#[test]
fn gemma3_encodes_every_golden_string_like_llama_cpp() {
    check_golden(GEMMA, "gemma3-270m");
}

#[test]
fn qwen_coder_1_5b_file_gives_the_same_tokenizer_as_0_5b() {
    let big = load_timed(QWEN_LARGE);
    let small = tokenizer(QWEN);
    assert_eq!(big.vocab_size(), small.vocab_size());
    for id in (0..big.vocab_size() as u32)
        .step_by(97)
        .chain(151_640..151_936)
    {
        assert_eq!(big.token_text(id), small.token_text(id), "id {id}");
        assert_eq!(big.token_kind(id), small.token_kind(id), "id {id}");
    }
    assert_eq!(big.eos_ids(), small.eos_ids());
    assert_eq!(big.never_sample_ids(), small.never_sample_ids());
    let text = "def f(x):\n    return x ** 2  # 平方\n<|im_start|>";
    let opts = EncodeOptions::raw_prompt();
    assert_eq!(big.encode(text, opts), small.encode(text, opts));
}

/// Chat markers typed by a user stay text; the same marker parsed as special is the
/// control token.
fn check_marker_parsing(model: &str, marker: &str) {
    let tok = tokenizer(model);
    let id = tok.token_to_id(marker).expect("marker in vocab");
    assert_eq!(tok.token_kind(id), Some(TokenKind::Control));
    let text = format!("hello {marker}user\nhi");
    let parsed = tok.encode(&text, EncodeOptions::raw_prompt());
    assert!(
        parsed.contains(&id),
        "{model}: parse_special recognises {marker}"
    );
    let plain = tok.encode(&text, EncodeOptions::plain_text());
    assert!(
        plain.iter().all(|&t| !tok.is_special(t)),
        "{model}: no special token from plain text: {plain:?}"
    );
    assert_eq!(
        tok.decode(&plain).expect("decodes"),
        text.as_bytes(),
        "{model}: marker text round-trips as text"
    );
    let skipped = tok
        .decode_with(&parsed, DecodeOptions { skip_special: true })
        .expect("decodes");
    assert!(!String::from_utf8_lossy(&skipped).contains(marker));
}

#[test]
fn chat_markers_in_message_text_are_plain_text_unless_special_parsing_is_on() {
    check_marker_parsing(QWEN, "<|im_start|>");
    check_marker_parsing(QWEN, "<|im_end|>");
    check_marker_parsing(SMOLLM, "<|im_start|>");
    check_marker_parsing(GEMMA, "<start_of_turn>");
    check_marker_parsing(GEMMA, "<end_of_turn>");
}

#[test]
fn bos_is_added_per_metadata() {
    let gemma = tokenizer(GEMMA);
    assert_eq!(gemma.kind(), TokenizerKind::SentencePiece);
    assert_eq!(gemma.bos_id(), Some(2));
    assert!(gemma.add_bos() && !gemma.add_space_prefix());
    let ids = gemma.encode("Hi", EncodeOptions::raw_prompt());
    assert_eq!(ids.first(), Some(&2));
    assert_eq!(&ids[1..], gemma.encode("Hi", EncodeOptions::plain_text()));
    for name in [SMOLLM, QWEN] {
        let tok = tokenizer(name);
        assert_eq!(tok.kind(), TokenizerKind::ByteLevelBpe);
        assert!(!tok.add_bos());
        assert_eq!(
            tok.encode("Hi", EncodeOptions::raw_prompt()),
            tok.encode("Hi", EncodeOptions::plain_text())
        );
    }
}

#[test]
fn special_ids_follow_the_metadata() {
    let smol = tokenizer(SMOLLM);
    assert_eq!((smol.bos_id(), smol.eos_id()), (Some(1), Some(2)));
    assert_eq!(smol.vocab_size(), 49152);
    // EOS <|im_end|> plus <|endoftext|>.
    assert_eq!(smol.eos_ids(), [0, 2]);
    assert!(smol.never_sample_ids().is_empty());
    assert_eq!(
        smol.bytes_without_token(),
        [
            0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, 0xF5, 0xF6, 0xF7, 0xF8,
            0xF9, 0xFA, 0xFB, 0xFC, 0xFD, 0xFE, 0xFF
        ]
    );
    let dropped = smol.encode("a\u{4}b", EncodeOptions::plain_text());
    assert_eq!(smol.decode(&dropped).expect("decodes"), b"ab");

    let qwen = tokenizer(QWEN);
    assert_eq!(
        (qwen.bos_id(), qwen.eos_id(), qwen.pad_id()),
        (Some(151643), Some(151645), Some(151643))
    );
    assert_eq!(qwen.vocab_size(), 151936);
    assert_eq!(qwen.eos_ids(), [151643, 151645]);
    // The [PADnnnnnn] entries past the real vocabulary, and nothing else.
    assert_eq!(
        qwen.never_sample_ids(),
        (151665..151936).collect::<Vec<u32>>()
    );
    assert_eq!(qwen.token_text(151665), Some("[PAD151665]"));
    assert!(qwen.is_never_sample(151935) && qwen.is_never_sample(151936));
    assert!(!qwen.is_never_sample(151643));
    assert_eq!(qwen.token_kind(151657), Some(TokenKind::UserDefined)); // <tool_call>

    let gemma = tokenizer(GEMMA);
    assert_eq!(
        (
            gemma.bos_id(),
            gemma.eos_id(),
            gemma.unk_id(),
            gemma.pad_id()
        ),
        (Some(2), Some(1), Some(3), Some(0))
    );
    assert_eq!(gemma.vocab_size(), 262144);
    assert_eq!(gemma.eos_ids(), [1, 106]);
    let never = gemma.never_sample_ids();
    assert!(never.contains(&0), "<pad>");
    assert!(never.contains(&6) && never.contains(&262143), "<unusedN>");
    assert!(!never.contains(&1) && !never.contains(&106) && !never.contains(&2));
    assert_eq!(never.len(), 1 + 6242);
}

#[test]
fn token_bytes_undo_the_vocabulary_encodings() {
    let qwen = tokenizer(QWEN);
    let id = qwen.token_to_id("Ġworld").expect("token");
    assert_eq!(qwen.token_bytes(id), Some(&b" world"[..]));
    let nl = qwen.token_to_id("Ċ").expect("token");
    assert_eq!(qwen.token_bytes(nl), Some(&b"\n"[..]));
    let im_start = qwen.token_to_id("<|im_start|>").expect("token");
    assert_eq!(qwen.token_bytes(im_start), Some(&b"<|im_start|>"[..]));
    assert!(qwen.is_special(im_start));
    assert_eq!(qwen.token_bytes(151936), None);

    let gemma = tokenizer(GEMMA);
    let id = gemma.token_to_id("▁world").expect("token");
    assert_eq!(gemma.token_bytes(id), Some(&b" world"[..]));
    let byte = gemma.token_to_id("<0xE4>").expect("token");
    assert_eq!(gemma.token_kind(byte), Some(TokenKind::Byte));
    assert_eq!(gemma.token_bytes(byte), Some(&[0xE4u8][..]));
    let nl = gemma.token_to_id("\n").expect("token");
    assert_eq!(gemma.token_kind(nl), Some(TokenKind::UserDefined));
    assert_eq!(gemma.token_bytes(nl), Some(&b"\n"[..]));
    assert!(!gemma.is_special(nl));
}

#[test]
fn decoding_an_id_outside_the_vocabulary_is_an_error() {
    let smol = tokenizer(SMOLLM);
    assert!(smol.decode(&[49152]).is_err());
    let mut s = smol.stream_decoder(DecodeOptions::default());
    assert!(s.push(u32::MAX).is_err());
}

/// Strings mixing ASCII, multi-byte text, emoji, whitespace runs and marker look-alikes.
fn text_strategy() -> impl Strategy<Value = String> {
    const PIECES: &[&str] = &[
        "the",
        " cat",
        "'s",
        " ",
        "  ",
        "\n",
        "\n\n",
        "\t",
        "\r\n",
        "123",
        "4",
        "é",
        "ß",
        "中文",
        "日本語",
        "한국어",
        "👩‍💻",
        "😀",
        "\u{200B}",
        "\u{FEFF}",
        "\u{A0}",
        "!",
        "?!",
        "<|im_start|>",
        "<|im_end|>",
        "<start_of_turn>",
        "<0x0A>",
        "[PAD151665]",
        "<tool_call>",
        "<b>",
        "</s>",
        "fn main() {",
        "}",
        "\u{301}",
        "ــ",
        "x",
    ];
    prop::collection::vec(
        prop_oneof![
            4 => prop::sample::select(PIECES).prop_map(str::to_string),
            1 => any::<String>(),
        ],
        0..12,
    )
    .prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig {
        failure_persistence: None,
        ..ProptestConfig::with_cases(200)
    })]

    /// decode(encode(s)) == s for plain text, for every model. For gemma (SentencePiece,
    /// add_space_prefix false) the rule holds for any text without U+2581, which encoding
    /// maps to the same token as a space.
    #[test]
    fn plain_text_round_trips(text in text_strategy()) {
        for name in [SMOLLM, QWEN, GEMMA] {
            let tok = tokenizer(name);
            let text = if name == GEMMA { text.replace('\u{2581}', "_") } else { text.clone() };
            // Drop characters containing a byte the vocabulary has no token for.
            let missing = tok.bytes_without_token();
            let text: String = text
                .chars()
                .filter(|c| !c.encode_utf8(&mut [0u8; 4]).bytes().any(|b| missing.contains(&b)))
                .collect();
            let ids = tok.encode(&text, EncodeOptions::plain_text());
            prop_assert!(ids.iter().all(|&t| !tok.is_special(t)), "{}: special id from plain text", name);
            prop_assert_eq!(tok.decode(&ids).expect("decodes"), text.as_bytes(), "{}", name);
        }
    }

    /// Streaming deltas concatenate to the lossy decode of the whole sequence, for
    /// encodings of real text.
    #[test]
    fn stream_deltas_concatenate_to_decode_of_encodings(text in text_strategy(), skip in any::<bool>()) {
        for name in [SMOLLM, QWEN, GEMMA] {
            let tok = tokenizer(name);
            let ids = tok.encode(&text, EncodeOptions::raw_prompt());
            let opts = DecodeOptions { skip_special: skip };
            let mut dec = tok.stream_decoder(opts);
            let mut streamed = String::new();
            for &id in &ids {
                streamed.push_str(&dec.push(id).expect("in vocab"));
            }
            streamed.push_str(&dec.finish());
            prop_assert_eq!(streamed, tok.decode_lossy(&ids, opts).expect("decodes"), "{}", name);
        }
    }

    /// The same for arbitrary id sequences, which split characters and form invalid UTF-8
    /// (byte tokens, partial byte-level pieces): deltas never split a character and always
    /// concatenate to the lossy decode.
    #[test]
    fn stream_deltas_concatenate_to_decode_of_random_ids(
        picks in prop::collection::vec(any::<prop::sample::Index>(), 0..40),
        skip in any::<bool>(),
    ) {
        for name in [SMOLLM, QWEN, GEMMA] {
            let tok = tokenizer(name);
            // Mostly ids of short byte-ish tokens (multi-byte splits), some of any token.
            let n = tok.vocab_size();
            let ids: Vec<u32> = picks
                .iter()
                .enumerate()
                .map(|(i, p)| if i % 3 == 0 { p.index(n) as u32 } else { byteish(tok, p.index(512)) })
                .collect();
            let opts = DecodeOptions { skip_special: skip };
            let mut dec = tok.stream_decoder(opts);
            let mut streamed = String::new();
            for &id in &ids {
                let delta = dec.push(id).expect("in vocab");
                streamed.push_str(&delta);
            }
            streamed.push_str(&dec.finish());
            prop_assert_eq!(dec.pending_bytes(), 0);
            prop_assert_eq!(streamed, tok.decode_lossy(&ids, opts).expect("decodes"), "{}", name);
        }
    }
}

/// A token that stands for a single byte (GPT-2 byte tokens, `<0xNN>`), or a short token.
fn byteish(tok: &Tokenizer, k: usize) -> u32 {
    let b = (k % 256) as u8;
    let candidates = [
        format!("<0x{b:02X}>"),
        char::from_u32(if b.is_ascii_graphic() {
            u32::from(b)
        } else {
            256 + u32::from(b) % 68
        })
        .map(String::from)
        .unwrap_or_default(),
    ];
    candidates
        .iter()
        .find_map(|c| tok.token_to_id(c))
        .unwrap_or((k % tok.vocab_size()) as u32)
}

#[test]
fn stream_holds_back_a_split_character_until_it_is_complete() {
    let gemma = tokenizer(GEMMA);
    // "中" = E4 B8 AD as three byte-fallback tokens.
    let ids: Vec<u32> = ["<0xE4>", "<0xB8>", "<0xAD>"]
        .iter()
        .map(|t| gemma.token_to_id(t).expect("byte token"))
        .collect();
    let mut dec = gemma.stream_decoder(DecodeOptions::default());
    assert_eq!(dec.push(ids[0]).expect("ok"), "");
    assert_eq!(dec.push(ids[1]).expect("ok"), "");
    assert_eq!(dec.pending_bytes(), 2);
    assert_eq!(dec.push(ids[2]).expect("ok"), "中");
    // A lone continuation byte is invalid at once.
    assert_eq!(dec.push(ids[1]).expect("ok"), "\u{FFFD}");
    // An unfinished character at the end becomes one U+FFFD.
    assert_eq!(dec.push(ids[0]).expect("ok"), "");
    assert_eq!(dec.finish(), "\u{FFFD}");
}
