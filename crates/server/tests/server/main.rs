//! End-to-end tests of the HTTP server with real models (smollm2-135m; qwen2.5-coder-0.5b
//! for tools) and a real HTTP client.

mod chat;
mod common;
mod completions;
mod concurrency;
mod errors;
mod openai_sdk;
mod responses;
mod spec;
mod tools;
