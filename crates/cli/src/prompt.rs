//! Turning what the user typed into prompt tokens.
//!
//! A raw prompt (`-p` without `--chat`) is tokenized as llama.cpp does: BOS per metadata,
//! control-token texts such as `<|im_start|>` parsed as the control tokens. A chat prompt
//! is rendered through the model's template, and then only the template's own text may
//! produce control tokens: message text is tokenized as plain text, so a user who types
//! `<|im_start|>` gets those characters, never the marker (DESIGN.md "Vocabulary").
//!
//! How the message text is found in the rendered prompt: the template is rendered a second
//! time with each message's content replaced by a placeholder that cannot occur in text;
//! putting the contents back into that render must give the real render byte for byte
//! (also accepted: the contents trimmed, for templates that `| trim` them). Then the
//! template text is partitioned at special-token texts the way llama.cpp's
//! `tokenizer_st_partition` does (longest text first, leftmost occurrences), the message
//! text is not, and each run of text between two special tokens is tokenized as one piece
//! — exactly the tokens llama.cpp would produce if it could tell the two kinds of text apart.

use anyhow::bail;
use chat::{ChatTemplate, Message, MessageContent};
use text::{EncodeOptions, TokenKind, Tokenizer};

/// Starts a placeholder (a noncharacter of plane 15's private use area).
const OPEN: char = '\u{FFFFE}';
/// Ends a placeholder.
const CLOSE: char = '\u{FFFFF}';

/// Tokenizes a raw prompt: BOS per metadata, control texts parsed (llama.cpp's default).
pub fn raw_prompt_tokens(tokenizer: &Tokenizer, prompt: &str) -> Vec<u32> {
    tokenizer.encode(prompt, EncodeOptions::raw_prompt())
}

/// A piece of a rendered chat prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    /// Text written by the template (may hold special-token texts).
    Template(String),
    /// Text of a message (always plain text).
    Message(String),
}

/// Renders `messages` with the generation prompt and tokenizes the result with message
/// text as plain text (see the module docs). BOS is prepended when the metadata asks for
/// it and the template did not write it.
pub fn chat_prompt_tokens(
    template: &ChatTemplate,
    tokenizer: &Tokenizer,
    messages: &[Message],
) -> anyhow::Result<Vec<u32>> {
    let pieces = render_pieces(template, messages)?;
    let mut tokens = tokenize_pieces(tokenizer, &pieces);
    if tokenizer.add_bos()
        && let Some(bos) = tokenizer.bos_id()
        && tokens.first() != Some(&bos)
    {
        tokens.insert(0, bos);
    }
    Ok(tokens)
}

/// The text content of a message (`None` for non-text content).
fn text_content(m: &Message) -> Option<&str> {
    match &m.content {
        Some(MessageContent::Text(t)) => Some(t),
        _ => None,
    }
}

/// Renders the conversation and splits the result into template and message pieces.
fn render_pieces(template: &ChatTemplate, messages: &[Message]) -> anyhow::Result<Vec<Piece>> {
    let real = template.render(messages, None, true, Default::default())?;
    let mut contents: Vec<&str> = Vec::with_capacity(messages.len());
    let mut with_placeholders = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let text = text_content(m).unwrap_or("");
        if text.contains(OPEN) || text.contains(CLOSE) {
            bail!("message {i} contains a reserved character (U+FFFFE or U+FFFFF)");
        }
        contents.push(text);
        let mut p = m.clone();
        if text_content(m).is_some() {
            p.content = Some(MessageContent::Text(format!("{OPEN}{i}{CLOSE}")));
        }
        with_placeholders.push(p);
    }
    let skeleton = template.render(&with_placeholders, None, true, Default::default())?;
    for trim in [false, true] {
        if let Some(pieces) = fill(&skeleton, &contents, trim)
            && concat(&pieces) == real
        {
            return Ok(pieces);
        }
    }
    bail!(
        "this model's chat template changes message text in a way lockstep cannot follow, so \
         the text cannot be kept apart from the template's control tokens"
    )
}

/// Replaces every placeholder of `skeleton` by its message's text (trimmed when `trim`);
/// `None` when a placeholder is malformed.
fn fill(skeleton: &str, contents: &[&str], trim: bool) -> Option<Vec<Piece>> {
    let mut pieces = Vec::new();
    let mut rest = skeleton;
    while let Some(open) = rest.find(OPEN) {
        let (before, after) = rest.split_at(open);
        if !before.is_empty() {
            pieces.push(Piece::Template(before.to_string()));
        }
        let after = after.strip_prefix(OPEN)?;
        let close = after.find(CLOSE)?;
        let index: usize = after.get(..close)?.parse().ok()?;
        let text = *contents.get(index)?;
        let text = if trim { text.trim() } else { text };
        if !text.is_empty() {
            pieces.push(Piece::Message(text.to_string()));
        }
        rest = after.get(close + CLOSE.len_utf8()..)?;
    }
    if rest.contains(CLOSE) {
        return None;
    }
    if !rest.is_empty() {
        pieces.push(Piece::Template(rest.to_string()));
    }
    Some(pieces)
}

