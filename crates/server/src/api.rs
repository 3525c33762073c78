//! Request bodies of the OpenAI endpoints, as `serde` types. Unknown fields are ignored;
//! a known field of the wrong type is a 400 naming it (see [`crate::extract`]). Shapes that
//! vary (tools, `tool_choice`, Responses input items) are kept as JSON values here and
//! interpreted, with the field path in every error, by [`crate::request`].

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum StopSpec {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

impl StopSpec {
    /// The stop strings.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopSpec::One(s) => vec![s],
            StopSpec::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct StreamOptions {
    /// Send a last chunk with the usage.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// `response_format` of chat completions.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    /// Free text.
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON valid against a schema.
    JsonSchema {
        /// The schema and its name.
        json_schema: JsonSchemaFormat,
    },
}

/// `response_format.json_schema`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct JsonSchemaFormat {
    /// The schema's name.
    #[serde(default)]
    pub name: Option<String>,
    /// The schema (absent: any JSON object).
    #[serde(default)]
    pub schema: Option<Value>,
    /// OpenAI's strict flag (lockstep always enforces the schema).
    #[serde(default)]
    pub strict: Option<bool>,
}

/// Sampling fields shared by every generation endpoint.
pub trait SamplingFields {
    /// `temperature`.
    fn temperature(&self) -> Option<f32>;
    /// `top_p`.
    fn top_p(&self) -> Option<f32>;
    /// `top_k` (extension).
    fn top_k(&self) -> Option<i64>;
    /// `min_p` (extension).
    fn min_p(&self) -> Option<f32>;
    /// `seed`.
    fn seed(&self) -> Option<i64>;
    /// `presence_penalty`.
    fn presence_penalty(&self) -> Option<f32>;
    /// `frequency_penalty`.
    fn frequency_penalty(&self) -> Option<f32>;
    /// `repetition_penalty` (extension).
    fn repetition_penalty(&self) -> Option<f32>;
    /// `logit_bias`.
    fn logit_bias(&self) -> Option<&BTreeMap<String, f32>>;
}

macro_rules! sampling_fields {
    ($t:ty) => {
        impl SamplingFields for $t {
            fn temperature(&self) -> Option<f32> {
                self.temperature
            }
            fn top_p(&self) -> Option<f32> {
                self.top_p
            }
            fn top_k(&self) -> Option<i64> {
                self.top_k
            }
            fn min_p(&self) -> Option<f32> {
                self.min_p
            }
            fn seed(&self) -> Option<i64> {
                self.seed
            }
            fn presence_penalty(&self) -> Option<f32> {
                self.presence_penalty
            }
            fn frequency_penalty(&self) -> Option<f32> {
                self.frequency_penalty
            }
            fn repetition_penalty(&self) -> Option<f32> {
                self.repetition_penalty
            }
            fn logit_bias(&self) -> Option<&BTreeMap<String, f32>> {
                self.logit_bias.as_ref()
            }
        }
    };
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatCompletionRequest {
    /// The model name.
    #[serde(default)]
    pub model: Option<String>,
    /// The conversation.
    pub messages: Vec<chat::Message>,
    /// Stream chunks as server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Most tokens to generate (legacy name).
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// Most tokens to generate.
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    /// Temperature.
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Top-k (extension).
    #[serde(default)]
    pub top_k: Option<i64>,
    /// Min-p (extension).
    #[serde(default)]
    pub min_p: Option<f32>,
    /// Seed (random when absent; echoed back).
    #[serde(default)]
    pub seed: Option<i64>,
    /// Stop strings.
    #[serde(default)]
    pub stop: Option<StopSpec>,
    /// Presence penalty.
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    /// Frequency penalty.
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    /// llama.cpp repetition penalty (extension).
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    /// Token id (as a string) → bias.
    #[serde(default)]
    pub logit_bias: Option<BTreeMap<String, f32>>,
    /// Number of choices.
    #[serde(default)]
    pub n: Option<u32>,
    /// Return log-probabilities.
    #[serde(default)]
    pub logprobs: Option<bool>,
    /// Alternatives per position (0-20).
    #[serde(default)]
    pub top_logprobs: Option<u32>,
    /// Output format.
    #[serde(default)]
    pub response_format: Option<ResponseFormat>,
    /// Tools.
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    /// `none`, `auto`, `required` or a named tool.
    #[serde(default)]
    pub tool_choice: Option<Value>,
    /// Allow several calls in one reply (default true).
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    /// Keep generating past end-of-text (extension).
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    /// Speculative decoding for this request (extension): `false` decodes plainly on a
    /// server started with speculation; `true` (or absent) uses the server's setting, and
    /// `true` on a server without speculation is a 400. The output is the same either way.
    #[serde(default)]
    pub speculation: Option<bool>,
}
sampling_fields!(ChatCompletionRequest);

/// `prompt` of `/v1/completions`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum PromptSpec {
    /// A text prompt.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
    /// A batch of one text prompt (`["text"]`).
    TextBatch(Vec<String>),
    /// A batch of one token prompt (`[[1, 2]]`).
    TokenBatch(Vec<Vec<u32>>),
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// The model name.
    #[serde(default)]
    pub model: Option<String>,
    /// The prompt.
    pub prompt: PromptSpec,
    /// Stream.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Most tokens (default 16, as OpenAI).
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// Temperature.
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Top-k (extension).
    #[serde(default)]
    pub top_k: Option<i64>,
    /// Min-p (extension).
    #[serde(default)]
    pub min_p: Option<f32>,
    /// Seed.
    #[serde(default)]
    pub seed: Option<i64>,
    /// Stop strings.
    #[serde(default)]
    pub stop: Option<StopSpec>,
    /// Presence penalty.
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    /// Frequency penalty.
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    /// Repetition penalty (extension).
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    /// Token id → bias.
    #[serde(default)]
    pub logit_bias: Option<BTreeMap<String, f32>>,
    /// Number of choices.
    #[serde(default)]
    pub n: Option<u32>,
    /// Alternatives per position (0-5).
    #[serde(default)]
    pub logprobs: Option<u32>,
    /// Echo the prompt in the text.
    #[serde(default)]
    pub echo: Option<bool>,
    /// Appended after the completion (accepted only when empty).
    #[serde(default)]
    pub suffix: Option<String>,
    /// Keep generating past end-of-text (extension).
    #[serde(default)]
    pub ignore_eos: Option<bool>,
}
sampling_fields!(CompletionRequest);

/// `text` of the Responses API.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct ResponsesText {
    /// The output format.
    #[serde(default)]
    pub format: Option<Value>,
}

