//! Structured-output constraints for the engine: the constraint plan of a request
//! ([`plan`]: the response format, the tools and the think-block rule, in one function for
//! every front end), the think-block rule itself ([`think_rule`]: a model that thinks
//! first keeps its `<think>…</think>` block free, the constraint applies after `</think>`), grammar matchers (which implement
//! [`engine::TokenConstraint`] themselves), the lazy tool-call constraint (free text until the model
//! opens a tool-call envelope, then the envelope grammar), and a small cache of compiled
//! grammars so repeated requests (agents resend the same tools every turn) compile once.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use chat::ChatTemplate;
use engine::{ConstraintError, TokenConstraint, TokenMask};
use grammar::lark::{Expr, Grammar, JsonLayout};
use grammar::{
    CompiledConstraint, Constraint, ConstraintKey, GrammarLimits, GrammarMatcher, TokenEnv,
};
use serde_json::{Value, json};
use text::Tokenizer;

use crate::Runtime;
use crate::tools::{CustomFormat, ToolKind, ToolMode, ToolSetup};

/// Where a chat reply's reasoning segment stands, as the rendered prompt shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reasoning {
    /// The model does not think first (or the template turned thinking off).
    None,
    /// The model opens a `<think>…</think>` block before its answer.
    Block,
    /// The prompt ends with `<think>`: the output starts inside the thoughts.
    Opened,
}

/// How a chat reply begins for a model whose template is `template_source`, given the
/// rendered prompt text: templates that know `<think>` make the model think first,
/// unless the generation prompt already closed an (empty) block — thinking turned off —
/// or opened one.
pub fn reasoning_segment(template_source: &str, prompt_text: &str) -> Reasoning {
    if !template_source.contains("<think>") {
        return Reasoning::None;
    }
    let tail = prompt_text.trim_end();
    if tail.ends_with("<think>") {
        Reasoning::Opened
    } else if tail.ends_with("</think>") {
        Reasoning::None
    } else {
        Reasoning::Block
    }
}

/// The think-block rule of the constraint plan, for a chat prompt (`prompt`: its tokens)
/// rendered through `template`: a model that thinks first keeps its reasoning segment
/// free and `constraint` applies after `</think>` (see [`reasoning_segment`]). Without a
/// template, or for a model that does not think, `constraint` is returned as it is.
pub fn think_rule(
    constraint: Constraint,
    template: Option<&ChatTemplate>,
    tokenizer: &Tokenizer,
    prompt: &[u32],
) -> Constraint {
    let Some(template) = template else {
        return constraint;
    };
    match reasoning_segment(template.source(), &prompt_tail_text(tokenizer, prompt)) {
        Reasoning::None => constraint,
        Reasoning::Block => constraint.with_think(true),
        Reasoning::Opened => constraint.with_think_opened(),
    }
}

/// The text of the prompt's last tokens (enough to see how the generation prompt ends),
/// special tokens spelled as their text.
fn prompt_tail_text(tokenizer: &Tokenizer, prompt: &[u32]) -> String {
    let from = prompt.len().saturating_sub(16);
    let mut bytes = Vec::new();
    for &t in prompt.get(from..).unwrap_or_default() {
        bytes.extend_from_slice(tokenizer.token_bytes(t).unwrap_or_default());
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Why a request's constraint cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// The request asks for something that cannot be constrained (a tool name, schema or
    /// grammar); `param` names the request's parameter at fault.
    #[error("{message}")]
    Invalid {
        /// The parameter (`tools[0].parameters`, `response_format`).
        param: String,
        /// What is wrong.
        message: String,
    },
    /// A grammar built here failed (a bug, not the request's fault).
    #[error("{0}")]
    Internal(String),
}

impl PlanError {
    /// [`PlanError::Invalid`] naming `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> PlanError {
        PlanError::Invalid {
            param: param.into(),
            message: message.into(),
        }
    }
}

