//! Integration tests of the sampling rule: its definition, the distribution it samples,
//! stop strings, and the per-call cost (printed, not asserted).

mod common;
mod distribution;
mod rule;
mod stop;
mod timing;