fn concat(pieces: &[Piece]) -> String {
    pieces
        .iter()
        .map(|p| match p {
            Piece::Template(s) | Piece::Message(s) => s.as_str(),
        })
        .collect()
}

/// A piece after special-token partitioning.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Fragment {
    Token(u32),
    Template(String),
    Message(String),
}

/// The texts the raw-prompt tokenizer recognises as special tokens (control, unknown and
/// user-defined), in llama.cpp's matching order: longest text first, then lower id.
fn special_texts(tokenizer: &Tokenizer) -> Vec<(&str, u32)> {
    let n = u32::try_from(tokenizer.vocab_size()).unwrap_or(u32::MAX);
    let mut specials: Vec<(&str, u32)> = (0..n)
        .filter(|&id| {
            matches!(
                tokenizer.token_kind(id),
                Some(TokenKind::Control | TokenKind::Unknown | TokenKind::UserDefined)
            )
        })
        .filter_map(|id| {
            tokenizer
                .token_text(id)
                .filter(|t| !t.is_empty())
                .map(|t| (t, id))
        })
        .collect();
    specials.sort_by_key(|&(t, id)| (std::cmp::Reverse(t.len()), id));
    specials
}

/// Splits template text at special-token texts (each token in matching order splits every
/// remaining template fragment at its leftmost non-overlapping occurrences); message text
/// is left whole.
fn partition(tokenizer: &Tokenizer, pieces: &[Piece]) -> Vec<Fragment> {
    let mut frags: Vec<Fragment> = pieces
        .iter()
        .map(|p| match p {
            Piece::Template(s) => Fragment::Template(s.clone()),
            Piece::Message(s) => Fragment::Message(s.clone()),
        })
        .collect();
    for (special, id) in special_texts(tokenizer) {
        if !frags
            .iter()
            .any(|f| matches!(f, Fragment::Template(s) if s.contains(special)))
        {
            continue;
        }
        let mut next = Vec::with_capacity(frags.len() + 2);
        for f in frags {
            let Fragment::Template(s) = f else {
                next.push(f);
                continue;
            };
            let mut rest = s.as_str();
            while let Some(at) = rest.find(special) {
                if at > 0 {
                    next.push(Fragment::Template(rest[..at].to_string()));
                }
                next.push(Fragment::Token(id));
                rest = &rest[at + special.len()..];
            }
            if !rest.is_empty() {
                next.push(Fragment::Template(rest.to_string()));
            }
        }
        frags = next;
    }
    frags
}

/// Tokenizes partitioned pieces: special tokens as themselves, each run of text between
/// them (template and message text together) as plain text.
fn tokenize_pieces(tokenizer: &Tokenizer, pieces: &[Piece]) -> Vec<u32> {
    let mut tokens = Vec::new();
    let mut run = String::new();
    for frag in partition(tokenizer, pieces) {
        match frag {
            Fragment::Token(id) => {
                if !run.is_empty() {
                    tokens.extend(tokenizer.encode(&run, EncodeOptions::plain_text()));
                    run.clear();
                }
                tokens.push(id);
            }
            Fragment::Template(s) | Fragment::Message(s) => run.push_str(&s),
        }
    }
    if !run.is_empty() {
        tokens.extend(tokenizer.encode(&run, EncodeOptions::plain_text()));
    }
    tokens
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}\
                          <|im_end|>\n{% endfor %}{% if add_generation_prompt %}\
                          <|im_start|>assistant\n{% endif %}";

    #[test]
    fn placeholders_are_filled_with_the_message_text() {
        let skeleton = format!("<a>{OPEN}0{CLOSE}</a><b>{OPEN}1{CLOSE}</b>");
        let pieces = fill(&skeleton, &[" x ", "y"], false).unwrap();
        assert_eq!(
            pieces,
            vec![
                Piece::Template("<a>".into()),
                Piece::Message(" x ".into()),
                Piece::Template("</a><b>".into()),
                Piece::Message("y".into()),
                Piece::Template("</b>".into()),
            ]
        );
        let trimmed = fill(&skeleton, &[" x ", "y"], true).unwrap();
        assert_eq!(trimmed.get(1), Some(&Piece::Message("x".into())));
        assert!(fill(&format!("{OPEN}7{CLOSE}"), &["a"], false).is_none());
    }

    #[test]
    fn message_text_is_kept_apart_from_template_markers() {
        let template = ChatTemplate::new(CHATML, "", "<|im_end|>").unwrap();
        let msgs = [Message::new("user", "hi <|im_start|> there")];
        let pieces = render_pieces(&template, &msgs).unwrap();
        assert_eq!(
            pieces,
            vec![
                Piece::Template("<|im_start|>user\n".into()),
                Piece::Message("hi <|im_start|> there".into()),
                Piece::Template("<|im_end|>\n<|im_start|>assistant\n".into()),
            ]
        );
    }

    #[test]
    fn a_template_that_rewrites_message_text_is_refused() {
        let template = ChatTemplate::new(
            "{% for m in messages %}{{ m.content | upper }}{% endfor %}",
            "",
            "",
        )
        .unwrap();
        let err = render_pieces(&template, &[Message::new("user", "abc")]).unwrap_err();
        assert!(err.to_string().contains("chat template"), "{err}");
    }
}
