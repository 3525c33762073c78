//! Chat prompts whose control tokens come only from the template.
//!
//! A client can put any text in a message, a tool description or a tool-call argument —
//! including `<|im_start|>`. Only the chat template may produce control tokens
//! (DESIGN.md "Vocabulary"). The method, which covers every string the client sent and not
//! just message contents:
//!
//! 1. *Defuse*: in every client string, each occurrence of a control-token text gets a
//!    reserved character ([`MARK`], a Unicode noncharacter) inserted after its first
//!    character, so it no longer spells the marker. Client text containing [`MARK`] itself
//!    is refused.
//! 2. Render the template with the defused data.
//! 3. Partition the render at control-token texts (longest text first, leftmost
//!    occurrences, as llama.cpp's `tokenizer_st_partition`): every match now comes from
//!    the template.
//! 4. Remove [`MARK`] from the text between markers and tokenize that text as plain text.
//!
//! The rendered text (without marks) equals the template's render of the original
//! conversation, so the tokens are what llama.cpp would produce if it could tell template
//! text from client text.

use chat::{ChatTemplate, Message};
use serde_json::Value;
use text::{EncodeOptions, TokenKind, Tokenizer};

/// Inserted into client text to break control-token texts apart (U+FFFFE, a noncharacter).
pub const MARK: char = '\u{FFFFE}';

/// Why a chat prompt could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PromptError {
    /// Client text contains the reserved character.
    #[error("the request contains the reserved character U+FFFFE")]
    ReservedCharacter,
    /// The template refused the conversation (e.g. roles that do not alternate).
    #[error("the chat template could not render this conversation: {0}")]
    Template(String),
    /// The conversation cannot be represented (a message that does not serialise).
    #[error("invalid conversation: {0}")]
    Conversation(String),
}

/// Renders and tokenizes chat conversations for one model.
#[derive(Debug)]
pub struct ChatPrompter {
    template: ChatTemplate,
    /// Control/unknown token texts and ids, longest text first, then lower id.
    specials: Vec<(String, u32)>,
}

/// A rendered and tokenized chat prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatPrompt {
    /// The rendered text, as the template renders the original conversation.
    pub text: String,
    /// The prompt tokens (BOS added when the metadata asks and the template did not).
    pub tokens: Vec<u32>,
}

impl ChatPrompter {
    /// A prompter for `template` over `tokenizer`'s control tokens.
    pub fn new(template: ChatTemplate, tokenizer: &Tokenizer) -> ChatPrompter {
        let n = u32::try_from(tokenizer.vocab_size()).unwrap_or(u32::MAX);
        let mut specials: Vec<(String, u32)> = (0..n)
            .filter(|&id| {
                matches!(
                    tokenizer.token_kind(id),
                    Some(TokenKind::Control | TokenKind::Unknown)
                )
            })
            .filter_map(|id| {
                tokenizer
                    .token_text(id)
                    .filter(|t| !t.is_empty())
                    .map(|t| (t.to_string(), id))
            })
            .collect();
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        ChatPrompter { template, specials }
    }

    /// The template.
    pub fn template(&self) -> &ChatTemplate {
        &self.template
    }

    /// Renders `messages` (and `tools`, given to the template as its `tools` variable) with
    /// the generation prompt and tokenizes the result with client text as plain text.
    pub fn prompt(
        &self,
        tokenizer: &Tokenizer,
        messages: &[Message],
        tools: Option<&[Value]>,
    ) -> Result<ChatPrompt, PromptError> {
        self.prompt_with(tokenizer, messages, tools, Default::default())
    }

