//! GGUF file reader: mmap, metadata, tensor table, hostile-input safe.
