//! Tokenizers built from GGUF metadata (byte-level BPE, SentencePiece) and streaming detokenization.
