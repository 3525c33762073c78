//! Resource limits for compiling and running a constraint, so a hostile grammar fails fast
//! with [`crate::GrammarError::TooComplex`] instead of hanging a worker.

/// Parser and lexer budgets (llguidance's `ParserLimits`). The defaults keep compilation
/// of any grammar to tens of milliseconds of lexer work and one mask to ~15 ms worst case.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrammarLimits {
    /// Earley items in one parser row (the grammar's branching factor).
    pub max_items_in_row: usize,
    /// Lexer work allowed while building the initial lexer (~50k units per ms).
    pub initial_lexer_fuel: u64,
    /// Lexer work allowed for one token mask (~14k units per ms).
    pub step_lexer_fuel: u64,
    /// Earley items created for one token mask (~20k per ms).
    pub step_max_items: usize,
    /// Lexer DFA states kept (memory: ~1–2 kB each).
    pub max_lexer_states: usize,
    /// Grammar size in symbols.
    pub max_grammar_size: usize,
}

impl Default for GrammarLimits {
    fn default() -> Self {
        GrammarLimits {
            max_items_in_row: 2_000,
            initial_lexer_fuel: 1_000_000,
            step_lexer_fuel: 200_000,
            step_max_items: 50_000,
            max_lexer_states: 250_000,
            max_grammar_size: 500_000,
        }
    }
}