/// Compiles the grammars of the tools one by one (so an error names the tool), then the
/// constraint of the request: the envelope grammar for `required`/named, a lazy one for
/// `auto`, or the response format alone. `prompt` is the rendered chat prompt: a model
/// that thinks first keeps its think block free and the constraint applies after
/// `</think>` ([`Runtime::constrain`], the rule `lockstep run` follows too). `params`
/// names the request's tools and response-format parameters for errors. Every front end
/// (the OpenAI and Anthropic APIs, the chat page) builds its constraint here.
pub fn plan(
    model: &Runtime,
    cache: &GrammarCache,
    tools: Option<&ToolSetup>,
    format: Option<Constraint>,
    prompt: &[u32],
    params: (&str, &str),
) -> Result<Option<ConstraintPlan>, PlanError> {
    let (tools_param, format_param) = params;
    let think = |c: Constraint| model.constrain(c, prompt);
    let format = format.map(think);
    let compile = |c: &Constraint, param: &str| {
        cache
            .compile(c)
            .map_err(|e| PlanError::invalid(param, format!("invalid {param}: {e}")))
    };
    let format_compiled = match &format {
        Some(c) => Some(compile(c, format_param)?),
        None => None,
    };
    let Some(setup) = tools.filter(|t| t.active()) else {
        return Ok(format_compiled.map(ConstraintPlan::Grammar));
    };
    for (i, t) in setup.tools.iter().enumerate() {
        match &t.kind {
            ToolKind::Function { parameters } if parameters.is_object() => {
                compile(
                    &Constraint::json_schema(parameters.clone()),
                    &format!("{tools_param}[{i}].parameters"),
                )?;
            }
            ToolKind::Function { .. } => {}
            ToolKind::Custom { format } => match format {
                CustomFormat::Text => {}
                CustomFormat::Lark(g) => {
                    compile(
                        &Constraint::lark(g.clone()),
                        &format!("{tools_param}[{i}].format"),
                    )?;
                }
                CustomFormat::Regex(r) => {
                    compile(
                        &Constraint::regex(r.clone()),
                        &format!("{tools_param}[{i}].format"),
                    )?;
                }
            },
        }
    }
    let calls = setup.calls_grammar(model.tool_format())?;
    let grammar_err = |e: grammar::GrammarError| {
        PlanError::invalid(
            tools_param,
            format!("the tools do not form a valid grammar: {e}"),
        )
    };
    // `start` (and for `auto` with a JSON response format, `answer`) before the calls.
    let lark = |start: Expr, answer: Option<Expr>| {
        let mut g = Grammar::new();
        g.rule("start", start);
        if let Some(answer) = answer {
            g.rule("answer", answer);
        }
        g.extend(calls.clone());
        g.to_lark()
            .map(Constraint::lark)
            .map_err(|e| PlanError::Internal(format!("the tools grammar: {e}")))
    };
    let answer_or_calls = |schema: &Value| {
        lark(
            Expr::alt([Expr::rule("answer"), Expr::rule("calls")]),
            Some(Expr::json(schema, JsonLayout::Llguidance)),
        )
    };
    match &setup.mode {
        ToolMode::Required | ToolMode::Named(_) => {
            let c = cache
                .compile(&think(lark(Expr::rule("calls"), None)?))
                .map_err(grammar_err)?;
            Ok(Some(ConstraintPlan::Grammar(c)))
        }
        ToolMode::Auto => match format.as_ref().map(Constraint::source) {
            Some(grammar::ConstraintSource::JsonSchema(schema)) => {
                let c = cache
                    .compile(&think(answer_or_calls(schema)?))
                    .map_err(grammar_err)?;
                Ok(Some(ConstraintPlan::Grammar(c)))
            }
            Some(grammar::ConstraintSource::JsonObject) => {
                let c = cache
                    .compile(&think(answer_or_calls(&json!({"type": "object"}))?))
                    .map_err(grammar_err)?;
                Ok(Some(ConstraintPlan::Grammar(c)))
            }
            _ => {
                let c = cache
                    .compile(&lark(Expr::rule("calls"), None)?)
                    .map_err(grammar_err)?;
                Ok(Some(ConstraintPlan::LazyTools {
                    trigger: model.tool_format().start_marker().to_string(),
                    calls: c,
                }))
            }
        },
        ToolMode::None => Ok(format_compiled.map(ConstraintPlan::Grammar)),
    }
}

