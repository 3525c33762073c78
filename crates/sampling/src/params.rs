//! `SamplingParams`: what a request asks of the sampling rule, and their validation.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// A sampling parameter outside its domain.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ParamError {
    /// Temperature must be finite and `>= 0`.
    #[error("temperature must be a finite number >= 0, got {0}")]
    Temperature(f32),
    /// `top_p` must lie in (0, 1].
    #[error("top_p must lie in (0, 1], got {0}")]
    TopP(f32),
    /// `min_p` must lie in [0, 1].
    #[error("min_p must lie in [0, 1], got {0}")]
    MinP(f32),
    /// `presence_penalty` must be finite.
    #[error("presence_penalty must be a finite number, got {0}")]
    PresencePenalty(f32),
    /// `frequency_penalty` must be finite.
    #[error("frequency_penalty must be a finite number, got {0}")]
    FrequencyPenalty(f32),
    /// `repetition_penalty` must be finite and `> 0`.
    #[error("repetition_penalty must be a finite number > 0, got {0}")]
    RepetitionPenalty(f32),
    /// A `logit_bias` value must be finite or `-inf` (a ban).
    #[error("logit_bias for token {token} must be finite or -inf, got {bias}")]
    LogitBias {
        /// The token the bias is for.
        token: u32,
        /// The rejected bias.
        bias: f32,
    },
}

