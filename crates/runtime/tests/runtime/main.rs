//! Integration tests of the runtime crate: the crate graph of ARCHITECTURE.md holds.

mod crate_graph;