/// `POST /v1/responses`.
#[derive(Debug, Clone, Deserialize)]
pub struct ResponsesRequest {
    /// The model name.
    #[serde(default)]
    pub model: Option<String>,
    /// A string or a list of input items.
    #[serde(default)]
    pub input: Option<Value>,
    /// A system (developer) message put first.
    #[serde(default)]
    pub instructions: Option<String>,
    /// Continue from a stored response.
    #[serde(default)]
    pub previous_response_id: Option<String>,
    /// Store the response for `previous_response_id` (default true).
    #[serde(default)]
    pub store: Option<bool>,
    /// Stream events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Most output tokens.
    #[serde(default)]
    pub max_output_tokens: Option<u64>,
    /// Temperature.
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Top-k (extension).
    #[serde(default)]
    pub top_k: Option<i64>,
    /// Min-p (extension).
    #[serde(default)]
    pub min_p: Option<f32>,
    /// Seed (extension).
    #[serde(default)]
    pub seed: Option<i64>,
    /// Presence penalty (extension).
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    /// Frequency penalty (extension).
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    /// Repetition penalty (extension).
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    /// Token id → bias (extension).
    #[serde(default)]
    pub logit_bias: Option<BTreeMap<String, f32>>,
    /// Tools.
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    /// Tool choice.
    #[serde(default)]
    pub tool_choice: Option<Value>,
    /// Allow several calls (default true).
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    /// Output text format.
    #[serde(default)]
    pub text: Option<ResponsesText>,
    /// Free-form metadata, echoed.
    #[serde(default)]
    pub metadata: Option<Value>,
    /// Reasoning options, echoed.
    #[serde(default)]
    pub reasoning: Option<Value>,
    /// End-user id, echoed.
    #[serde(default)]
    pub user: Option<String>,
}
sampling_fields!(ResponsesRequest);