/// Parameters of the sampling rule for one request.
///
/// Processing order (see the crate docs): repetition penalty, then frequency and presence
/// penalties, then `logit_bias`, then the allowed set, top-k, top-p and min-p, then
/// Gumbel-max at `temperature`. Each parameter has a value that turns it off.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// Softmax temperature; `0` = greedy argmax (ties to the lowest id), which ignores
    /// top-k, top-p, min-p and the noise.
    pub temperature: f32,
    /// Keep the `top_k` best tokens (adjusted logit descending, token id ascending); `0` = off.
    pub top_k: usize,
    /// Nucleus: keep the smallest best-first prefix whose probability mass reaches `top_p`;
    /// `1` = off.
    pub top_p: f32,
    /// Keep tokens whose probability is at least `min_p` times the best one's; `0` = off.
    pub min_p: f32,
    /// The request seed of the counter-based noise.
    pub seed: u64,
    /// OpenAI presence penalty: subtracted once from the logit of every token that occurs in
    /// the row's own generated output (not the prompt); `0` = off.
    pub presence_penalty: f32,
    /// OpenAI frequency penalty: subtracted `count` times, `count` being the number of
    /// occurrences in the generated output (not the prompt); `0` = off.
    pub frequency_penalty: f32,
    /// llama.cpp repetition penalty over the last `repeat_last_n` tokens of prompt followed by
    /// generated output: a positive logit is divided by it, a non-positive one multiplied,
    /// once per distinct token; `1` = off.
    pub repetition_penalty: f32,
    /// The window of the repetition penalty in tokens (llama.cpp `repeat_last_n`, default 64);
    /// `0` turns the penalty off, a value at least the context length covers all of it.
    pub repeat_last_n: usize,
    /// Added to the logits of the given tokens after the penalties; `-inf` bans a token.
    /// Entries for the same token add up.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    /// OpenAI's defaults: temperature 1, nothing truncated, no penalties, seed 0.
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            repeat_last_n: 64,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Greedy decoding: temperature 0, everything else off.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        }
    }

    /// Check every parameter's domain (NaN is rejected everywhere).
    pub fn validate(&self) -> Result<(), ParamError> {
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(ParamError::Temperature(t));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ParamError::TopP(self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(ParamError::MinP(self.min_p));
        }
        if !self.presence_penalty.is_finite() {
            return Err(ParamError::PresencePenalty(self.presence_penalty));
        }
        if !self.frequency_penalty.is_finite() {
            return Err(ParamError::FrequencyPenalty(self.frequency_penalty));
        }
        let r = self.repetition_penalty;
        if !(r.is_finite() && r > 0.0) {
            return Err(ParamError::RepetitionPenalty(r));
        }
        for &(token, bias) in &self.logit_bias {
            if !(bias.is_finite() || bias == f32::NEG_INFINITY) {
                return Err(ParamError::LogitBias { token, bias });
            }
        }
        Ok(())
    }

    /// Whether the choice is the plain argmax of the raw logits over the allowed set: valid
    /// parameters, temperature 0, no penalty and no `logit_bias`. Then a
    /// [`RowSummary`](crate::RowSummary) of the row decides as the full row would.
    pub fn is_plain_greedy(&self) -> bool {
        self.temperature == 0.0
            && self.presence_penalty == 0.0
            && self.frequency_penalty == 0.0
            && self.repetition_penalty == 1.0
            && self.logit_bias.is_empty()
            && self.validate().is_ok()
    }

    /// Whether the presence or frequency penalty is on.
    pub(crate) fn counts_generated(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    /// Whether the repetition penalty is on.
    pub(crate) fn repetition_on(&self) -> bool {
        self.repetition_penalty != 1.0 && self.repeat_last_n > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_turn_everything_off() {
        let p = SamplingParams::default();
        p.validate().unwrap();
        assert!(!p.counts_generated());
        assert!(!p.repetition_on());
        SamplingParams::greedy().validate().unwrap();
    }

    #[test]
    fn out_of_domain_values_are_rejected_with_the_parameter_named() {
        let base = SamplingParams::default();
        let cases: Vec<(SamplingParams, &str)> = vec![
            (
                SamplingParams {
                    temperature: -0.1,
                    ..base.clone()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..base.clone()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::INFINITY,
                    ..base.clone()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    top_p: 0.0,
                    ..base.clone()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    top_p: 1.01,
                    ..base.clone()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    top_p: f32::NAN,
                    ..base.clone()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    min_p: -0.01,
                    ..base.clone()
                },
                "min_p",
            ),
            (
                SamplingParams {
                    min_p: 1.5,
                    ..base.clone()
                },
                "min_p",
            ),
            (
                SamplingParams {
                    min_p: f32::NAN,
                    ..base.clone()
                },
                "min_p",
            ),
            (
                SamplingParams {
                    presence_penalty: f32::NAN,
                    ..base.clone()
                },
                "presence_penalty",
            ),
            (
                SamplingParams {
                    frequency_penalty: f32::NEG_INFINITY,
                    ..base.clone()
                },
                "frequency_penalty",
            ),
            (
                SamplingParams {
                    repetition_penalty: 0.0,
                    ..base.clone()
                },
                "repetition_penalty",
            ),
            (
                SamplingParams {
                    repetition_penalty: f32::NAN,
                    ..base.clone()
                },
                "repetition_penalty",
            ),
            (
                SamplingParams {
                    logit_bias: vec![(3, f32::NAN)],
                    ..base.clone()
                },
                "logit_bias",
            ),
            (
                SamplingParams {
                    logit_bias: vec![(3, f32::INFINITY)],
                    ..base.clone()
                },
                "logit_bias",
            ),
        ];
        for (p, name) in cases {
            let err = p.validate().expect_err(name);
            assert!(err.to_string().contains(name), "{err}");
        }
        let ok = SamplingParams {
            logit_bias: vec![(1, f32::NEG_INFINITY), (2, 100.0)],
            top_p: 1.0,
            min_p: 1.0,
            temperature: 0.0,
            ..base
        };
        ok.validate().unwrap();
    }

    #[test]
    fn params_deserialize_with_defaults_and_reject_unknown_fields() {
        let p: SamplingParams =
            serde_json::from_str(r#"{"temperature":0.5,"logit_bias":[[7,-100.0]]}"#).unwrap();
        assert_eq!(p.temperature, 0.5);
        assert_eq!(p.repeat_last_n, 64);
        assert_eq!(p.logit_bias, vec![(7, -100.0)]);
        assert!(serde_json::from_str::<SamplingParams>(r#"{"temprature":0.5}"#).is_err());
    }
}
