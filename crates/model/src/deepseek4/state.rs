//! The per-sequence state ([`Deepseek4State`]): append-only logs of raw KV rows, compressor
//! tokens and compressed rows, truncated for exact rollback.

use super::*;

/// Rows of `width` values for positions (or row indices) `base..len`.
#[derive(Clone, Debug)]
pub(super) struct Log {
    pub(super) width: usize,
    pub(super) base: usize,
    pub(super) data: Vec<f32>,
}

impl Log {
    pub(super) fn new(width: usize) -> Log {
        Log {
            width,
            base: 0,
            data: Vec::new(),
        }
    }

    pub(super) fn push(&mut self, row: &[f32]) {
        self.data.extend_from_slice(&row[..self.width]);
    }

    /// Row `i` (`base ≤ i < len`; empty otherwise, which the forward never asks for).
    pub(super) fn row(&self, i: usize) -> &[f32] {
        let w = self.width;
        match i.checked_sub(self.base) {
            Some(r) => self.data.get(r * w..(r + 1) * w).unwrap_or(&[]),
            None => &[],
        }
    }

    pub(super) fn truncate(&mut self, len: usize) {
        let keep = len.saturating_sub(self.base);
        self.data.truncate(keep * self.width);
    }

    /// Drops the rows before `i`.
    pub(super) fn forget_before(&mut self, i: usize) {
        let drop = i
            .saturating_sub(self.base)
            .min(self.data.len() / self.width.max(1));
        if drop > 0 {
            self.data.drain(..drop * self.width);
            self.base += drop;
        }
    }

    pub(super) fn bytes(&self) -> usize {
        self.data.capacity() * 4
    }
}

/// A compressor's state: projected tokens `[c | z + ape]` by position, emitted rows.
#[derive(Clone, Debug)]
pub(super) struct CompState {
    pub(super) ratio: usize,
    pub(super) tokens: Log,
    pub(super) rows: Log,
}

#[derive(Clone, Debug)]
pub(super) struct LayerState {
    /// Raw KV rows (normed, rotated) by position.
    pub(super) kv: Log,
    pub(super) comp: Option<CompState>,
    pub(super) index: Option<CompState>,
}

/// One sequence's state for [`Deepseek4::forward`]: per layer the raw KV rows of the window,
/// the compressors' pending tokens and emitted rows, and the indexer's keys (see the module
/// docs). Truncating it to a length restores exactly the state of that length.
#[derive(Clone, Debug)]
pub struct Deepseek4State {
    pub(super) layers: Vec<LayerState>,
    pub(super) len: usize,
    pub(super) floor: usize,
    pub(super) window: usize,
    /// Captured target rows (DSpark), when the state was made capturing.
    pub(super) capture: Option<Capture>,
}

/// The rows a DSpark drafter reads: per position, the input of each captured layer averaged
/// over the HC streams, concatenated in layer order (`layers.len() × D` values).
#[derive(Clone, Debug)]
pub(super) struct Capture {
    /// Captured layers, ascending.
    pub(super) layers: Vec<usize>,
    pub(super) log: Log,
}

impl Deepseek4State {
    pub(super) fn new(cfg: &Deepseek4Config) -> Deepseek4State {
        let comp = |ratio: usize, width: usize, overlap: bool| {
            let cw = if overlap { 2 * width } else { width };
            CompState {
                ratio,
                tokens: Log::new(2 * cw),
                rows: Log::new(width),
            }
        };
        let layers = cfg
            .layers
            .iter()
            .map(|&kind| LayerState {
                kv: Log::new(cfg.head_dim),
                comp: match kind {
                    V4Attention::Sliding => None,
                    V4Attention::Csa { ratio } => Some(comp(ratio, cfg.head_dim, true)),
                    V4Attention::Hca { ratio } => Some(comp(ratio, cfg.head_dim, false)),
                },
                index: match kind {
                    V4Attention::Csa { ratio } => Some(comp(ratio, cfg.indexer_dim, true)),
                    _ => None,
                },
            })
            .collect();
        Deepseek4State {
            layers,
            len: 0,
            floor: 0,
            window: cfg.window,
            capture: None,
        }
    }

    /// Width of a captured row (0 when the state does not capture).
    pub fn capture_width(&self) -> usize {
        self.capture.as_ref().map_or(0, |c| c.log.width)
    }

    /// The layers whose input rows this state captures (empty when it does not).
    pub fn capture_layers(&self) -> &[usize] {
        self.capture.as_ref().map_or(&[], |c| &c.layers)
    }

    /// The captured rows of positions `from..to`, contiguous (`(to − from) ×`
    /// [`Deepseek4State::capture_width`] values); `None` when the state does not capture or
    /// a row is not held (beyond the computed length, or released: rows before the sliding
    /// window of the last forward's first position are dropped as the raw KV rows are).
    pub fn captured(&self, from: usize, to: usize) -> Option<&[f32]> {
        let c = self.capture.as_ref()?;
        let w = c.log.width;
        if from > to || to > self.len || from < c.log.base {
            return None;
        }
        let (a, b) = ((from - c.log.base) * w, (to - c.log.base) * w);
        c.log.data.get(a..b)
    }

    /// Positions computed.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is computed.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The lowest length the state can be truncated to (the first position of the last
    /// forward): everything before it that no later query reads was released.
    pub fn floor(&self) -> usize {
        self.floor
    }

    /// Cuts the state back to `len` positions — exactly the state it had at that length
    /// (speculative rollback). `len` above the current length changes nothing; below
    /// [`Deepseek4State::floor`] is an error and changes nothing.
    pub fn truncate(&mut self, len: usize) -> Result<(), ModelError> {
        if len < self.floor {
            return Err(ModelError::Batch(format!(
                "cannot truncate to {len} positions: the state before position {} was released",
                self.floor
            )));
        }
        if len < self.len {
            self.cut(len);
        }
        Ok(())
    }

    /// Cuts every log to `len` positions (also logs a failed forward left longer than
    /// `self.len`).
    pub(super) fn cut(&mut self, len: usize) {
        if let Some(c) = &mut self.capture {
            c.log.truncate(len);
        }
        for l in &mut self.layers {
            l.kv.truncate(len);
            for c in l.comp.iter_mut().chain(l.index.iter_mut()) {
                c.tokens.truncate(len);
                c.rows.truncate(len / c.ratio);
            }
        }
        self.len = self.len.min(len);
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.capture.as_ref().map_or(0, |c| c.log.bytes())
            + self
                .layers
                .iter()
                .map(|l| {
                    l.kv.bytes()
                        + l.comp
                            .iter()
                            .chain(l.index.iter())
                            .map(|c| c.tokens.bytes() + c.rows.bytes())
                            .sum::<usize>()
                })
                .sum::<usize>()
    }

    /// Starts a forward at `first` (validated: `floor ≤ first ≤ len`): cut back, raise the
    /// floor, release what no query at `first` or later reads.
    pub(super) fn begin(&mut self, first: usize) {
        let _ = self.truncate(first);
        self.floor = first;
        if let Some(c) = &mut self.capture {
            // A drafter reads the rows of the window before its anchor (at `first` or later).
            c.log.forget_before((first + 1).saturating_sub(self.window));
        }
        for l in &mut self.layers {
            l.kv.forget_before((first + 1).saturating_sub(self.window));
            for c in l.comp.iter_mut().chain(l.index.iter_mut()) {
                // Re-emitting row `first/m` needs window `first/m − 1` (CSA's A half).
                c.tokens
                    .forget_before((first / c.ratio).saturating_sub(1) * c.ratio);
            }
        }
    }
}
