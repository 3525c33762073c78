//! The `lockstep` binary: thin glue over the library crates.

fn main() {}
