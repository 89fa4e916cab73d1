//! A tiny reader that turns fuzzer bytes into choices. Reading past the end yields zeros, so every
//! byte string is a valid program and short inputs mean "the simplest choice everywhere".

pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Input { data }
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    pub fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }

    pub fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    pub fn u64(&mut self) -> u64 {
        (u64::from(self.u32()) << 32) | u64::from(self.u32())
    }

    /// A value in `0..n` (`n` > 0), from one byte when `n` fits in one.
    pub fn below(&mut self, n: usize) -> usize {
        debug_assert!(n > 0);
        if n <= 256 {
            usize::from(self.u8()) % n
        } else {
            self.u32() as usize % n
        }
    }

    /// An integer that is often small, sometimes negative, sometimes extreme.
    pub fn int(&mut self) -> i64 {
        match self.u8() % 8 {
            0 => 0,
            1 => -(i64::from(self.u8())),
            2 => i64::MAX,
            3 => i64::MIN,
            4 => self.u64() as i64,
            _ => i64::from(self.u16()),
        }
    }

    /// Up to `max` bytes as text (invalid UTF-8 is replaced, so the result is always a str).
    pub fn text(&mut self, max: usize) -> String {
        let n = self.below(max + 1).min(self.data.len());
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        String::from_utf8_lossy(head).into_owned()
    }

    /// The rest of the input.
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.data)
    }
}