/// How each choice of a request gets its constraint.
#[derive(Clone)]
pub enum ConstraintPlan {
    /// One grammar over the whole output.
    Grammar(CompiledConstraint),
    /// Free text until `trigger` (the envelope's start marker) is generated at a token
    /// boundary; from there on `calls` (whose language starts with the trigger).
    LazyTools {
        /// The start marker.
        trigger: String,
        /// The envelope grammar.
        calls: CompiledConstraint,
    },
}

impl std::fmt::Debug for ConstraintPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConstraintPlan::Grammar(_) => f.write_str("ConstraintPlan::Grammar"),
            ConstraintPlan::LazyTools { trigger, .. } => {
                write!(f, "ConstraintPlan::LazyTools({trigger:?})")
            }
        }
    }
}

impl ConstraintPlan {
    /// A fresh constraint for one sequence.
    pub fn instantiate(&self, env: &Arc<TokenEnv>) -> Box<dyn TokenConstraint> {
        match self {
            ConstraintPlan::Grammar(c) => Box::new(c.matcher()),
            ConstraintPlan::LazyTools { trigger, calls } => Box::new(LazyToolConstraint {
                env: Arc::clone(env),
                trigger: trigger.as_bytes().to_vec(),
                calls: calls.clone(),
                history: Vec::new(),
                engaged: None,
            }),
        }
    }
}

/// Free text, then — once the trigger appears at a token boundary — the envelope grammar.
/// A trigger that straddles a token boundary leaves the output free (the output parser
/// then reports what it finds); with Qwen the start marker is one token, so in practice
/// the envelope is always constrained.
pub struct LazyToolConstraint {
    env: Arc<TokenEnv>,
    trigger: Vec<u8>,
    calls: CompiledConstraint,
    /// Tokens consumed so far.
    history: Vec<u32>,
    /// `(history length when engaged minus the trigger tokens, matcher)`.
    engaged: Option<(usize, GrammarMatcher)>,
}

impl LazyToolConstraint {
    /// If the history ends with tokens spelling exactly the trigger, how many.
    fn trigger_tokens(&self) -> Option<usize> {
        let mut spelled: Vec<u8> = Vec::new();
        for (k, &tok) in self.history.iter().rev().enumerate() {
            let bytes = self.env.grammar_bytes(tok);
            let mut joined = bytes.to_vec();
            joined.extend_from_slice(&spelled);
            spelled = joined;
            if spelled.len() > self.trigger.len() || !self.trigger.ends_with(&spelled) {
                return None;
            }
            if spelled == self.trigger {
                return Some(k + 1);
            }
        }
        None
    }
}

impl LazyToolConstraint {
    /// Whether `token` is allowed while the output is free text: any id the environment
    /// does not block.
    fn free(&self, token: u32) -> bool {
        (token as usize) < self.env.n_logits() && !self.env.blocked().get(token)
    }
}

impl TokenConstraint for LazyToolConstraint {
    fn compute_mask(&mut self, mask: &mut TokenMask) -> Result<(), ConstraintError> {
        match &mut self.engaged {
            Some((_, m)) => m.compute_mask(mask).map_err(ConstraintError::from),
            None => {
                let blocked = self.env.blocked().words();
                mask.fill_words(self.env.n_logits(), |i| {
                    !blocked.get(i).copied().unwrap_or(u64::MAX)
                });
                Ok(())
            }
        }
    }

    fn accepts(&mut self, token: u32) -> bool {
        match &mut self.engaged {
            Some((_, m)) => m.accepts(token),
            None => self.free(token),
        }
    }

