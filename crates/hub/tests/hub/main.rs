//! Integration tests of the model hub: pulls over HTTP and through PyPI wheels (local
//! servers and wheels), and the real PyPI path once.

mod common;
mod pull_http;
mod pull_wheels;
mod real_pypi;
