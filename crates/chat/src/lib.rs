//! Chat templates (Jinja, rendered as HF transformers does) and tool-call envelope formats.
