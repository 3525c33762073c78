//! Qwen2.5-Coder-0.5B (qwen2) against llama.cpp's reference log-probs and greedy tokens.

#[test]
fn qwen05_logprobs_and_greedy_match_llama_cpp() {
    // Measured (2026-12-04): max 0.60, mean 0.13, greedy 137/137; llama.cpp against
    // itself: 0.38 / 0.12 (tools/numerics/FINDINGS.md).
    crate::common::assert_golden("qwen2.5-coder-0.5b", &[("qwen2.5-coder-0.5b", 0.75, 0.16)]);
}
