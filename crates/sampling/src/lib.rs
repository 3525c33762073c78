//! The sampling rule: logit processing, counter-based Gumbel-max choice, stop conditions.
