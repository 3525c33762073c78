//! Qwen2.5-Coder-1.5B (qwen2) against llama.cpp's reference log-probs and greedy tokens,
//! including the ~2,300-token prompt.

#[test]
fn qwen15_logprobs_and_greedy_match_llama_cpp() {
    // Measured (2026-12-04): max 0.67, mean 0.16, greedy 177/177; long: 1.03, 0.36, 6/6.
    // llama.cpp against itself: 0.61 / 0.16 and 0.93 / 0.35 (tools/numerics/FINDINGS.md).
    crate::common::assert_golden(
        "qwen2.5-coder-1.5b",
        &[
            ("qwen2.5-coder-1.5b", 0.8, 0.2),
            ("long-qwen2.5-coder-1.5b", 1.2, 0.45),
        ],
    );
}
