//! The byte decoder every fuzz target reads its choices from.

/// A tiny byte-driven decoder. Reading past the end yields zeros, so every input decodes, and a
/// shorter input means simpler choices (choice 0 is always the plainest one).
#[derive(Debug, Clone)]
pub struct Bytes<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Bytes<'a> {
    /// A decoder over `data`.
    pub fn new(data: &'a [u8]) -> Bytes<'a> {
        Bytes { data, pos: 0 }
    }

    /// The next byte (0 past the end).
    pub fn byte(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos = self.pos.saturating_add(1);
        b
    }

    /// A number in `0..n` (0 when `n <= 1`).
    pub fn below(&mut self, n: usize) -> usize {
        match n {
            0 | 1 => 0,
            2..=256 => self.byte() as usize % n,
            _ => (usize::from(self.byte()) << 8 | usize::from(self.byte())) % n,
        }
    }

    /// True with probability `p / 256`.
    pub fn chance(&mut self, p: u8) -> bool {
        // An exhausted input reads 0, which is "no": faults and extras stop.
        let b = self.byte();
        b != 0 && b <= p
    }

    /// How many bytes were read so far (past the end counts too).
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Whether every byte was read.
    pub fn exhausted(&self) -> bool {
        self.pos >= self.data.len()
    }
}