    /// [`ChatPrompter::prompt`] with extra template variables (`enable_thinking`).
    pub fn prompt_with(
        &self,
        tokenizer: &Tokenizer,
        messages: &[Message],
        tools: Option<&[Value]>,
        extra: serde_json::Map<String, Value>,
    ) -> Result<ChatPrompt, PromptError> {
        let mut msgs_value =
            serde_json::to_value(messages).map_err(|e| PromptError::Conversation(e.to_string()))?;
        self.defuse_value(&mut msgs_value)?;
        let defused_msgs: Vec<Message> = serde_json::from_value(msgs_value)
            .map_err(|e| PromptError::Conversation(e.to_string()))?;
        let defused_tools = match tools {
            Some(t) => {
                let mut v = Value::Array(t.to_vec());
                self.defuse_value(&mut v)?;
                match v {
                    Value::Array(items) => Some(items),
                    _ => None,
                }
            }
            None => None,
        };
        let rendered = self
            .template
            .render(&defused_msgs, defused_tools.as_deref(), true, extra)
            .map_err(|e| PromptError::Template(e.to_string()))?;
        let mut tokens = Vec::new();
        let mut text = String::with_capacity(rendered.len());
        for frag in self.partition(&rendered) {
            match frag {
                Fragment::Token(id, t) => {
                    tokens.push(id);
                    text.push_str(t);
                }
                Fragment::Text(t) => {
                    let clean: String = t.chars().filter(|&c| c != MARK).collect();
                    tokens.extend(tokenizer.encode(&clean, EncodeOptions::plain_text()));
                    text.push_str(&clean);
                }
            }
        }
        if tokenizer.add_bos()
            && let Some(bos) = tokenizer.bos_id()
            && tokens.first() != Some(&bos)
        {
            tokens.insert(0, bos);
        }
        Ok(ChatPrompt { text, tokens })
    }

    /// Defuses every string (object keys included) inside `v`.
    fn defuse_value(&self, v: &mut Value) -> Result<(), PromptError> {
        match v {
            Value::String(s) => {
                if let Some(d) = self.defuse(s)? {
                    *s = d;
                }
            }
            Value::Array(items) => {
                for item in items {
                    self.defuse_value(item)?;
                }
            }
            Value::Object(map) => {
                let old = std::mem::take(map);
                for (k, mut val) in old {
                    self.defuse_value(&mut val)?;
                    let key = self.defuse(&k)?.unwrap_or(k);
                    map.insert(key, val);
                }
            }
            Value::Null | Value::Bool(_) | Value::Number(_) => {}
        }
        Ok(())
    }

    /// `s` with every control-token text broken by [`MARK`]; `None` when unchanged.
    fn defuse(&self, s: &str) -> Result<Option<String>, PromptError> {
        if s.contains(MARK) {
            return Err(PromptError::ReservedCharacter);
        }
        let mut out: Option<String> = None;
        for (special, _) in &self.specials {
            let cur = out.as_deref().unwrap_or(s);
            if !cur.contains(special.as_str()) {
                continue;
            }
            let mut chars = special.chars();
            let first = chars.next().map(String::from).unwrap_or_default();
            let broken = format!("{first}{MARK}{}", chars.as_str());
            out = Some(cur.replace(special.as_str(), &broken));
        }
        Ok(out)
    }

    /// Splits `text` at control-token texts (each text, longest first, splits the remaining
    /// text fragments at its leftmost non-overlapping occurrences).
    fn partition<'a>(&'a self, text: &'a str) -> Vec<Fragment<'a>> {
        let mut frags = vec![Fragment::Text(text)];
        for (special, id) in &self.specials {
            if !frags
                .iter()
                .any(|f| matches!(f, Fragment::Text(t) if t.contains(special.as_str())))
            {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                let Fragment::Text(t) = f else {
                    next.push(f);
                    continue;
                };
                let mut rest = t;
                while let Some(at) = rest.find(special.as_str()) {
                    let (before, after) = rest.split_at(at);
                    if !before.is_empty() {
                        next.push(Fragment::Text(before));
                    }
                    let (tok, after) = after.split_at(special.len());
                    next.push(Fragment::Token(*id, tok));
                    rest = after;
                }
                if !rest.is_empty() {
                    next.push(Fragment::Text(rest));
                }
            }
            frags = next;
        }
        frags
    }
}

/// A piece of a rendered prompt.
#[derive(Debug, Clone, Copy)]
enum Fragment<'a> {
    /// A control token and its text.
    Token(u32, &'a str),
    /// Text between control tokens.
    Text(&'a str),
}
