//! Progress on stderr: an indicatif bar on a terminal, plain periodic lines otherwise
//! (logs, CI), or nothing.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{HumanBytes, ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How a pull reports progress (always on stderr).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// Nothing is printed.
    Hidden,
    /// Plain lines: one every 10 % or every few seconds, for logs and pipes.
    Lines,
    /// An interactive progress bar (indicatif).
    Bar,
}

impl Progress {
    /// A bar when stderr is a terminal, plain lines otherwise (the CLI's choice).
    pub fn auto() -> Self {
        if std::io::stderr().is_terminal() {
            Progress::Bar
        } else {
            Progress::Lines
        }
    }

    /// A bar when stderr is a terminal, nothing otherwise (for library callers such as
    /// tests that fetch a model on first use).
    pub fn terminal_only() -> Self {
        if std::io::stderr().is_terminal() {
            Progress::Bar
        } else {
            Progress::Hidden
        }
    }

    /// Prints one status line (unless hidden).
    pub(crate) fn note(self, msg: &str) {
        if self != Progress::Hidden {
            eprintln!("{msg}");
        }
    }
}

/// A byte counter for one phase (download, assembly), drawn per [`Progress`].
pub(crate) struct Meter {
    mode: Progress,
    label: String,
    total: u64,
    pos: u64,
    bar: Option<ProgressBar>,
    last_line: Instant,
    last_decile: u64,
    started: Instant,
}

/// Lines mode prints at least this often...
const LINE_INTERVAL: Duration = Duration::from_secs(10);
/// ...and at 10 % steps, but not closer together than this.
const MIN_LINE_GAP: Duration = Duration::from_millis(500);

impl Meter {
    /// Starts a phase of `total` bytes, `start` of which are already done.
    pub(crate) fn new(mode: Progress, label: impl Into<String>, total: u64, start: u64) -> Meter {
        let label = label.into();
        let bar = (mode == Progress::Bar).then(|| {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            let style = ProgressStyle::with_template(
                "{msg} [{wide_bar}] {bytes}/{total_bytes} {bytes_per_sec} {eta}",
            )
            .map(|s| s.progress_chars("=> "))
            .unwrap_or_else(|_| ProgressStyle::default_bar());
            bar.set_style(style);
            bar.set_message(label.clone());
            bar.set_position(start);
            bar
        });
        let now = Instant::now();
        let m = Meter {
            mode,
            label,
            total,
            pos: start,
            bar,
            last_line: now,
            last_decile: decile(start, total),
            started: now,
        };
        if mode == Progress::Lines {
            m.line();
        }
        m
    }

    /// Records `n` more bytes.
    pub(crate) fn inc(&mut self, n: u64) {
        self.pos = self.pos.saturating_add(n);
        match self.mode {
            Progress::Hidden => {}
            Progress::Bar => {
                if let Some(bar) = &self.bar {
                    bar.set_position(self.pos);
                }
            }
            Progress::Lines => {
                let d = decile(self.pos, self.total);
                let since = self.last_line.elapsed();
                if (d != self.last_decile && since >= MIN_LINE_GAP) || since >= LINE_INTERVAL {
                    self.last_decile = d;
                    self.last_line = Instant::now();
                    self.line();
                }
            }
        }
    }

    fn line(&self) {
        let pct = self
            .pos
            .saturating_mul(100)
            .checked_div(self.total)
            .unwrap_or(100);
        eprintln!(
            "{}: {pct:>3}% ({} / {})",
            self.label,
            HumanBytes(self.pos),
            HumanBytes(self.total)
        );
    }

    /// Ends the phase (the bar is cleared; lines mode prints a closing line).
    pub(crate) fn finish(self) {
        match self.mode {
            Progress::Hidden => {}
            Progress::Bar => {
                if let Some(bar) = &self.bar {
                    bar.finish_and_clear();
                }
                let secs = self.started.elapsed().as_secs_f64();
                eprintln!(
                    "{}: done, {} in {secs:.1} s",
                    self.label,
                    HumanBytes(self.pos)
                );
            }
            Progress::Lines => {
                if self.last_decile != 10 {
                    self.line();
                }
            }
        }
    }
}

impl Drop for Meter {
    fn drop(&mut self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

fn decile(pos: u64, total: u64) -> u64 {
    pos.min(total)
        .saturating_mul(10)
        .checked_div(total)
        .unwrap_or(10)
}