    fn consume(&mut self, token: u32) -> Result<(), ConstraintError> {
        if let Some((_, m)) = &mut self.engaged {
            m.consume(token)?;
            self.history.push(token);
            return Ok(());
        }
        if !self.free(token) {
            return Err(ConstraintError::TokenRejected {
                token,
                text: String::from_utf8_lossy(self.env.grammar_bytes(token)).into_owned(),
                position: self.history.len(),
            });
        }
        self.history.push(token);
        if let Some(k) = self.trigger_tokens() {
            let mut m = self.calls.matcher();
            let start = self.history.len() - k;
            let ok = self
                .history
                .get(start..)
                .is_some_and(|toks| toks.iter().all(|&t| m.consume(t).is_ok()));
            if ok {
                self.engaged = Some((start, m));
            }
        }
        Ok(())
    }

    fn is_finished(&self) -> bool {
        self.engaged.as_ref().is_some_and(|(_, m)| m.is_finished())
    }

    fn is_free(&self) -> bool {
        self.engaged.is_none()
    }

    fn rollback(&mut self, n: usize) -> Result<(), ConstraintError> {
        if n > self.history.len() {
            return Err(ConstraintError::Rollback {
                requested: n,
                available: self.history.len(),
            });
        }
        let new_len = self.history.len() - n;
        if let Some((start, m)) = &mut self.engaged {
            if new_len <= *start {
                self.engaged = None;
            } else {
                m.rollback(n)?;
            }
        }
        self.history.truncate(new_len);
        Ok(())
    }

    fn fork(&self) -> Box<dyn TokenConstraint> {
        Box::new(LazyToolConstraint {
            env: Arc::clone(&self.env),
            trigger: self.trigger.clone(),
            calls: self.calls.clone(),
            history: self.history.clone(),
            engaged: self.engaged.as_ref().map(|(s, m)| (*s, m.fork())),
        })
    }

    fn forced_tokens(&mut self) -> Vec<u32> {
        match &mut self.engaged {
            Some((_, m)) => m.forced_tokens(),
            None => Vec::new(),
        }
    }
}

/// A bounded cache of compiled constraints keyed by [`Constraint::key`] (a SHA-256 of the
/// constraint's canonical serialization), least recently used evicted first.
pub struct GrammarCache {
    env: Arc<TokenEnv>,
    limits: GrammarLimits,
    entries: Mutex<VecDeque<(ConstraintKey, CompiledConstraint)>>,
    capacity: usize,
}

impl std::fmt::Debug for GrammarCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCache")
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

impl GrammarCache {
    /// A cache of `capacity` entries for `env`.
    pub fn new(env: Arc<TokenEnv>, capacity: usize) -> GrammarCache {
        GrammarCache {
            env,
            limits: GrammarLimits::default(),
            entries: Mutex::new(VecDeque::new()),
            capacity: capacity.max(1),
        }
    }

    /// The token environment.
    pub fn env(&self) -> &Arc<TokenEnv> {
        &self.env
    }

    /// How many compiled constraints the cache holds.
    pub fn len(&self) -> usize {
        self.entries.lock().map_or(0, |e| e.len())
    }

