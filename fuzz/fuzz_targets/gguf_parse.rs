//! Fuzz target: parsing arbitrary bytes as GGUF returns Ok or Err, never panics, and an
//! accepted file's tensor slices are exactly their declared sizes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lockstep_gguf::GgufFile;

fuzz_target!(|data: &[u8]| {
    if let Ok(f) = GgufFile::from_bytes(data.to_vec()) {
        for t in f.tensors() {
            assert_eq!(f.tensor_data(t).len() as u64, t.n_bytes);
        }
        for (k, v) in f.metadata() {
            assert!(f.get(k).is_some());
            let _ = v.to_string();
        }
    }
});
