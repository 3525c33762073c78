//! Integration tests of the tokenizers: small hand-made vocabularies and the real models.

mod real_models;
mod synthetic;