    /// Whether the cache holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Compiles `constraint` (or takes it from the cache). Blocking: call it off the async
    /// runtime.
    pub fn compile(
        &self,
        constraint: &Constraint,
    ) -> Result<CompiledConstraint, grammar::GrammarError> {
        let key = constraint.key();
        if let Ok(mut entries) = self.entries.lock()
            && let Some(pos) = entries.iter().position(|(k, _)| *k == key)
            && let Some(entry) = entries.remove(pos)
        {
            let compiled = entry.1.clone();
            entries.push_back(entry);
            return Ok(compiled);
        }
        let compiled = constraint.compile(&self.env, &self.limits)?;
        if let Ok(mut entries) = self.entries.lock() {
            if entries.len() >= self.capacity {
                entries.pop_front();
            }
            entries.push_back((key, compiled.clone()));
        }
        Ok(compiled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::OnceLock;

    fn qwen_env() -> &'static Arc<TokenEnv> {
        static ENV: OnceLock<Arc<TokenEnv>> = OnceLock::new();
        ENV.get_or_init(|| {
            let path = hub::ensure_model("qwen2.5-coder-0.5b").expect("model file");
            let file = gguf::GgufFile::open(&path).expect("gguf");
            let tok = Arc::new(Tokenizer::from_gguf(&file).expect("tokenizer"));
            TokenEnv::new(tok).expect("token env")
        })
    }

    #[test]
    fn the_cache_keys_by_the_canonical_constraint() {
        let cache = GrammarCache::new(Arc::clone(qwen_env()), 4);
        let schema =
            || serde_json::json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        cache.compile(&Constraint::json_schema(schema())).unwrap();
        cache.compile(&Constraint::json_schema(schema())).unwrap();
        assert_eq!(cache.len(), 1, "an equal constraint compiled again");
        cache
            .compile(&Constraint::json_schema(schema()).with_think(true))
            .unwrap();
        assert_eq!(cache.len(), 2);
        let bad = cache.compile(&Constraint::lark("start: ((")).unwrap_err();
        assert!(matches!(
            ConstraintError::from(bad),
            ConstraintError::Invalid(_)
        ));
        assert_eq!(cache.len(), 2, "a failed compile is not cached");
    }

    #[test]
    fn the_lazy_tool_constraint_keeps_the_contract_before_and_after_the_trigger() {
        let env = qwen_env();
        let cache = GrammarCache::new(Arc::clone(env), 4);
        let calls = cache
            .compile(&Constraint::lark(
                "start: \"<tool_call>\" \"\\n\" /[a-z]{1,8}/ \"\\n</tool_call>\"",
            ))
            .unwrap();
        let plan = ConstraintPlan::LazyTools {
            trigger: "<tool_call>".to_string(),
            calls,
        };
        let mut c = plan.instantiate(env);
        let n = env.n_logits();
        sampling::check_contract(c.as_mut(), n).unwrap();
        let tok = env.tokenizer();
        let text = tok.encode("Sure.", text::EncodeOptions::plain_text());
        let mut consumed = text.len() + 1;
        for t in text {
            c.consume(t).unwrap();
        }
        sampling::check_contract(c.as_mut(), n).unwrap();
        let trigger = tok.encode("<tool_call>", text::EncodeOptions::raw_prompt());
        assert_eq!(trigger.len(), 1, "Qwen's start marker is one token");
        c.consume(trigger[0]).unwrap();
        let word = tok.encode("\nabc", text::EncodeOptions::plain_text());
        assert!(!c.accepts(tok.encode("!", text::EncodeOptions::plain_text())[0]));
        sampling::check_contract(c.as_mut(), n).unwrap();
        consumed += word.len();
        let engaged = word.len() + 1;
        for t in word {
            c.consume(t).unwrap();
        }
        sampling::check_contract(c.as_mut(), n).unwrap();
        let mut fork = c.fork();
        fork.rollback(engaged).unwrap();
        assert!(fork.accepts(tok.encode("!", text::EncodeOptions::plain_text())[0]));
        assert_eq!(
            c.rollback(100),
            Err(ConstraintError::Rollback {
                requested: 100,
                available: consumed
            })
        );
    }

    #[test]
    fn reasoning_segment_follows_the_generation_prompt() {
        let plain = "{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}";
        let thinking =
            "{{ '<think>' }}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        let prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
        assert_eq!(reasoning_segment(plain, prompt), Reasoning::None);
        assert_eq!(reasoning_segment(thinking, prompt), Reasoning::Block);
        assert_eq!(
            reasoning_segment(thinking, &format!("{prompt}<think>\n")),
            Reasoning::Opened
        );
        assert_eq!(
            reasoning_segment(thinking, &format!("{prompt}<think>\n\n</think>\n\n")),
            Reasoning::None
        );
    }
}
