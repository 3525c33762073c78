//! The sampling rule: logit processing, counter-based Gumbel-max choice, stop conditions.
//!
//! Every choice is a pure function of (logits, the row's own prefix, seed, absolute
//! position), so a verify row in a speculative block chooses exactly what plain decoding
//! chooses, at any temperature (DESIGN.md "Sampling"). The steps of [`Sampler::choose`]:
//!
//! 1. **Adjust** from the row's own prefix: repetition penalty (llama.cpp: over the last
//!    `repeat_last_n` tokens of prompt + generated output, a positive logit is divided by
//!    the penalty and a non-positive one multiplied, once per distinct token), then
//!    frequency and presence penalties (OpenAI: over the generated output only,
//!    `l -= count * frequency + presence` for tokens with `count > 0`), then `logit_bias`
//!    (added last, so `-inf` bans and `+100` all but forces whatever the penalties did).
//! 2. **Allowed set** = grammar mask ∧ ¬never-sample, minus tokens whose adjusted logit is
//!    `-inf`. Empty → [`SampleError::EmptyAllowedSet`]; an all-masked row is never argmaxed.
//! 3. **Temperature 0**: the argmax of the adjusted logits over the allowed set, ties to the
//!    lowest id; top-k, top-p, min-p and the noise are ignored.
//! 4. **Truncation** (T > 0): top-k in the order (adjusted logit desc, id asc); then top-p
//!    (smallest best-first prefix reaching the mass) and min-p
//!    (`(l - l_max) / T >= ln(min_p)`, i.e. `p >= min_p * p_max`), both evaluated against
//!    softmax(logit/T) over what top-k left; a token must pass both. Top-p weights are
//!    `exp((l - l_max) / T)` in f32 with the crate's one `exp`, the total summed in token-id
//!    order (best-first order after top-k).
//! 5. **Gumbel-max**: the argmax over the remaining tokens of `l / T + g(seed, position,
//!    token)` in f64, ties to the lowest id, with [`gumbel`] from a counter-based generator.
//!    This samples exactly from softmax(l/T) over the remaining set.
//!
//! ```
//! use lockstep_sampling::{ChoiceContext, Sampler, SamplingParams, TokenMask};
//! let logits = [0.5f32, 2.0, 1.0, -1.0];
//! let never = TokenMask::new(logits.len());
//! let params = SamplingParams { temperature: 0.8, seed: 42, ..SamplingParams::default() };
//! let ctx = ChoiceContext { prompt_tokens: &[1, 2], generated_tokens: &[], position: 2 };
//! let mut sampler = Sampler::new();
//! let a = sampler.choose(&logits, &ctx, &params, None, &never).unwrap();
//! let b = sampler.choose(&logits, &ctx, &params, None, &never).unwrap();
//! assert_eq!(a.token, b.token); // a pure function of its inputs
//! ```

mod choose;
mod constraint;
mod logprob;
mod mask;
mod noise;
mod params;
mod stop;

pub use choose::{Choice, ChoiceContext, SampleError, Sampler, choose};
pub use constraint::{ConstraintError, TokenConstraint};
#[cfg(any(test, feature = "testing"))]
pub use constraint::{ContractViolation, check_contract};
pub use logprob::{NORM_LANES, RowSummary, SUMMARY_LANES, TokenLogprob, row_summary, top_logprobs};
pub use mask::{MaskError, TokenMask};
pub use noise::{NoiseKey, gumbel, gumbel_from_bits};
pub use params::{ParamError, SamplingParams};
pub use stop::{FinishReason, StopCause, StopChecker, StopError, StopStep};
