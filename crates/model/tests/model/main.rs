//! Integration tests of the model crate: batch invariance (G1), the real models against
//! llama.cpp's references, DeepSeek V4 and DSpark against the committed fixtures, and tiny
//! generated models.

mod batch_invariance;
mod batch_invariance_gemma3;
mod common;
mod deepseek4;
mod deepseek4_fixtures;
mod dspark;
mod golden_gemma3;
mod golden_qwen05;
mod golden_qwen15;
mod golden_smollm2;
mod synthetic;
