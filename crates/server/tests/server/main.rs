//! End-to-end tests of the HTTP server with real models (smollm2-135m; qwen2.5-coder-0.5b
//! for tools) and real HTTP clients (reqwest; the official OpenAI and Anthropic Python
//! SDKs).

mod anthropic;
mod anthropic_sdk;
mod chat;
mod common;
mod completions;
mod concurrency;
mod errors;
mod openai_sdk;
mod page;
mod responses;
mod spec;
mod tools;
