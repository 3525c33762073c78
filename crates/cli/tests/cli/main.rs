//! Integration tests of the built `lockstep` binary: `models`, `pull`, errors and help;
//! generation with real models (`run`, `check`, `chat`, `bench`); the structured-output
//! flags; the disk cache across processes; DeepSeek V4 files; and the chat page in a real
//! browser.

mod chat_page;
mod cli;
mod constrained;
mod deepseek4;
mod disk_cache;
mod generate;
