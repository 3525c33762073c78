//! Integration tests of the GGUF reader and writer: hostile files, round trips and the
//! project models. The allocation bound (`tests/alloc_bound.rs`) is a binary of its own:
//! it installs a counting global allocator, which would also count the allocations of
//! the tests running beside it here.

mod common;
mod hostile;
mod real_models;
mod roundtrip;
